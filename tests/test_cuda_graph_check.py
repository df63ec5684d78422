"""options={"cuda_graph": True}: everything a CUDA graph cannot capture is refused at compile
time with the node, the user's source line and the fix; the test transformer passes."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.testing.models import TransformerConfig, loss_fn, make_batch
from fsdp_compile.passes import CudaGraphIncompatible, GraphBreakUnderCudaGraph, check_cuda_graph
from harness import build_model, fake_process_group

pytestmark = pytest.mark.structure

aten = torch.ops.aten


def _compile_and_run(fn, *inputs, dynamic=False):
    backend = MfsdpBackend(compiler="eager", cuda_graph=True)
    return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)(*inputs)


def _reads_item(x):
    return x * (x > 0).sum().item()


def _reads_tolist(x):
    return x * (x > 0).sum().tolist()


def _boolean_mask(x):
    return x[x > 0].sum() * x


@pytest.mark.parametrize(
    "fn, message, source",
    [
        (_reads_item, r"\.item\(\)", "(x > 0).sum().item()"),
        (_reads_tolist, r"\.tolist\(\)", "(x > 0).sum().tolist()"),
        (_boolean_mask, "data-dependent size|sizes its output from tensor data", "x[x > 0]"),
    ],
    ids=["item", "tolist", "nonzero"],
)
def test_host_syncs_are_refused_with_node_and_source_line(fn, message, source):
    x = torch.randn(8, requires_grad=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        with pytest.raises(CudaGraphIncompatible, match=message) as error:
            _compile_and_run(fn, x)
    assert "test_cuda_graph_check.py" in str(error.value)
    assert source in str(error.value)
    assert "Fix:" in str(error.value)


def test_dynamic_shapes_are_refused():
    with pytest.raises(CudaGraphIncompatible, match="dynamic-shape input.*dynamic=False"):
        _compile_and_run(lambda x: (x * 2).sum(), torch.randn(8, requires_grad=True), dynamic=True)


def _graph_with(target, args_vals, out_val, *, trace: str) -> fx.GraphModule:
    """A hand-built graph: placeholders from ``args_vals`` (fake tensors), one call, output."""
    graph = fx.Graph()
    args = []
    for i, val in enumerate(args_vals):
        node = graph.placeholder(f"x{i}")
        node.meta["val"] = val
        args.append(node)
    call = graph.call_function(target, tuple(args) + (() if args else ([4],)))
    call.meta["val"] = out_val
    call.meta["stack_trace"] = trace
    graph.output((call,))
    return fx.GraphModule(torch.nn.Module(), graph)


TRACE = '  File "/src/model.py", line 42, in forward\n    buf = torch.zeros(4)\n'


def test_cpu_tensor_created_in_a_cuda_step_is_refused():
    with FakeTensorMode():
        weight = torch.empty(4, device="cuda")
        host = torch.empty(4)
    gm = _graph_with(aten.add.Tensor, [weight], host, trace=TRACE)
    with pytest.raises(CudaGraphIncompatible, match=r"creates a CPU tensor inside a cuda:0 step.*model.py, line 42.*torch.zeros\(4\)"):
        check_cuda_graph(gm, plan=None)


def test_host_side_storage_resize_is_refused():
    with FakeTensorMode():
        weight = torch.empty(4, device="cuda")
    gm = _graph_with(aten.resize_.default, [weight], weight, trace=TRACE)
    with pytest.raises(CudaGraphIncompatible, match="resizes a tensor's storage"):
        check_cuda_graph(gm, plan=None)


def test_cpu_tensors_in_a_cpu_step_are_fine():
    with FakeTensorMode():
        host = torch.empty(4)
    check_cuda_graph(_graph_with(aten.add.Tensor, [host], host, trace=TRACE), plan=None)


@pytest.mark.parametrize(
    "cfg",
    [
        TransformerConfig(),
        TransformerConfig(n_layers=2, n_experts=4, top_k=2, fused_experts=True),
        TransformerConfig(n_layers=2, n_experts=4, top_k=2, fused_experts=False),
    ],
    ids=["transformer", "moe-fused-experts", "moe-modulelist-experts"],
)
def test_sharded_models_pass_the_check(cfg):
    """The collectives the backend inserts need no host sync, CPU tensor or resize, and
    static-capacity MoE routing needs no nonzero: all capturable as they are."""
    with fake_process_group(8):
        model = fully_shard(build_model(cfg))
        backend = MfsdpBackend(compiler="eager", cuda_graph=True)
        tokens, targets = make_batch(cfg, 2, 8, 0)
        loss_fn(torch.compile(model, backend=backend, dynamic=False)(tokens), targets).backward()
    assert len(backend.graphs) == 1


class _CheckpointedDropout(torch.nn.Module):
    """Blocks with dropout, each called through ``torch.utils.checkpoint``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1)) for _ in range(2)
        )

    def forward(self, h):
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return h.sum()


