"""Expert parallelism: experts owned by EP ranks, out of data-parallel sharding, no hooks needed.

Parity runs 4 gloo ranks as EP 2 x edp 2 against the single-process reference of the same MoE
(every expert, global batch; capacity_factor 2 with top-2 of 4 experts drops no token, so
per-rank routing equals global routing). Plans, errors and bytes use the fake process group.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from fsdp_compile.node_meta import PARAM_ID
from fsdp_compile import MfsdpBackend, UsageError, expert_mesh, fully_shard, shard_info
from fsdp_compile.expert_parallel import RemoteExpert
from fsdp_compile.testing.models import GroupedExperts, TransformerConfig, loss_fn, make_batch
from fsdp_compile.patterns import bucket_index, is_all_gather, is_collective
from harness import (
    EP,
    EP_WORLD,
    assert_parity,
    build_model,
    compile_one_step,
    fake_process_group,
    moe_config,
    parity_run,
    persistent_bytes,
    relative_error,
    spawn,
)

WORLD = EP_WORLD


@pytest.mark.multirank
@pytest.mark.parametrize("shard_experts", [False, True], ids=["ep", "ep-efsdp"])
@pytest.mark.parametrize("fused", [False], ids=["modulelist-experts"])
def test_expert_parallel_trains_to_parity(fused, shard_experts):
    """EP 2 x edp 2, uncompiled and compiled: same losses and weights as one process holding
    every expert, and the ranks together hold every expert. A wrong expert-gradient divisor
    (edp instead of the whole world), a missed reduction or a misrouted all-to-all each break
    it. The fused experts' run is the matrix's ``ep`` and ``ep-efsdp`` layouts' ``train``
    (tests/test_matrix.py)."""
    results = spawn(
        parity_run, WORLD, cfg=moe_config(fused=fused), modes=("none", "eager"),
        ep_size=EP, shard_experts=shard_experts,
    )
    assert_parity(results)
    reference_names = {n for n, _ in build_model(moe_config(fused=fused)).named_parameters()}
    for mode in ("none", "eager"):
        assert set().union(*(r[mode]["held"] for r in results)) == reference_names



def _grad_errors(rank, world, *, modes):
    """One backward per (expert form, mode); each ``.grad`` (full tensor) against the
    reference gradient of the same name. Adam hides a constant gradient scale from the
    parity test almost entirely; this sees it whole."""
    from harness import global_batch, rank_batches

    errors = {}
    for fused in (True, False):
        cfg = moe_config(fused=fused)
        reference = build_model(cfg)
        loss_fn(reference(global_batch(cfg, 0, world)[0]), global_batch(cfg, 0, world)[1]).backward()
        expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
        for mode in modes:
            torch._dynamo.reset()
            model = fully_shard(build_model(cfg), expert_mesh=expert_mesh("cpu", EP))
            if not fused:  # this EP rank keeps 2 of the 4 experts; the others stand in
                remote = [isinstance(e, RemoteExpert) for e in model.layers[0].mlp.experts]
                assert sum(remote) == 4 - 4 // EP, remote
            forward = model if mode == "none" else torch.compile(model, backend=MfsdpBackend(compiler=mode))
            tokens, targets = rank_batches(cfg, rank)(0)
            loss_fn(forward(tokens), targets).backward()
            for name, param in model.named_parameters():
                if param.requires_grad:
                    grad = param.grad.full_tensor()
                    errors[fused, mode, name] = relative_error(grad, expected[name])
    return errors


@pytest.mark.multirank
def test_expert_gradients_are_averaged_over_the_whole_world():
    """``.grad`` of every parameter, experts included, equals the reference gradient: expert
    gradients summed over edp and divided by ep * edp (NOTE: expert gradient scale)."""
    for errors in spawn(_grad_errors, WORLD, modes=("none", "eager")):
        worst = max(errors.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst


# ---- ownership is explicit: the attribute decides, never the name ---------------------------


class Toy(nn.Module):
    """A dense layer beside a stack of fused experts registered under ``expert_name``."""

    def __init__(self, expert_name: str, marked: bool, n_experts: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        bank = GroupedExperts(TransformerConfig(dim=8, hidden=12, n_experts=n_experts))
        bank.expert_parallel_enabled = marked
        self.add_module(expert_name, bank)


def _sharding(module: nn.Module) -> list:
    """How each of ``module``'s own parameters was sharded (read without gathering)."""
    return [
        (p.placements, p.device_mesh.mesh_dim_names, shard_info(p).strategy,
         shard_info(p).group_name, shard_info(p).global_shape)
        for p in module._parameters.values()
    ]


