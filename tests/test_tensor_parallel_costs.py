"""``explain`` and the simulator on a tensor-parallel step: the collectives DTensor traces
on "tp" are counted, and their time estimated, apart from the data-parallel ones."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compile
from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.patterns import collective_facts, is_collective
from fsdp_compile.cost_model import NVLINK_GPU, collective_schedule, collective_seconds, with_bodies
from fsdp_compile.simulate import SCHEDULES, simulate
from harness import fake_process_group
from test_tensor_parallel import DIM, DP, LAYERS, TP, _batch, _loss, _Model, _parallelized

pytestmark = pytest.mark.structure

# Collectives as slow as this tiny model's compute, so that time shows.
LINK = dataclasses.replace(NVLINK_GPU, name="fast link", link=1e12, latency=1e-7)
TP_LINK = dataclasses.replace(LINK, name="another fast link")
"""As fast, but another link: "tp" collectives on it do not wait for "dp" ones."""


def _compiled_step(model) -> MfsdpBackend:
    torch._dynamo.reset()
    backend = MfsdpBackend(compiler="eager")
    _loss(torch.compile(model, backend=backend), _batch(0, 0)).backward()
    return backend


def _on_group(backend: MfsdpBackend, group: str) -> Counter[str]:
    """The compiled graphs' collectives on ``group``, by graph and kind."""
    (graph,) = backend.graphs
    return Counter(
        f"{role} {c.kind}"
        for role, gm in (("forward", graph.forward), ("backward", graph.backward))
        for g in with_bodies(gm)  # the step's graph and each block call's body
        for c in collective_schedule(g, graph.plan, role)
        if c.group == group
    )


def test_explain_lists_the_tensor_parallel_collectives_apart_on_their_group():
    """dp 2 x tp 2: ``explain``'s tensor-parallel collectives are those the compiled graphs
    hold on "tp" (each block's row-parallel all-reduce in forward, its column-parallel
    input's gradient all-reduce in backward), with their bytes, and its other collectives,
    on "dp", count as those of the same model sharded over "dp" without tensor
    parallelism's split. Before, the "tp" all-reduces were listed with the data-parallel
    collectives, as if they were ours."""
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"].get_group().group_name, mesh["tp"].get_group().group_name
        summary = fsdp_compile.explain(_parallelized(mesh), _batch(0, 0))
        in_graphs = _on_group(_compiled_step(_parallelized(mesh)), tp)
        torch._dynamo.reset()
        plain = fsdp_compile.explain(fully_shard(_Model(), mesh=mesh["dp"]), _batch(0, 0))
    assert summary.tensor_parallel == in_graphs == {"forward all_reduce": LAYERS, "backward all_reduce": LAYERS}
    activation = _batch(0, 0).numel() * DIM * 4  # one block's fp32 output, or its gradient
    assert summary.tensor_parallel_bytes == {key: LAYERS * activation for key in in_graphs}
    assert summary.tensor_parallel_groups == {tp: TP} and summary.groups == plain.groups == {dp: DP}
    assert summary.collectives == plain.collectives and plain.tensor_parallel == {}
    assert 0 < summary.exposed_tensor_parallel_seconds < summary.exposed_comm_seconds
    text = str(summary)
    assert f"tensor-parallel collectives per step, on group {tp} ({TP} ranks):" in text, text
    assert f"collectives per step, on group {dp} ({DP} ranks):" in text, text


