"""Bucketing and scheduling as invariants: counts per bucket, wait placement, prefetch distance,
the in-flight byte bound, and bucketed training equal to unbucketed (real gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from fsdp_compile.node_meta import PARAM_ID, PREFETCH
from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.testing.models import TransformerConfig
from fsdp_compile.passes import (
    check_schedule_collectives,
    gather_lifetimes,
    peak_inflight_bytes,
    saved_gathered_params,
)
from fsdp_compile.patterns import bucket_index, count_collectives, is_collective, is_reduce_scatter
from fsdp_compile.records import ShardInfo
from fsdp_compile.plan import BackendOptions, ParamPlan
from fsdp_compile.planner import plan_buckets
from harness import (
    build_model,
    compile_one_step,
    fake_process_group,
    full_parameters,
    max_param_error,
    mean_over_ranks,
    rank_batches,
    reference,
    relative_error,
    spawn,
    train,
    with_meshes,
)

TOLERANCE = 1e-5
CFG = TransformerConfig()
BLOCKS = ["<root>", "layers.0", "layers.1", "layers.2", "norm"]


def _compile_step(cfg=CFG, *, per_block_units=False, reshard_after_forward=True, **options):
    """Trace one training step on the current process group; return the compiled graph."""
    model = build_model(cfg)
    if per_block_units:
        for block in model.layers:
            fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return compile_one_step(model, cfg, **options)


@pytest.mark.structure
@pytest.mark.parametrize("per_block_units", [False, True], ids=["root-only", "per-block"])
@pytest.mark.parametrize("world", [8, 64])
def test_two_all_gathers_and_one_reduce_scatter_per_bucket(world, per_block_units):
    """With resharding a step runs one all-gather per bucket in forward, one in backward and
    one reduce-scatter per bucket, not one per parameter; buckets are the repeated blocks
    (found from fqns when only the root is wrapped, or the fully_shard units)."""
    with fake_process_group(world):
        graph = _compile_step(per_block_units=per_block_units)
    plan = graph.plan
    assert [b.name for b in plan.buckets] == BLOCKS
    assert sorted(i for b in plan.buckets for i in b.param_ids) == sorted(p.param_id for p in plan.params)
    n = len(plan.buckets)
    assert count_collectives(graph.forward.graph) == {"all_gather": n}
    assert count_collectives(graph.backward.graph) == {"all_gather": n, "reduce_scatter": n}
    for gm in (graph.forward, graph.backward):
        tags = [(is_reduce_scatter(c), bucket_index(c)) for c in gm.graph.nodes if is_collective(c)]
        assert len(tags) == len(set(tags)), "a bucket has two collectives of one kind"
    assert saved_gathered_params(graph.forward) == []


@pytest.mark.structure
def test_keep_gathered_buckets_save_their_members_and_never_regather():
    """reshard_after_forward=False: the bucketed forward saves each member's copy-out (not the
    bucket buffer) and the backward has no all-gather at all."""
    with fake_process_group(8):
        graph = _compile_step(reshard_after_forward=False)
    saved = saved_gathered_params(graph.forward)
    assert len(saved) > len(graph.plan.buckets)
    assert count_collectives(graph.backward.graph)["all_gather"] == 0


def _param(
    param_id, fqn, *, rows=8, dtype=torch.float32, group="0", unit="root",
    strategy="optim_grads_params", replicas="",
):
    sharding = ShardInfo(
        param_id=param_id, fqn=fqn, block=fqn.rpartition(".")[0], unit=unit, global_shape=(rows, 4), dtensor_shape=(rows, 4),
        strategy=strategy, group_name=group, world=2, replicate_group_name=replicas,
        replicate_world=2 if replicas else 1, grad_divisor=4 if replicas else 2,
        reshard_after_forward=True, param_dtype=dtype, reduce_dtype=dtype,
    )
    return ParamPlan(sharding=sharding, fqn=fqn, shard_rows=rows // 2, dtype=dtype, rank=0, requires_grad=True)


@pytest.mark.structure
def test_buckets_never_mix_groups_dtypes_or_strategies_and_respect_the_byte_cap():
    """Within one block a dtype or group change starts a new bucket; a cap splits a block
    greedily, and a parameter above the cap sits alone."""
    params = [
        _param(0, "layers.0.a"),
        _param(1, "layers.0.b", dtype=torch.bfloat16),
        _param(2, "layers.0.c", group="1"),
        _param(3, "layers.1.a"),
        _param(4, "layers.1.b"),
        _param(5, "layers.1.c", rows=64),
        _param(6, "layers.1.d"),
    ]
    buckets = plan_buckets(params, range(7), enabled=True, cap_bytes=None)
    assert [b.param_ids for b in buckets] == [(0,), (1,), (2,), (3, 4, 5, 6)]
    assert {(b.group_name, b.param_dtype) for b in buckets[:3]} == {("0", torch.float32), ("0", torch.bfloat16), ("1", torch.float32)}
    cap = 2 * params[3].gathered_bytes
    capped = plan_buckets(params, range(7), enabled=True, cap_bytes=cap)
    assert [b.param_ids for b in capped][3:] == [(3, 4), (5,), (6,)]
    assert all(b.gathered_bytes <= cap for b in capped if len(b.param_ids) > 1)
    assert [b.param_ids for b in plan_buckets(params, range(7), enabled=False, cap_bytes=None)] == [
        (i,) for i in range(7)
    ]
    # Nor strategies (their collectives differ) or HSDP replicate groups.
    mixed = [
        _param(0, "layers.0.a"),
        _param(1, "layers.0.b", strategy="optim"),
        _param(2, "layers.0.c", replicas="2"),
        _param(3, "layers.0.d", replicas="2"),
    ]
    assert [b.param_ids for b in plan_buckets(mixed, range(4), enabled=True, cap_bytes=None)] == [
        (0,), (1,), (2, 3)
    ]


@pytest.mark.structure
@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("world", [8, 64])
def test_waits_sit_at_first_use_and_prefetch_distance_holds(world, prefetch):
    """Each all-gather wait is followed by nothing but copy-out and other collectives before
    its bucket's first use; the gather ranked j is issued before the first use of bucket
    j - prefetch (all earlier ones when j < prefetch), forward and backward; each
    reduce-scatter is waited right before the next one's copy-in: after the compute that
    makes the next bucket's gradients (which it overlaps, where there is any), and before
    the next bucket is packed, so one packed bucket is alive at a time."""
    with fake_process_group(world):
        graph = _compile_step(prefetch=prefetch)
    for gm in (graph.forward, graph.backward):
        nodes = list(gm.graph.nodes)
        lifetimes = gather_lifetimes(gm, graph.plan)
        for t in lifetimes:
            assert t.issue < t.wait < t.first_use
            between = nodes[t.wait + 1 : t.first_use]
            compute = [n.name for n in between if _costs_flops(n)]
            assert not compute, (t, compute)
            ahead = sum(1 for other in lifetimes[: t.rank] if other.first_use > t.issue)
            assert ahead == min(prefetch, t.rank), (t, ahead)
        scatters = [n for n in nodes if is_reduce_scatter(n)]
        for rs, next_rs in zip(scatters, scatters[1:]):
            (wait,) = rs.users
            assert nodes.index(rs) < nodes.index(wait) < nodes.index(next_rs)
            compute = [n.name for n in nodes[nodes.index(wait) + 1 : nodes.index(next_rs)] if _costs_flops(n)]
            assert not compute, (wait.name, next_rs.name, compute)


def _costs_flops(node) -> bool:
    from fsdp_compile.cost_model import _node_flops

    return _node_flops(node) > 0


@pytest.mark.structure
def test_max_inflight_bytes_shortens_prefetch_and_is_never_exceeded():
    """A bound between the unprefetched and the prefetched peak: the pass shortens prefetch
    where needed and the gathered bytes alive at any node stay under the bound; a bound below
    what the step needs without prefetch is refused at compile time, naming the option."""
    with fake_process_group(8):
        free = _compile_step(prefetch=2)
        torch._dynamo.reset()
        none = _compile_step(prefetch=0)
        peaks = {
            name: max(peak_inflight_bytes(gather_lifetimes(gm, g.plan)) for gm in (g.forward, g.backward))
            for name, g in (("free", free), ("none", none))
        }
        assert peaks["none"] < peaks["free"]
        bound = (peaks["none"] + peaks["free"]) // 2
        torch._dynamo.reset()
        bounded = _compile_step(prefetch=2, max_inflight_bytes=bound)
        torch._dynamo.reset()
        with pytest.raises(CompileUsageError, match="max_inflight_bytes"):
            _compile_step(prefetch=2, max_inflight_bytes=peaks["none"] // 4)
    for gm in (bounded.forward, bounded.backward):
        assert peak_inflight_bytes(gather_lifetimes(gm, bounded.plan)) <= bound
    distances = [d for gm in (bounded.forward, bounded.backward) for d in gm.meta[PREFETCH].values()]
    assert 2 in distances and any(d < 2 for d in distances[1:])


@pytest.mark.structure
def test_check_rejects_a_missing_prefetch_and_an_early_wait():
    """The postcondition is not vacuous: a gather moved down to its bucket's first use, or a
    wait moved up to its collective (compute then runs between wait and use), fails
    check_schedule_collectives."""
    with fake_process_group(8):
        graph = _compile_step()
    gm, plan = graph.forward, graph.plan
    check_schedule_collectives(gm, plan)
    t = gather_lifetimes(gm, plan)[2]
    nodes = list(gm.graph.nodes)
    collective, wait = nodes[t.issue], nodes[t.wait]
    anchor = collective.prev
    wait.prepend(collective)  # issued only at its own wait: no prefetch left
    with pytest.raises(AssertionError, match="issued 0 bucket"):
        check_schedule_collectives(gm, plan)
    anchor.append(collective)
    check_schedule_collectives(gm, plan)
    collective.append(wait)  # waited at once, before the previous bucket's compute
    with pytest.raises(AssertionError, match="between its wait and its first use"):
        check_schedule_collectives(gm, plan)


@pytest.mark.structure
@pytest.mark.parametrize(
    "options, fix",
    [
        ({"bucket_mb": 0}, "bucket_mb"),
        ({"bucket_mb": "25"}, "bucket_mb"),
        ({"prefetch": -1}, "prefetch"),
        ({"prefetch": True}, "prefetch"),
        ({"max_inflight_bytes": 1.5}, "max_inflight_bytes"),
        ({"bucketing": "yes"}, "bucketing"),
    ],
)
def test_bad_schedule_options_name_the_option(options, fix):
    with pytest.raises(CompileUsageError, match=fix):
        BackendOptions.parse(options)


def _bucketed_vs_unbucketed(rank, world, *, cfg, variants, steps=3):
    ref_losses, ref_params = reference(cfg, world, steps=steps)
    results = {}
    for name, options in variants.items():
        torch._dynamo.reset()
        model = fully_shard(build_model(cfg))
        backend = MfsdpBackend(compiler="eager", **options)
        compiled = torch.compile(model, backend=backend)
        losses = mean_over_ranks(train(model, compiled, rank_batches(cfg, rank), steps=steps))
        params = full_parameters(model)
        (graph,) = backend.graphs
        results[name] = {
            "losses": losses,
            "params": params,
            "loss_error": relative_error(losses, ref_losses),
            "param_error": max_param_error(params, ref_params)[0],
            "counts": [dict(count_collectives(g.graph)) for g in (graph.forward, graph.backward)],
            "buckets": len(graph.plan.buckets),
            "kept_buckets": sum(not b.reshard_after_forward for b in graph.plan.buckets),
            "peak": max(peak_inflight_bytes(gather_lifetimes(g, graph.plan)) for g in (graph.forward, graph.backward)),
        }
    return results


@pytest.mark.multirank
def test_bucketed_training_equals_unbucketed_on_two_gloo_ranks():
    """World 2, real gloo: per-parameter and bucketed with prefetch 2 under a byte bound both
    train to the reference within 1e-5, the bucketed run gives exactly the per-parameter
    numbers (bucketing moves bytes, not arithmetic), and its compiled graphs run one collective
    per bucket under the bound. (tests/test_parity.py covers the default, prefetch 1.)"""
    bound = 400_000
    variants = {"per_param": {"bucketing": False}, "bucketed": {"prefetch": 2, "max_inflight_bytes": bound}}
    for rank_result in spawn(_bucketed_vs_unbucketed, 2, cfg=CFG, variants=variants):
        base, bucketed = rank_result["per_param"], rank_result["bucketed"]
        for name, r in rank_result.items():
            assert r["loss_error"] < TOLERANCE and r["param_error"] < TOLERANCE, (name, r["loss_error"], r["param_error"])
        assert torch.equal(bucketed["losses"], base["losses"])
        assert all(torch.equal(bucketed["params"][k], v) for k, v in base["params"].items())
        n = bucketed["buckets"]
        kept = bucketed["kept_buckets"]  # the root's, gathered once (NOTE: the reshard default)
        assert kept == 1
        assert bucketed["counts"] == [{"all_gather": n}, {"all_gather": n - kept, "reduce_scatter": n}]
        assert base["counts"][0]["all_gather"] > n
        assert bucketed["peak"] <= bound


def _collective_sequence(graph) -> list[tuple]:
    """(graph, kind, bucket, shape) of every collective in execution order: what ranks of one
    group must agree on (group names left out: each EP rank has its own ep and edp groups)."""
    sequence = []
    for role in ("forward", "backward"):
        for node in getattr(graph, role).graph.nodes:
            if is_collective(node):
                bucket, member = bucket_index(node), node.meta.get(PARAM_ID)
                # By name, never by param_id: ids count parameters sharded earlier in the
                # process (a real rank is a fresh process; here four ranks share one), and
                # `member and ...` once read param_id 0 as "no parameter".
                what = bucket if bucket is not None else member is not None and graph.plan.param(member).fqn
                sequence.append((role, str(node.target), what, node.meta["val"].shape))
    return sequence


def _sequences_per_rank(cfg, world, **shard_options) -> list[list[tuple]]:
    from fsdp_compile import MixedPrecision

    sequences = []
    for rank in range(world):
        torch._dynamo.reset()
        with fake_process_group(world, rank):
            bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            model = fully_shard(build_model(cfg), mp_policy=bf16, **with_meshes(shard_options))
            graph = compile_one_step(model, cfg, rank=rank)
        sequences.append(_collective_sequence(graph))
    return sequences


@pytest.mark.structure
@pytest.mark.parametrize(
    "cfg,shard_options",
    [
        (TransformerConfig(), {}),
        (TransformerConfig(n_layers=1, n_experts=4, capacity_factor=2.0, hidden=96, expert_parallel=True), {"ep_size": 2}),
    ],
    ids=["dense", "expert-parallel"],
)
def test_every_rank_issues_the_collectives_in_one_order(cfg, shard_options):
    """At world 4 rank 3 holds no row of the 3-element head_scale, so its graphs copy shards in
    differently and its inputs sit elsewhere; the schedule must still issue every collective in
    the same order on every rank (a bf16 EP run crashed in gloo before gathers were issued in
    rank order with ties broken by bucket)."""
    sequences = _sequences_per_rank(cfg, 4, **shard_options)
    assert all(s == sequences[0] for s in sequences[1:]), [
        [i for i, (a, b) in enumerate(zip(sequences[0], s)) if a != b] for s in sequences
    ]
