"""Repeated blocks compile once, and a block that differs never borrows another's body.

A block body is shared between layers only when Dynamo's guards for everything the body read
hold for the other layer (NOTE: one body per repeated block, in fsdp_compile/regions.py). The
soundness tests change one layer of four in each thing a body can depend on, and compare loss
and every gradient with the unsharded model: a stamped-out body with layer 0's value baked in
is off by far more than rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.testing.models import RMSNorm, TransformerConfig, loss_fn, make_batch
from fsdp_compile.passes import saved_gathered_params
from fsdp_compile.patterns import count_collectives, is_all_gather
from fsdp_compile.regions import is_region
from harness import (
    assert_parity,
    build_model,
    compile_one_step,
    fake_process_group,
    full_parameters,
    parity_run,
    relative_error,
    spawn,
)

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
CFG = TransformerConfig(n_layers=4)


def _calls(gm) -> list[str]:
    """The body each invoke_subgraph call of a graph runs."""
    return [n.args[0].target for n in gm.graph.nodes if n.op == "call_function" and n.target is INVOKE_SUBGRAPH]


def _compiled_step(cfg=CFG, world=8, **options):
    with fake_process_group(world):
        model = fully_shard(build_model(cfg))
        graph = compile_one_step(model, cfg, **options)
    return model, graph


@pytest.mark.structure
def test_the_joint_trace_builds_each_body_schema_once(monkeypatch):
    """AOTAutograd asks for a body's schema at every call (torch traces the body again to build
    it); with compat.body_schema_once it is built once per body, however many layers call it.
    (Symbolic sizes in its key: tests/test_recompile.py, whose second shape compiles dynamic.)"""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    built = []
    original = InvokeSubgraphHOP.gen_schema

    def counting(self, subgraph, identifier, *operands):
        built.append(identifier)
        return original(self, subgraph, identifier, *operands)

    monkeypatch.setattr(InvokeSubgraphHOP, "gen_schema", counting)
    _compiled_step(TransformerConfig(n_layers=6))
    assert built and len(built) == len(set(built)), built


@pytest.mark.structure
def test_each_layer_calls_one_body_and_the_collectives_stay_outside():
    """Four identical layers: Dynamo's graph calls one body four times, AOTAutograd partitions it
    once, and every gather and reduce-scatter is in the outer graphs, one bucket per layer,
    where the schedule prefetches the next layer's gather ahead of this layer's body."""
    model, graph = _compiled_step()
    assert all(is_region(layer) for layer in model.layers)
    calls = _calls(graph.dynamo)
    assert len(calls) == CFG.n_layers and len(set(calls)) == 1
    assert list(graph.bodies) == ["body0"]
    for forward, backward in graph.bodies.values():
        assert not any(is_all_gather(n) for gm in (forward, backward) for n in gm.graph.nodes)
    layer_buckets = [b for b in graph.plan.buckets if b.name.startswith("layers.")]
    assert count_collectives(graph.forward.graph)["all_gather"] == len(layer_buckets) + 1  # + the root
    assert graph.forward.meta["mfsdp_prefetch"] == {b.index: min(b.index, 1) for b in graph.plan.buckets}
    # Resharded: no gathered block parameter crosses from forward to backward (the body's own
    # saved inputs are rerouted to the gather, which backward repeats).
    kept = {p.param_id for p in graph.plan.params if not p.sharding.reshard_after_forward}
    assert set(saved_gathered_params(graph.forward)) <= kept
    assert count_collectives(graph.backward.graph)["all_gather"] == len(layer_buckets)


@pytest.mark.structure
def test_regional_and_whole_graph_compile_the_same_step():
    """options={"regional": False} inlines the bodies: one graph of every layer, the same
    collectives."""
    _, regional = _compiled_step()
    torch._dynamo.reset()
    _, whole = _compiled_step(regional=False)
    assert _calls(whole.dynamo) == [] and whole.bodies == {}
    for role in ("forward", "backward"):
        assert count_collectives(getattr(regional, role).graph) == count_collectives(getattr(whole, role).graph)


@pytest.mark.multirank
def test_regional_training_matches_whole_graph_and_the_reference():
    """Two gloo ranks, the eager runner: regional and whole-graph compiles train to the
    single-process reference."""
    for mode in ("regional", "whole"):
        results = spawn(parity_run, 2, cfg=CFG, modes=("eager",), backend_options={"regional": mode == "regional"})
        assert_parity(results)


class _DoubledNorm(RMSNorm):
    def forward(self, x):
        return 2 * super().forward(x)


def _perturb(model: nn.Module, how: str) -> None:
    layer = model.layers[2]
    if how == "int-attribute":  # read in forward: the head split
        layer.attn.n_heads = 6
        layer.attn.head_scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
    elif how == "float-attribute":
        layer.attn_norm.eps = 0.5
    elif how == "submodule-class":
        norm = _DoubledNorm(CFG.dim)
        norm.weight = layer.mlp_norm.weight
        layer.mlp_norm = norm
    elif how == "forward-hook":
        layer.attn.register_forward_hook(lambda module, args, out: out * 0.5)
    elif how == "missing-bias":
        layer.mlp.down = nn.Linear(CFG.hidden, CFG.dim, bias=False)
    elif how == "weight-shape":
        layer.mlp.gate = nn.Linear(CFG.dim, CFG.hidden + 6, bias=False)
        layer.mlp.up = nn.Parameter(torch.randn(CFG.hidden + 6, CFG.dim) / CFG.dim**0.5)
        layer.mlp.down = nn.Linear(CFG.hidden + 6, CFG.dim)
    else:
        assert how == "none"


def _one_step_against_reference(rank, world, *, how):
    """Loss and gradients of the compiled sharded step against the unsharded model, with
    layer 2 changed in one way; and how many calls each body got."""
    reference = build_model(CFG)
    _perturb(reference, how)
    tokens, targets = make_batch(CFG, 2, 8, 0)
    ref_loss = loss_fn(reference(tokens), targets)
    ref_loss.backward()
    model = build_model(CFG)
    _perturb(model, how)
    fully_shard(model)
    backend = MfsdpBackend(compiler="eager")
    loss = loss_fn(torch.compile(model, backend=backend)(tokens), targets)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    (graph,) = backend.graphs
    calls = _calls(graph.dynamo)
    return {
        "loss": relative_error(loss.detach(), ref_loss.detach()),
        "grads": max(relative_error(g, dict(reference.named_parameters())[n].grad) for n, g in grads.items()),
        "calls": {body: calls.count(body) for body in set(calls)},
        "params": set(full_parameters(model)) == {n for n, _ in reference.named_parameters()},
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    "how", ["none", "int-attribute", "float-attribute", "submodule-class", "forward-hook", "missing-bias", "weight-shape"]
)
def test_a_layer_that_differs_gets_its_own_body(how):
    """One world-1 gloo rank (real data), one step. Each change reaches the body's result, so
    reusing layer 0's body for layer 2 would show in the loss (checked to fail for the class
    and hook cases with torch's guard-free reuse, ``reuse_hash_fn``)."""
    (result,) = spawn(_one_step_against_reference, 1, how=how)
    assert result["loss"] < 1e-6 and result["grads"] < 1e-5, result
    assert result["params"]
    if how == "none":
        assert list(result["calls"].values()) == [CFG.n_layers], result
    else:  # layer 2 runs a body of its own (inlined where it is called once)
        assert sorted(result["calls"].values())[-1] == CFG.n_layers - 1, result
