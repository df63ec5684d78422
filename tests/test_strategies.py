"""Every sharding strategy trains like one process on 4 ranks; its collectives, HSDP's groups
and the memory per rank are those the user guide states.

Parity runs real gloo ranks against the unsharded single-process reference (harness); the
collective structure and the memory per rank are checked on the fake process group. Parity
at 2 ranks, on HSDP and with gradient accumulation, is the matrix's (tests/test_matrix.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdp_compile.node_meta import PARAM_ID
from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.testing.models import TransformerConfig, loss_fn, make_batch
from fsdp_compile.markers import STRATEGIES
from fsdp_compile.passes import saved_gathered_params
from fsdp_compile.patterns import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, count_collectives
from harness import (
    flat_padding_bytes,
    assert_parity,
    build_model,
    compile_one_step,
    fake_process_group,
    parity_run,
    persistent_bytes,
    spawn,
)

USER_GUIDE = Path(__file__).parents[1] / "docs" / "user_guide.md"


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_trains_to_parity_on_4_ranks(strategy):
    """On 4 ranks of one mesh dimension, uncompiled and compiled: uneven shards (the
    vocabulary's 67 rows over 4). 2 ranks and HSDP 2 x 2 are the matrix's ``train``
    (tests/test_matrix.py)."""
    results = spawn(
        parity_run, 4, cfg=TransformerConfig(), modes=("none", "eager"), strategy=strategy
    )
    assert_parity(results)


def _compiled_step(world, rank=0, mesh_shape=None, **shard_options):
    cfg = TransformerConfig(n_layers=2)
    with fake_process_group(world, rank=rank):
        mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape else None
        model = fully_shard(build_model(cfg), mesh=mesh, **shard_options)
        # Per-parameter collectives: the counts below are per parameter; bucketing has its
        # own tests (test_bucketing.py), and parity here runs with it on.
        graph = compile_one_step(model, cfg, bucketing=False)
    return model, graph


# Collectives per step, per parameter, as docs/user_guide.md's table states them.
EXPECTED_COLLECTIVES = {
    "no_shard": ({}, {"all_reduce": "trainable"}),
    "optim": ({"all_gather": "all"}, {"all_reduce": "trainable"}),
    "optim_grads": ({"all_gather": "all"}, {"reduce_scatter": "trainable"}),
    "optim_grads_params": ({"all_gather": "all"}, {"all_gather": "regathered", "reduce_scatter": "trainable"}),
}


@pytest.mark.structure
@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collectives_per_step_follow_the_strategy(strategy, world):
    model, graph = _compiled_step(world, strategy=strategy)
    counts = {"all": len(graph.plan.params), "trainable": len(graph.plan.trainable)}
    if strategy == "optim_grads_params":
        # ZeRO-3 gathers again in backward, once each, what backward reads of the resharded
        # parameters; the root's own stay gathered from forward (NOTE: the reshard default).
        # Together: at least what ZeRO-2 keeps from forward for backward (not, e.g., a bias
        # whose gradient needs no value).
        regathered = [
            graph.plan.param(n.meta[PARAM_ID]).fqn
            for n in graph.backward.graph.nodes
            if n.target == ALL_GATHER
        ]
        saved = {graph.plan.param(i).fqn for i in saved_gathered_params(graph.forward)}
        root = {p.fqn for p in graph.plan.params if not p.sharding.reshard_after_forward}
        assert root == {"embed.weight", "pos", "norm.weight"} and saved <= root
        assert not saved & set(regathered)
        _, kept = _compiled_step(world, strategy="optim_grads")
        assert {kept.plan.param(i).fqn for i in saved_gathered_params(kept.forward)} <= set(regathered) | saved
        counts["regathered"] = len(set(regathered))
    forward, backward = EXPECTED_COLLECTIVES[strategy]
    assert count_collectives(graph.forward.graph) == {k: counts[v] for k, v in forward.items()}
    assert count_collectives(graph.backward.graph) == {k: counts[v] for k, v in backward.items()}
    placement = Replicate() if strategy == "no_shard" else Shard(0)
    for param in model.parameters():
        assert param.placements == (placement,)
        if param.requires_grad:
            assert param.grad.placements == (placement,)


@pytest.mark.structure
def test_hsdp_collectives_stay_in_their_groups():
    """Mesh (replicate 4, shard 2) at world 8: every all-gather and reduce-scatter runs on the
    shard group (2 ranks), every gradient is then all-reduced on the replicate group; the plan
    names both groups."""
    model, graph = _compiled_step(8, rank=5, mesh_shape=(4, 2))
    plan = graph.plan
    (shard_group,) = {p.sharding.group_name for p in plan.params}
    (replicate_group,) = {p.sharding.replicate_group_name for p in plan.params}
    assert {(p.sharding.world, p.sharding.replicate_world) for p in plan.params} == {(2, 4)}
    assert shard_group != replicate_group and '"replicate_group_name"' in plan.to_json()
    for gm in (graph.forward, graph.backward):
        for node in gm.graph.nodes:
            if node.target in (ALL_GATHER, REDUCE_SCATTER):
                assert node.args[-1] == shard_group, node.format_node()
            elif node.target == ALL_REDUCE:
                assert node.args[-1] == replicate_group, node.format_node()
    backward = count_collectives(graph.backward.graph)
    assert backward["all_reduce"] == backward["reduce_scatter"] == len(plan.trainable)
    for param in model.parameters():
        assert param.placements == (Replicate(), Shard(0))


# ---- bytes per rank, against the docs table -----------------------------------------------


def _documented_bytes() -> dict[str, dict[str, str]]:
    """The strategy table of docs/user_guide.md: {strategy: {column: formula}}."""
    rows = {}
    for line in USER_GUIDE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0].strip("`") in STRATEGIES:
            rows[cells[0].strip("`")] = {"param": cells[3], "grad": cells[4], "opt": cells[5]}
    assert rows.keys() == set(STRATEGIES), "the strategy table in docs/user_guide.md changed shape"
    return rows


def _evaluate(formula: str, total: int, world: int) -> float:
    assert re.fullmatch(r"\d*P(/N)?", formula), formula
    factor = int(formula.split("P")[0] or 1)
    return factor * total / (world if "/N" in formula else 1)


@pytest.mark.structure
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bytes_per_rank_match_the_docs_table(strategy):
    """MemTracker at world size 4, after one compiled AdamW step: parameter, gradient and optimizer
    bytes per rank are the table's formulas (P = unsharded parameter bytes, N = 4), give or
    take the padding of uneven shards (at most one row per parameter and state)."""
    cfg = TransformerConfig()
    world = 4
    with fake_process_group(world, rank=0):
        model = fully_shard(build_model(cfg), strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens, targets = make_batch(cfg, 2, 8, 0, 0)
        compiled = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
        loss_fn(compiled(tokens), targets).backward()
        opt.step()
        measured = persistent_bytes(model, opt)
    unsharded = build_model(cfg)
    total = sum(p.numel() * p.element_size() for p in unsharded.parameters())
    trainable = sum(p.numel() * p.element_size() for p in unsharded.parameters() if p.requires_grad)
    row_bytes = sum(4 * math.prod(p.shape[1:]) for p in unsharded.parameters())
    # AdamW also keeps a scalar ``step`` per parameter (4 bytes each), in every strategy.
    step_bytes = 4 * sum(p.requires_grad for p in unsharded.parameters())
    formulas = _documented_bytes()[strategy]
    for name, formula in formulas.items():
        size = total if name == "param" else trainable
        expected = _evaluate(formula, size, world) + (step_bytes if name == "opt" else 0)
        padding = 0 if "/N" not in formula else row_bytes * (2 if name == "opt" else 1)
        if name == "grad" and strategy == "optim":
            # The whole averaged gradient every rank keeps is the blocks' flat ones, whose
            # slots are padded to a multiple of the world (NOTE: flat parameters).
            padding = flat_padding_bytes(model)
        assert expected - padding <= measured[name] <= expected + padding, (name, formula, measured)
