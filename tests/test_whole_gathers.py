"""``gather_whole_members``: a repeated block's flat gathered member by member, each whole, read
by the block's call as views, with no copy-out (NOTE: members gathered whole, in
fsdp_compile/whole_gathers.py)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

from fsdp_compile import MfsdpBackend, MixedPrecision, fully_shard
from fsdp_compile.bench.comms import graph_census, profiled_census
from fsdp_compile.patterns import collective_facts, is_all_gather, is_block_call, is_split_gathered
from fsdp_compile.testing.models import TransformerConfig, loss_fn, make_batch
from harness import build_model, fake_process_group, full_parameters, rank_batches, spawn, train

WHOLE = torch.ops.fsdp_compile.gather_whole_members.default


def _graphs(gather_whole_members: bool) -> list:
    """The step's forward and backward graphs of the 3-layer test transformer at fake world
    8 (bf16 gathers, the eager runner)."""
    cfg = TransformerConfig(n_layers=3)
    with fake_process_group(8):
        model = fully_shard(build_model(cfg), mp_policy=MixedPrecision(param_dtype=torch.bfloat16))
        backend = MfsdpBackend(compiler="eager", gather_whole_members=gather_whole_members)
        tokens, targets = make_batch(cfg, 2, 8, 0)
        loss_fn(torch.compile(model, backend=backend)(tokens), targets).backward()
    (graph,) = backend.graphs
    return [graph.compiled["forward"], graph.compiled["backward"]]


def _gathers(gm) -> list[tuple]:
    return [(n.target, collective_facts(n).nbytes) for n in gm.graph.nodes if is_all_gather(n)]


@pytest.mark.structure
def test_each_layer_is_gathered_whole_and_read_as_views_with_the_same_bytes():
    """Every layer's gather, forward and backward, is ``gather_whole_members``, and its call
    reads views of the result: no ``split_gathered`` copy-out is left in the step's graphs.
    The bytes gathered are the flats' as before, and off by default nothing changes."""
    whole, copied = _graphs(True), _graphs(False)
    for gm, before in zip(whole, copied):
        assert [b for _, b in _gathers(gm)] == [b for _, b in _gathers(before)]
        assert sum(t is WHOLE for t, _ in _gathers(gm)) == 3, gm.code
        assert not any(is_split_gathered(n) for n in gm.graph.nodes if any(is_block_call(u) for u in n.users))
        for call in (n for n in gm.graph.nodes if is_block_call(n)):
            weights = call.args[0 if "forward" in str(call.target) else 1]
            assert all(w.target is torch.ops.aten.view.default for w in weights[:9]), call.format_node()
    for gm in copied:
        assert not any(t is WHOLE for t, _ in _gathers(gm))


@pytest.mark.structure
def test_inductor_hands_the_views_to_the_block_calls_without_a_copy():
    """Inductor's code passes each member to the block call as a view of the gathered buffer
    (``reinterpret_tensor``): the copy-out is gone in the generated code, not only in the graph."""
    cfg = TransformerConfig(n_layers=2)
    with fake_process_group(8):
        model = fully_shard(build_model(cfg))
        step = torch.compile(model, backend=MfsdpBackend(compiler="inductor", gather_whole_members=True))
        tokens, targets = make_batch(cfg, 2, 8, 0)
        _, (forward, *_) = run_and_get_code(lambda: loss_fn(step(tokens), targets).backward())
    gathered = [line.split(" = ")[0].strip() for line in forward.splitlines() if "gather_whole_members.default(" in line]
    calls = [line for line in forward.splitlines() if "block_forward.default(" in line]
    assert len(gathered) == len(calls) == 2, forward
    assert forward.count("split_gathered.default(") == 1, forward  # the root's bucket, not a block's
    for call in calls:
        assert call.count("reinterpret_tensor(") >= 9, call


_CELLS = {
    "reshard-bf16-eager": (True, torch.bfloat16, "eager"),
    "reshard-bf16-inductor": (True, torch.bfloat16, "inductor"),
    "keep-fp32-eager": (False, None, "eager"),
}
"""(reshard_after_forward, param_dtype, compiler): gathered in bf16 or in the stored fp32, by
the eager runner and by Inductor's code (its views); kept after forward, one gathered flat
serves the forward's and the backward's call."""


def _trains(rank: int, world: int) -> dict:
    """Per cell and ``gather_whole_members``: the losses and full parameters after three
    steps; with Inductor and the whole gathers, one more step's collectives as its graphs count
    them and as gloo dispatched them."""
    cfg = TransformerConfig(n_layers=2)
    results = {}
    for cell, (reshard_after_forward, param_dtype, compiler) in _CELLS.items():
        for whole in (False, True):
            torch._dynamo.reset()
            policy = MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32)
            model = fully_shard(build_model(cfg), reshard_after_forward=reshard_after_forward, mp_policy=policy)
            # The census reads the compiled graphs, which a step from the compile cache lacks.
            backend = MfsdpBackend(compiler=compiler, gather_whole_members=whole, compile_cache=False)
            step = torch.compile(model, backend=backend)
            losses = train(model, step, rank_batches(cfg, rank), steps=3)
            results[cell, whole] = (losses, full_parameters(model))
            if whole and compiler == "inductor":
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    train(model, step, rank_batches(cfg, rank), steps=1)
                results["census"] = (graph_census(backend.graphs), profiled_census(prof))
    return results


@pytest.mark.multirank
def test_gathering_members_whole_trains_bit_for_bit_as_the_copy_out_and_counts_one_gather_each():
    """Two gloo ranks: with ``gather_whole_members`` the losses and every parameter after three
    AdamW steps equal the copy-out's bit for bit (the same bytes reach the same ops) in every
    cell of ``_CELLS``. The bench's profiled census counts each flat's member gathers (one
    gloo work per member) as the one gather its graph holds, with the same bytes."""
    for results in spawn(_trains, 2):
        for cell in _CELLS:
            (losses, params), (whole_losses, whole_params) = results[cell, False], results[cell, True]
            assert torch.equal(losses, whole_losses), (cell, losses, whole_losses)
            for name, value in params.items():
                assert torch.equal(value, whole_params[name]), (cell, name)
        graphs, profiled = results["census"]
        for kind in ("all_gather", "reduce_scatter", "all_gather_bytes"):  # gloo's reduce-scatter records no shapes
            assert graphs[kind] == profiled[kind] > 0, (kind, graphs, profiled)
