"""The gradient pack and its reduce-scatter as one op off the compute stream
(passes/reduce_off_compute_stream.py, NOTE: the reduce-scatter off the compute stream in
fsdp_compile/reduce_stream.py): the gradients are the two ops', the collectives and their
waits are where schedule_collectives put them, and on CUDA the pack runs off the compute stream.

On the CPU the pass applies to CUDA graphs only, so these tests make it apply to CPU graphs
(``_on_cuda``); off CUDA the op is the pack then the functional reduce-scatter, so what they
check is the rewrite and Inductor's handling of it. The stream itself is checked on a GPU.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fsdp_compile import MfsdpBackend, MixedPrecision, fully_shard
from fsdp_compile.patterns import (
    count_collectives,
    is_collective,
    is_pack_for_reduce_scatter,
    is_reduce_scatter,
    is_wait,
)
from fsdp_compile.testing.models import TransformerConfig, loss_fn, make_batch
from harness import build_model, fake_process_group

the_pass = importlib.import_module("fsdp_compile.passes.reduce_off_compute_stream")
_MIXED = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _step(device: str, compiler: str, fused: bool, monkeypatch, capture: bool = False):
    """Gradients of one compiled step on a fake world of 8 and its backward graph, with the
    pass applying (``fused``) or not."""
    monkeypatch.setattr(the_pass, "_on_cuda", lambda node: fused)
    cfg = TransformerConfig(n_layers=3)
    with fake_process_group(8):
        torch.manual_seed(0)
        model = fully_shard(build_model(cfg).to(device), mp_policy=_MIXED)
        backend = MfsdpBackend(compiler=compiler, compile_cache=False)
        tokens, targets = (t.to(device) for t in make_batch(cfg, 2, 8, 0))
        step = torch.compile(model, backend=backend)
        loss_fn(step(tokens), targets).backward()
        grads = {name: p.grad.to_local().clone() for name, p in model.named_parameters() if p.grad is not None}
        (graph,) = backend.graphs
    return grads, graph.compiled["backward"]


def _events(gm) -> list[str]:
    return ["issue" if is_collective(n) else "wait" for n in gm.graph.nodes if is_collective(n) or is_wait(n)]


@pytest.mark.structure
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_one_op_reduces_the_gradients_the_pack_and_reduce_scatter_did(compiler, monkeypatch):
    apart, two_ops = _step("cpu", compiler, False, monkeypatch)
    together, one_op = _step("cpu", compiler, True, monkeypatch)
    assert apart.keys() == together.keys()
    for name in apart:
        torch.testing.assert_close(together[name], apart[name], rtol=0, atol=0, msg=name)
    assert count_collectives(one_op.graph) == count_collectives(two_ops.graph)
    assert _events(one_op) == _events(two_ops)  # each reduce-scatter issued and waited in place
    nodes = list(one_op.graph.nodes)
    fused = [n for n in nodes if is_reduce_scatter(n)]
    assert fused and all(n.target is the_pass.PACK_AND_REDUCE_SCATTER for n in fused)
    assert not any(is_pack_for_reduce_scatter(n) for n in nodes)
    assert all(is_wait(user) for n in fused for user in n.users)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream is CUDA's")
def test_on_cuda_the_pack_runs_off_the_compute_stream(monkeypatch, tmp_path):
    apart, _ = _step("cuda", "inductor", False, monkeypatch)
    together, _ = _step("cuda", "inductor", True, monkeypatch)
    for name in apart:
        torch.testing.assert_close(together[name], apart[name], rtol=0, atol=0, msg=name)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step("cuda", "inductor", True, monkeypatch)
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    kernels = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    pack_streams = {e["args"]["stream"] for e in kernels if "chunk_cat" in e["name"]}
    other_streams = {e["args"]["stream"] for e in kernels if "chunk_cat" not in e["name"]}
    assert pack_streams and len(other_streams) > 1 and not pack_streams <= {min(other_streams)}