def test_the_simulated_step_waits_out_each_tensor_parallel_collective():
    """DTensor waits on each tensor-parallel collective right where it issues it, in the
    blocks' bodies, and our schedules leave them there: with "tp" on a link of its own, the step waits on them for
    the sum of their alpha-beta times, in every schedule, and ten times the link's latency
    adds ten times their latency terms. The simulator counted them before without telling
    them apart; now ``exposed_tensor_parallel_seconds`` is that time."""
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"].get_group().group_name
        backend = _compiled_step(_parallelized(mesh))
        (graph,) = backend.graphs
        facts = [
            collective_facts(n)
            for gm in (graph.forward, graph.backward)
            for n in (n for g in with_bodies(gm) for n in g.graph.nodes)
            if is_collective(n) and collective_facts(n).group_name == tp
        ]
        assert len(facts) == 2 * LAYERS
        slow = dataclasses.replace(TP_LINK, latency=10 * TP_LINK.latency)
        sims = {link: simulate(backend.graphs, LINK, links={tp: link}) for link in (TP_LINK, slow)}
        shared = simulate(backend.graphs, LINK)  # "tp" and "dp" take turns on one link
    for link, sim in sims.items():
        expected = sum(collective_seconds(f, link) for f in facts)
        for schedule in SCHEDULES:
            estimate = sim.schedules[schedule]
            assert estimate.exposed_tensor_parallel_seconds == pytest.approx(expected, rel=1e-9), schedule
            assert estimate.exposed_tensor_parallel_seconds < estimate.exposed_comm_seconds
    latency_terms = sum(2 * (f.world - 1) * 9 * TP_LINK.latency for f in facts)  # all-reduces: two passes
    fast, slower = sims[TP_LINK].schedules["ours"], sims[slow].schedules["ours"]
    assert slower.exposed_tensor_parallel_seconds - fast.exposed_tensor_parallel_seconds == pytest.approx(latency_terms)
    assert slower.step_seconds > fast.step_seconds
    assert shared.schedules["ours"].exposed_tensor_parallel_seconds >= fast.exposed_tensor_parallel_seconds * (1 - 1e-9)


def test_a_tensor_parallel_block_call_is_charged_this_rank_s_flops():
    """The cost model charges a block call the FLOPs its body runs on this rank: under tp 2,
    half those of the same block unsplit (both of its linears split), forward and backward.
    The counter saw each DTensor op at its global shape before, charging tp times the work."""
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        split = _compiled_step(_parallelized(mesh))
        plain = _compiled_step(fully_shard(_Model(), mesh=mesh["dp"]))
    costs = [{call.traced["cost"][role][0] for call in backend.calls} for backend in (split, plain) for role in ("forward", "backward")]
    (split_forward,), (split_backward,), (plain_forward,), (plain_backward,) = costs
    assert plain_forward > 0 and plain_backward > 0
    assert (split_forward * TP, split_backward * TP) == (plain_forward, plain_backward)


def test_async_tp_estimate_takes_the_sequence_parallel_gathers_and_scatters_beside_matmuls():
    """HF Llama under sequence parallelism, dp 2 x tp 2: async TP would cut, in forward,
    each layer's two gathers (before attention and the MLP) and two scatters (after them)
    and the head's gather; in backward each layer's two gathers of an output's gradient and
    the head's scatter (the layers' backward scatters follow a sum of matmuls, which
    Inductor's pattern does not take) -- 14 of the step's collectives, saving some of the
    time the step waits on them and no more. The same step is ``simulate``'s ``ours``. The
    residual stack without sequence parallelism has only all-reduces: nothing to cut."""
    pytest.importorskip("transformers")
    from fsdp_compile.async_tp_estimate import estimate_async_tp
    from fsdp_compile.testing.tensor_parallel import hf_llama_sequence_parallel
    from test_tensor_parallel import _hf_llama, _hf_loss

    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        links = {mesh["tp"].get_group().group_name: TP_LINK}
        model = _hf_llama()
        hf_llama_sequence_parallel(model, mesh["tp"])
        torch._dynamo.reset()
        backend = MfsdpBackend(compiler="eager")
        _hf_loss(torch.compile(fully_shard(model, mesh=mesh["dp"]), backend=backend), _batch(0, 0)).backward()
        sequence_parallel = estimate_async_tp(backend.graphs, LINK, links)
        ours = simulate(backend.graphs, LINK, links).schedules["ours"]
        all_reduces = estimate_async_tp(_compiled_step(_parallelized(mesh)).graphs, LINK, links)
    assert sequence_parallel.decomposable == 6 * LAYERS + 2, sequence_parallel
    assert 0 < sequence_parallel.saved_seconds <= sequence_parallel.exposed_tensor_parallel_seconds
    assert sequence_parallel.step_seconds == pytest.approx(ours.step_seconds)
    assert sequence_parallel.exposed_tensor_parallel_seconds == pytest.approx(ours.exposed_tensor_parallel_seconds)
    assert all_reduces.collectives == 2 * LAYERS and all_reduces.decomposable == 0 and all_reduces.saved_seconds == 0
