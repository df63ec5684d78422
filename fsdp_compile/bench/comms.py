"""What one training step runs: its collectives, counted two ways, and its device kernels.

- ``graph_census``: from the forward and backward graphs the ``mfsdp`` backend compiled (what a
  compiled step launches, by construction). Bytes are the full-size tensors
  (``fsdp_compile.patterns.CollectiveFacts``: all-gather outputs, reduced inputs).
- ``profiled_census``: what actually reached the c10d dispatcher during one step, recorded by
  ``torch.profiler`` (CPU activity, ``record_shapes``). The profiler records every dispatcher
  op, including the ones run inside our eager markers (custom ops, which hide their inner ops
  from a ``TorchDispatchMode`` such as ``CommDebugMode``) and FSDP2's hook-driven
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; functional collectives reach the same
  c10d ops, so a compiled step can be checked against its graphs. A replayed CUDA graph
  dispatches nothing and shows no collectives.
- ``kernel_census``: on a GPU, the same profiled step's kernels (CUDA activity), so a step
  time can be split into device time and host time, and two modes compared by kernel; with
  the attention kernels by SDPA backend (``attention_backend``).
- ``attention_op_census``: the SDPA backends the step dispatched, on any device. A replayed
  CUDA graph dispatches none: its kernels still say which backend it captured.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from torch.autograd import DeviceType
from torch.profiler import profile

from fsdp_compile.backend import CompiledGraph
from fsdp_compile.patterns import GATHER_WHOLE_MEMBERS, collective_facts, is_collective
from fsdp_compile.cost_model import with_bodies

# c10d ops by kind, with the argument that carries the full-size tensor (all-gather output,
# reduce-scatter input); the list-based ops record no shapes, so their bytes are unknown.
_C10D_OPS = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", None),
    "c10d::allgather_coalesced_": ("all_gather", None),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", None),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", None),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", None),
    "c10d::allreduce_": ("all_reduce", None),
    "c10d::allreduce_coalesced_": ("all_reduce", None),
    "c10d::alltoall_base_": ("all_to_all", 1),
}
# The profiler names dtypes as C++ does.
_PROFILER_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2}


_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _empty_census(counted_by: str) -> dict:
    return {**{k: 0 for k in _KINDS}, **{f"{k}_bytes": 0 for k in _KINDS}, "counted_by": counted_by}


def graph_census(graphs: Iterable[CompiledGraph]) -> dict:
    """Collectives of one step: every compiled graph's forward plus backward, and each repeated
    block's compiled body once per call the step makes of it (``cost_model.with_bodies``: an
    expert all-to-all or tensor parallelism's collectives live in its block's body; NOTE: one
    op per block call).

    Sums over all graphs the backend compiled, which is one step when each frame compiled
    once (a graph break adds frames that all run each step; a recompile would overcount, and
    then disagrees with ``profiled_census``).
    """
    census = _empty_census("compiled graphs (forward + backward)")
    by_dtype: dict[str, int] = {}
    step = (g for compiled in graphs for role in ("forward", "backward") for g in with_bodies(getattr(compiled, role)))
    for gm in step:
        for node in gm.graph.nodes:
            if is_collective(node):
                facts = collective_facts(node)
                census[facts.kind] += 1
                census[f"{facts.kind}_bytes"] += facts.nbytes
                if facts.kind == "all_gather":
                    for dtype, nbytes in facts.bytes_by_dtype.items():
                        name = str(dtype).removeprefix("torch.")
                        by_dtype[name] = by_dtype.get(name, 0) + nbytes
    # What the gathers carry (float8 weights travel as uint8 bytes but count as float8).
    census["all_gather_bytes_by_dtype"] = dict(sorted(by_dtype.items()))
    return census


def profiled_census(prof: profile) -> dict:
    """Collectives the profiled step dispatched; bytes are None when an op recorded no shapes.

    A flat gathered member by member (``fsdp_compile::gather_whole_members``) is one gather, as
    in the graphs, whatever c10d ops it issues (one group on NCCL, a gather per member on gloo);
    its bytes are theirs."""
    census = _empty_census("torch.profiler: c10d ops dispatched during one step")
    for event in prof.events():
        if _issued_by_whole_gather(event):
            continue
        if event.name == _WHOLE_GATHER:
            kind = "all_gather"
            sizes = [_event_bytes(e, 0) for e in _descendants(event) if e.name == "c10d::_allgather_base_"]
            size = None if not sizes or None in sizes else sum(sizes)
        else:
            kind, full_arg = _C10D_OPS.get(event.name, (None, None))
            if kind is None:
                continue
            size = _event_bytes(event, full_arg)
        census[kind] += 1
        bytes_key = f"{kind}_bytes"
        if size is None or census[bytes_key] is None:
            census[bytes_key] = None
        else:
            census[bytes_key] += size
    return census


_WHOLE_GATHER = GATHER_WHOLE_MEMBERS.name()  # the name the profiler records the op by


def _issued_by_whole_gather(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == _WHOLE_GATHER:
            return True
        parent = parent.cpu_parent
    return False


def _descendants(event) -> Iterable:
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def kernel_census(prof: profile, step_ms: float, top: int = 12) -> dict:
    """The device kernels of the profiled step: their summed time against the step's wall
    time (well below it: the step waits on the host, launches or syncs), and the ``top``
    names by summed time, each ``[ms, launches]``. Kernels on two streams at once count
    twice; the fake process group launches no communication kernel."""
    by_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            entry = by_name.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us() / 1e3
            entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])
    attention: dict[str, list[float]] = {}
    for name, (ms, n) in by_name.items():
        backend = attention_backend(name)
        if backend:
            entry = attention.setdefault(backend, [0.0, 0])
            entry[0] += ms
            entry[1] += n
    return {
        "step_ms": step_ms,
        "kernel_ms": sum(ms for ms, _ in by_name.values()),
        "launches": sum(n for _, n in by_name.values()),
        "top": {name: [ms, n] for name, (ms, n) in ranked[:top]},
        "attention": dict(sorted(attention.items())),
    }


# NOTE: attention by backend
#     SDPA runs one of four backends, which the ATen op's name says
#     (``aten::_scaled_dot_product_{flash_attention[_for_cpu],efficient_attention,
#     cudnn_attention,attention_math}[_backward]``) and, on CUDA, its kernels' names:
#     FlashAttention's ``pytorch_flash::flash_fwd_kernel<...>`` and ``flash_bwd_*``, the
#     memory-efficient ``fmha_cutlassF_*(PyTorchMemEffAttention::...)`` and ``fmha_cutlassB_*``,
#     cuDNN's ``cudnn_generated_*sdpa*`` (checked first: its names may say "flash" too). The
#     math backend is plain matmuls and a softmax, no kernel of its own. Two kinds of name
#     mention a backend without being one: Inductor names a fused kernel after the ops it
#     came from (``triton_poi_fused__scaled_dot_product_efficient_attention_0`` pads the
#     mask), and the ``aten::_flash_attention_forward``-style ops run inside the SDPA op,
#     which is already counted.
_ATTENTION_BACKENDS = (
    ("cudnn", ("cudnn",)),
    ("flash", ("flash",)),
    ("efficient", ("efficient", "fmha", "memeffattention")),
    ("math", ("attention_math",)),
)


def attention_backend(name: str) -> str | None:
    """The SDPA backend a kernel or ATen op belongs to, or None (NOTE: attention by backend)."""
    lowered = name.lower()
    other_aten_op = lowered.startswith("aten::") and not lowered.startswith("aten::_scaled_dot_product_")
    if other_aten_op or lowered.startswith("triton"):
        return None
    return next((backend for backend, marks in _ATTENTION_BACKENDS if any(m in lowered for m in marks)), None)


def attention_op_census(prof: profile) -> dict[str, int]:
    """SDPA ops the profiled step dispatched, by backend, backward ops apart
    (``{"flash": 32, "flash_backward": 32}``)."""
    census: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type == DeviceType.CPU and event.name.startswith("aten::"):
            backend = attention_backend(event.name)
            if backend:
                census[backend + ("_backward" if event.name.endswith("_backward") else "")] += 1
    return dict(sorted(census.items()))


def _event_bytes(event, arg: int | None) -> int | None:
    # Older torch (2.11) records no dtypes: the bytes are then unknown.
    dtypes = getattr(event, "input_dtypes", None)
    if arg is None or dtypes is None or not event.input_shapes[arg:]:
        return None
    element_size = _PROFILER_DTYPE_BYTES.get(dtypes[arg])
    if element_size is None or not event.input_shapes[arg]:
        return None
    numel = 1
    for size in event.input_shapes[arg]:
        numel *= size
    return numel * element_size


def issued_census(issued: list[tuple[str, int]]) -> dict:
    """Collectives an emulated link was given during one step (``EmulatedLinkGroup.issued``):
    a Python process group's collectives dispatch no c10d op the profiler could record."""
    census = _empty_census("emulated link: collectives issued during one step")
    for kind, nbytes in issued:
        census[kind] += 1
        census[f"{kind}_bytes"] += nbytes
    return census
