"""Pass (partitioned forward and backward graphs): refuse what a CUDA graph cannot capture.

Runs only with ``options={"cuda_graph": True}``. Each finding names the node, the user source
line it came from, and the fix (docs/cuda_graphs.md lists them all).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

from fsdp_compile.errors import CompileUsageError
from fsdp_compile.patterns import is_rng_state
from fsdp_compile.plan import Plan

aten = torch.ops.aten

# Ops whose result the host must wait for: a stream sync, forbidden during capture.
HOST_SYNC_OPS = {
    aten._local_scalar_dense.default: "reads a tensor value on the host (.item() / .tolist())",
    aten.nonzero.default: "sizes its output from tensor data (nonzero / boolean-mask indexing)",
    aten.masked_select.default: "sizes its output from tensor data (masked_select)",
    aten.unique_consecutive.default: "sizes its output from tensor data (unique_consecutive)",
    aten._unique2.default: "sizes its output from tensor data (unique)",
    aten.repeat_interleave.Tensor: "sizes its output from tensor data (repeat_interleave)",
    aten.item.default: "reads a tensor value on the host (.item())",
}
# Storage the host frees or resizes: a replay would reuse stale or released memory.
STORAGE_OPS = {
    aten.resize_.default: "resizes a tensor's storage on the host (resize_)",
    aten.set_.source_Storage: "swaps a tensor's storage on the host (set_)",
    aten.set_.source_Storage_storage_offset: "swaps a tensor's storage on the host (set_)",
    torch.ops.inductor.resize_storage_bytes_.default: "resizes storage on the host (resize_storage_bytes_)",
}
FIXES = {
    "sync": "keep values on the device (torch.where / masks instead of .item(), nonzero or "
    "boolean indexing; fixed-capacity routing for MoE)",
    "storage": "leave memory to the graph's pool; never free or resize storage inside the step",
    "host": "create tensors on the step's device (device=... argument) or pass them in as inputs",
    "dynamic": "give the step static shapes: pad inputs to a fixed size, and compile with "
    "dynamic=False (torch.compile(..., dynamic=False))",
    "data_dependent": "make the size static (fixed capacity, padding) instead of data-dependent",
    "rng": "set the dropout of blocks that torch.utils.checkpoint wraps to 0, or leave "
    "cuda_graph off",
}


class CudaGraphIncompatible(CompileUsageError):
    """The step contains something a CUDA graph cannot capture; the message says what and where."""


# Frames of the marker machinery: a gather's stack ends in the property getter, but the line
# worth showing is the user's read of the parameter one frame up.
_MACHINERY = tuple(str(Path(__file__).parents[1] / name) for name in ("gathered_reads.py", "markers.py"))


def _user_line(node: fx.Node) -> str:
    """The innermost user frame of the node's stack trace, e.g. 'model.py, line 42, in f: ...'."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").strip().splitlines()]
    frames = [
        i
        for i, line in enumerate(lines)
        if line.startswith("File ") and not any(m in line for m in _MACHINERY)
    ]
    if not frames:
        return "no source line recorded"
    last = frames[-1]
    where = lines[last].removeprefix("File ").replace('"', "")
    code = lines[last + 1] if last + 1 < len(lines) and not lines[last + 1].startswith("File ") else ""
    return f"{where}: {code}".strip()


def _step_device(gm: fx.GraphModule) -> torch.device | None:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.device.type != "cpu":
            return val.device
    return None


def _creates_host_tensor(node: fx.Node, device: torch.device | None) -> bool:
    """A non-scalar CPU tensor made inside a step that runs on an accelerator."""
    val = node.meta.get("val")
    if device is None or node.op != "call_function" or not isinstance(val, torch.Tensor):
        return False
    return val.device.type == "cpu" and val.ndim > 0


def _findings(gm: fx.GraphModule) -> list[tuple[fx.Node, str, str]]:
    device = _step_device(gm)
    rules: list[tuple[Callable[[fx.Node], bool], Callable[[fx.Node], str], str]] = [
        (lambda n: n.target in HOST_SYNC_OPS, lambda n: HOST_SYNC_OPS[n.target], "sync"),
        (lambda n: n.target in STORAGE_OPS, lambda n: STORAGE_OPS[n.target], "storage"),
        (
            lambda n: bool(free_unbacked_symbols(n.meta.get("val"))),
            lambda n: "has a data-dependent size",
            "data_dependent",
        ),
        (
            lambda n: n.op == "placeholder" and bool(free_symbols(n.meta.get("val"))),
            lambda n: f"is a dynamic-shape input ({n.meta.get('val')})",
            "dynamic",
        ),
        (
            is_rng_state,
            lambda n: "reads the random generators' state on the host, for the backward's "
            "recompute of a checkpointed block that draws random numbers (dropout)",
            "rng",
        ),
        (
            lambda n: _creates_host_tensor(n, device),
            lambda n: f"creates a CPU tensor inside a {device} step",
            "host",
        ),
    ]
    found = []
    for node in gm.graph.nodes:
        for matches, describe, fix in rules:
            if matches(node):
                found.append((node, describe(node), fix))
                break
    return found


def check_cuda_graph(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards (when it returns) the graph has no host sync, no data-dependent or dynamic
    shape, no CPU tensor created in an accelerator step, no read of the random generators'
    state, and no host-side storage free or resize: it can be captured whole in a CUDA graph.
    Otherwise raises ``CudaGraphIncompatible`` naming the first offending node and its source
    line.
    """
    found = _findings(gm)
    if not found:
        return gm
    node, what, fix = found[0]
    more = f" ({len(found) - 1} more finding(s) after this one)" if len(found) > 1 else ""
    raise CudaGraphIncompatible(
        f"cuda_graph=True: node {node.name!r} ({node.target}) {what}, from "
        f"{_user_line(node)}. Fix: {FIXES[fix]}.{more}"
    )