def test_a_checkpointed_block_that_drops_out_is_refused():
    """Its recompute replays the forward's random state, which the step reads on the host
    (see fsdp_compile/passes/save_block_rng.py): refused, with the fix."""
    with fake_process_group(2), pytest.raises(CudaGraphIncompatible, match="random generators' state.*dropout") as error:
        model = fully_shard(_CheckpointedDropout())
        torch.compile(model, backend=MfsdpBackend(compiler="eager", cuda_graph=True))(torch.randn(4, 8)).backward()
    assert "Fix: set the dropout of blocks that torch.utils.checkpoint wraps to 0" in str(error.value)


class _SyncsOnTheHost(torch.nn.Module):
    """A sharded layer, then a host sync of the kind Dynamo breaks the graph on."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        if self.kind == "loop":
            for layer in self.layers:
                x = layer(x)
                if x.sum() > 1e6:  # a break inside a loop: Dynamo runs the whole frame in Python
                    x = x * 0
            return x
        h = self.layers[0](x)
        if self.kind == "item":
            return self.layers[1](h * h.sum().item())
        if self.kind == "tolist":
            return self.layers[1](h * sum(h.sum(1).tolist()))
        if h.sum() > 0:  # "if": a Python branch on a tensor
            h = h * 2
        return self.layers[1](h)


@pytest.mark.parametrize(
    "kind, line",
    [
        ("item", "h * h.sum().item()"),
        ("tolist", "h * sum(h.sum(1).tolist())"),
        ("if", "if h.sum() > 0:"),
        ("loop", "_SyncsOnTheHost"),
    ],
)
def test_graph_breaks_are_refused_naming_the_line(kind, line):
    """Code Dynamo leaves to Python between graphs is read by no check: a host sync there
    passed compilation and failed only inside CUDA graph capture (seen with .item())."""
    with fake_process_group(2):
        model = fully_shard(_SyncsOnTheHost(kind))
        backend = MfsdpBackend(compiler="eager", cuda_graph=True)
        with pytest.raises(GraphBreakUnderCudaGraph) as error:
            torch.compile(model, backend=backend, dynamic=False)(torch.randn(4, 8))
    message = str(error.value)
    assert "test_cuda_graph_check.py" in message and "Fix:" in message
    assert line in message or (kind == "loop" and "forward" in message and "loop" in message), message


@pytest.mark.parametrize("kind, line", [("item", "h * h.sum().item()"), ("loop", "_SyncsOnTheHost")])
def test_graph_breaks_without_cuda_graph_compile_and_are_said(kind, line):
    """Without cuda_graph a break compiles, and is said once, naming the line: what runs in
    Python between the graphs gathers parameter by parameter, outside mfsdp's plan (every
    layer of HF's activation_checkpointing_enable(offload=True) did so, unsaid)."""
    with fake_process_group(2), pytest.warns(UserWarning, match="the step is not one graph") as said:
        model = fully_shard(_SyncsOnTheHost(kind))
        backend = MfsdpBackend(compiler="eager")
        torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
    assert len(backend.graphs) == 2
    (message,) = [str(w.message) for w in said if "the step is not one graph" in str(w.message)]  # once
    assert "test_cuda_graph_check.py" in message, message
    assert line in message or (kind == "loop" and "forward" in message and "loop" in message), message