@pytest.mark.structure
def test_renaming_modules_changes_nothing():
    """Expert ownership comes from ``expert_parallel_enabled``, so the experts' name (Megatron
    matched ``.experts.``) does not change how they are sharded."""
    with fake_process_group(WORLD):
        mesh = expert_mesh("cpu", EP)
        edp_group = mesh.get_group("edp").group_name
        records = []
        for name in ("experts", "bank", "moe_ffn"):
            model = fully_shard(Toy(name, marked=True), expert_mesh=mesh)
            records.append(_sharding(getattr(model, name)))
    assert records[0] == records[1] == records[2]
    placements, dims, strategy, group, shape = records[0][0]
    assert placements == (Shard(0), Replicate()) and dims == ("ep", "edp")
    assert strategy == "no_shard" and group == edp_group
    assert shape == (4 // EP, 12, 8)  # a read returns this EP rank's experts only


@pytest.mark.structure
def test_unmarked_module_called_experts_is_sharded_like_any_other():
    """A module named ``experts`` without the mark is data-parallel like ``proj``."""
    with fake_process_group(WORLD):
        model = fully_shard(Toy("experts", marked=False), expert_mesh=expert_mesh("cpu", EP))
    (_, _, strategy, dense_group, _), _ = _sharding(model.proj)
    for placements, _, expert_strategy, group, shape in _sharding(model.experts):
        assert placements == (Shard(0),) and group == dense_group and strategy == expert_strategy
        assert shape[0] == 4  # gathered whole over the data-parallel mesh


# ---- misuse: one ValueError naming the fix, before any collective --------------------------


@pytest.mark.structure
def test_marked_module_without_expert_mesh_is_rejected():
    with fake_process_group(WORLD):
        model = Toy("experts", marked=True)
        with pytest.raises(UsageError, match="expert_parallel_enabled = True but fully_shard got no expert_mesh"):
            fully_shard(model)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


@pytest.mark.structure
def test_ep_size_that_does_not_divide_the_world_is_rejected():
    with fake_process_group(WORLD):
        with pytest.raises(UsageError, match="expert parallel size 3 does not divide the world size 4"):
            expert_mesh("cpu", 3)


@pytest.mark.structure
def test_expert_mesh_not_spanning_the_world_is_rejected():
    with fake_process_group(WORLD):
        half = DeviceMesh("cpu", torch.arange(2).view(2, 1), mesh_dim_names=("ep", "edp"))
        with pytest.raises(UsageError, match=r"expert_mesh spans ranks \[0, 1\] but the data-parallel mesh \[0, 1, 2, 3\]"):
            fully_shard(Toy("experts", marked=True), expert_mesh=half)


@pytest.mark.structure
def test_experts_not_divisible_by_ep_size_are_rejected():
    with fake_process_group(WORLD):
        model = Toy("experts", marked=True, n_experts=3)
        with pytest.raises(UsageError, match="has 3 experts, not divisible by the expert parallel size 2"):
            fully_shard(model, expert_mesh=expert_mesh("cpu", EP))


@pytest.mark.structure
def test_shard_experts_without_a_sharded_strategy_is_rejected():
    with fake_process_group(WORLD):
        with pytest.raises(UsageError, match="shard_experts=True shards experts over edp"):
            fully_shard(
                Toy("experts", marked=True), strategy="no_shard",
                expert_mesh=expert_mesh("cpu", EP), shard_experts=True,
            )


# ---- plans and graphs: experts never share a group with data-parallel parameters -------------


def _compiled_step(cfg, *, cuda_graph=False, **shard_options):
    """One compiled forward/backward on rank 0 of the fake world-4 group: (model, graph)."""
    with fake_process_group(WORLD):
        model = fully_shard(build_model(cfg), expert_mesh=expert_mesh("cpu", EP), **shard_options)
        graph = compile_one_step(model, cfg, dynamic=False, cuda_graph=cuda_graph)
    return model, graph


def _expert_param_ids(model: nn.Module) -> set[int]:
    """By the mark, not by name."""
    return {
        shard_info(p).param_id
        for m in model.modules()
        if getattr(m, "expert_parallel_enabled", False)
        for p in m.parameters()
    }


@pytest.mark.structure
@pytest.mark.parametrize("shard_experts", [False, True], ids=["ep", "ep-efsdp"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-experts", "modulelist-experts"])
def test_no_expert_parameter_shares_a_group_with_a_dense_parameter(fused, shard_experts):
    """The plan puts every expert parameter on the edp group (world 2, gradient divided by the
    whole world 4) in a unit of its own, so no pass can bucket it with data-parallel
    parameters; the compiled graphs gather experts over edp only (not at all without
    shard_experts) and reduce their gradients there. The fused weights, read only inside
    GroupedExpertMLP, are in the plan: the marker saw them without any module hook."""
    model, graph = _compiled_step(moe_config(fused=fused), shard_experts=shard_experts)
    experts = _expert_param_ids(model)
    plan_experts = [p for p in graph.plan.params if p.param_id in experts]
    dense = [p for p in graph.plan.params if p.param_id not in experts]
    assert {p.param_id for p in plan_experts} == experts and dense
    assert not {p.sharding.group_name for p in plan_experts} & {p.sharding.group_name for p in dense}
    assert not {p.sharding.unit for p in plan_experts} & {p.sharding.unit for p in dense}
    assert {(p.sharding.world, p.sharding.grad_divisor) for p in plan_experts} == {(WORLD // EP, WORLD)}
    # Averaged over more ranks than their group holds: summed, then divided by the world
    # (NOTE: averaging in the collective); the dense ones average on this group.
    assert {p.reduce_op for p in plan_experts} == {"sum"} and {p.reduce_op for p in dense} == {"avg"}
    (edp_group,) = {p.sharding.group_name for p in plan_experts}
    # No DP bucket holds an expert parameter: a bucket is all experts or none.
    for bucket in graph.plan.buckets:
        members = set(bucket.param_ids)
        assert members <= experts or not members & experts, bucket
    gathered, reduced = set(), set()
    for gm in (graph.forward, graph.backward):
        for node in gm.graph.nodes:
            if not is_collective(node):
                continue
            index = bucket_index(node)
            members = (
                set(graph.plan.buckets[index].param_ids)
                if index is not None
                else {node.meta.get(PARAM_ID)}
            )
            if members & experts:
                assert node.args[-1] == edp_group, node.format_node()
                (gathered if is_all_gather(node) else reduced).update(members)
    assert gathered == (experts if shard_experts else set())
    assert reduced == experts


@pytest.mark.structure
@pytest.mark.parametrize("fused", [True, False], ids=["fused-experts", "modulelist-experts"])
def test_expert_parallel_step_passes_the_cuda_graph_check(fused):
    """The dispatch is an all-to-all of equal splits: static shapes, no host sync, capturable."""
    _, graph = _compiled_step(moe_config(fused=fused), cuda_graph=True)
    targets = {str(n.target) for n in graph.forward.graph.nodes}
    assert any("all_to_all_single" in t for t in targets), sorted(targets)


# ---- bytes per rank: the seed's bar ------------------------------------------------------------


def _bytes_per_rank(*, strategy, ep_size=None, shard_experts=False) -> dict[str, int]:
    """Parameters + gradients + AdamW state per rank after one compiled step, at world 4;
    experts are expert-parallel when ``ep_size`` is given, else data-parallel like the rest."""
    cfg = TransformerConfig(
        n_layers=2, n_experts=8, top_k=2, capacity_factor=2.0, expert_parallel=ep_size is not None
    )
    with fake_process_group(WORLD):
        mesh = {"expert_mesh": expert_mesh("cpu", ep_size)} if ep_size else {}
        model = fully_shard(build_model(cfg), strategy=strategy, shard_experts=shard_experts, **mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens, targets = make_batch(cfg, 2, 8, 0)
        compiled = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
        loss_fn(compiled(tokens), targets).backward()
        opt.step()
        return persistent_bytes(model, opt)


@pytest.mark.structure
def test_expert_parallel_with_mfsdp_holds_no_more_than_expert_parallel_alone():
    """Megatron-FSDP #2772: wrapping EP-owned experts in FSDP cost more memory than EP alone.
    Here EP + ZeRO-3 holds no more, per category, than EP with replicated dense parameters,
    and well under half of fully replicated; efsdp (shard_experts) holds less still."""
    replicated = _bytes_per_rank(strategy="no_shard")
    ep_alone = _bytes_per_rank(strategy="no_shard", ep_size=EP)
    ep_mfsdp = _bytes_per_rank(strategy="optim_grads_params", ep_size=EP)
    ep_efsdp = _bytes_per_rank(strategy="optim_grads_params", ep_size=EP, shard_experts=True)
    for kind in ("param", "grad", "opt"):
        assert ep_efsdp[kind] < ep_mfsdp[kind] <= ep_alone[kind] < replicated[kind], kind
    assert sum(ep_mfsdp.values()) < 0.5 * sum(replicated.values())


@pytest.mark.structure
def test_marked_module_that_holds_no_experts_is_rejected():
    """Marked, but neither a ModuleList nor parameters stacked on one expert dim."""
    with fake_process_group(WORLD):
        model = nn.Sequential(nn.Linear(8, 3), nn.Linear(3, 4))
        model.expert_parallel_enabled = True
        with pytest.raises(UsageError, match="mark the module that holds only the experts"):
            fully_shard(model, expert_mesh=expert_mesh("cpu", EP))


# ---- the grouped-GEMM path: torch._grouped_mm in bf16 (it runs on CPU in torch 2.13) ----------


@pytest.mark.structure
def test_grouped_expert_mlp_uses_grouped_mm_in_bf16_and_matches_fp32():
    """Aligned bf16 operands take ``torch._grouped_mm`` (2 calls forward, 4 backward); the
    results stay within bf16 rounding of the fp32 batched-matmul path."""
    from unittest import mock

    from fsdp_compile.testing.models import GroupedExpertMLP

    torch.manual_seed(0)
    x, w_in, w_out = torch.randn(4, 16, 48), torch.randn(4, 96, 48) / 7, torch.randn(4, 48, 96) / 10
    grad = torch.randn(4, 16, 48)
    expected_inputs = [t.clone().requires_grad_() for t in (x, w_in, w_out)]
    expected = GroupedExpertMLP.apply(*expected_inputs)
    expected.backward(grad)
    inputs = [t.to(torch.bfloat16).requires_grad_() for t in (x, w_in, w_out)]
    with mock.patch.object(torch, "_grouped_mm", wraps=torch._grouped_mm) as grouped_mm:
        out = GroupedExpertMLP.apply(*inputs)
        assert grouped_mm.call_count == 2
        out.backward(grad.to(torch.bfloat16))
        assert grouped_mm.call_count == 6
    assert relative_error(out.float(), expected) < 1e-2
    for actual, reference in zip(inputs, expected_inputs):
        assert relative_error(actual.grad.float(), reference.grad) < 2e-2


def _bf16_grouped_run(rank, world, *, cfg, steps):
    from fsdp_compile import MixedPrecision
    from harness import mean_over_ranks, rank_batches, reference, train

    ref_losses, _ = reference(cfg, world, steps=steps)
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fully_shard(build_model(cfg), mp_policy=bf16, expert_mesh=expert_mesh("cpu", EP))
    backend = MfsdpBackend(compiler="eager")
    losses = mean_over_ranks(train(model, torch.compile(model, backend=backend), rank_batches(cfg, rank), steps=steps))
    (graph,) = backend.graphs
    grouped = [
        sum(n.target is torch.ops.aten._grouped_mm.default for n in gm.graph.nodes)
        for gm in (graph.forward, graph.backward)
    ]
    return relative_error(losses.float(), ref_losses), grouped


@pytest.mark.multirank
def test_expert_parallel_bf16_runs_grouped_mm_and_tracks_the_fp32_reference():
    """EP 2 x edp 2, bf16 compute, fused experts with 16-byte rows: the compiled graphs run
    ``aten._grouped_mm`` (forward and backward) and 10 steps stay within bf16 tolerance of the
    fp32 reference (the bound test_mixed_precision uses)."""
    cfg = moe_config(fused=True, hidden=96)
    for loss_error, (forward_mms, backward_mms) in spawn(_bf16_grouped_run, WORLD, cfg=cfg, steps=10):
        assert forward_mms == 2 and backward_mms == 4, (forward_mms, backward_mms)
        assert loss_error < 2e-2, loss_error
