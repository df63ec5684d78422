"""Mixed precision: bf16 on the wire and in the compute, fp32 main weights and fp32 grads."""

from __future__ import annotations


import copy

import pytest
import torch
from torch import nn

import fsdp_compile.markers
from fsdp_compile import MfsdpBackend, MixedPrecision, UsageError, fully_shard
from fsdp_compile.testing.models import TransformerConfig, loss_fn, make_batch
from fsdp_compile.patterns import (
    cast_dtype,
    is_all_gather,
    is_all_reduce,
    is_ours,
    is_pack_for_reduce_scatter,
    is_reduce_scatter,
    is_view,
)
from harness import (
    build_model,
    fake_process_group,
    full_parameters,
    max_param_error,
    mean_over_ranks,
    one_rank_group,
    rank_batches,
    reference,
    relative_error,
    spawn,
    train,
)

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.structure
def test_bf16_on_the_wire_fp32_reduction_fp32_grads():
    """Casts happen before the all-gather (bf16 collectives, forward and backward), gradients
    are reduce-scattered in fp32 and land as fp32 .grad next to the fp32 parameters."""
    cfg = TransformerConfig()
    with fake_process_group(8):
        model = fully_shard(build_model(cfg), mp_policy=BF16)
        backend = MfsdpBackend(compiler="eager")
        tokens, targets = make_batch(cfg, 2, 8, 0)
        loss = loss_fn(torch.compile(model, backend=backend)(tokens), targets)
        loss.backward()
    (graph,) = backend.graphs
    assert loss.dtype == torch.bfloat16
    for gm in (graph.forward, graph.backward):
        gathers = [n for n in gm.graph.nodes if is_all_gather(n)]
        assert gathers and all(n.args[0].meta["val"].dtype == torch.bfloat16 for n in gathers)
    scatters = [n for n in graph.backward.graph.nodes if is_reduce_scatter(n)]
    assert len(scatters) == len(graph.plan.buckets)  # every bucket of this model trains
    assert all(n.args[0].meta["val"].dtype == torch.float32 for n in scatters)
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, name
        if param.requires_grad:
            assert param.grad.dtype == torch.float32, name


def _bf16_step(**options):
    """The compiled graph of one bf16 step on rank 0 of the fake world-8 group."""
    cfg = TransformerConfig()
    with fake_process_group(8):
        model = fully_shard(build_model(cfg), mp_policy=BF16)
        backend = MfsdpBackend(compiler="eager", **options)
        tokens, targets = make_batch(cfg, 2, 8, 0)
        loss_fn(torch.compile(model, backend=backend)(tokens), targets).backward()
    (graph,) = backend.graphs
    return graph


def _reduce_ops_and_divisions(gm) -> tuple[set[str], int]:
    """The ops a backward graph's gradient collectives reduce with, and the divisions of a
    reduced gradient lowering made."""
    ops = {n.args[1] for n in gm.graph.nodes if is_reduce_scatter(n) or is_all_reduce(n)}
    divisions = sum(n.target is torch.ops.aten.div.Tensor and is_ours(n) for n in gm.graph.nodes)
    return ops, divisions


@pytest.mark.structure
@pytest.mark.parametrize("regional", [True, False], ids=["regional", "whole-graph"])
def test_gradients_average_in_the_collective_where_the_group_can(regional, monkeypatch):
    """On a group whose backend averages (NCCL, and the fake group one-GPU benchmarks stand
    in for it with) every gradient collective averages and no division follows: SUM and then
    a division kernel reads and writes every reduced gradient once more. Where the backend
    cannot (gloo), SUM and the division remain (NOTE: averaging in the collective)."""
    graph = _bf16_step(regional=regional)
    assert {p.reduce_op for p in graph.plan.params} == {"avg"}
    assert _reduce_ops_and_divisions(graph.backward) == ({"avg"}, 0)
    torch._dynamo.reset()
    monkeypatch.setattr(fsdp_compile.markers, "AVERAGING_BACKENDS", frozenset())  # as on gloo
    graph = _bf16_step(regional=regional)
    assert {p.reduce_op for p in graph.plan.params} == {"sum"}
    ops, divisions = _reduce_ops_and_divisions(graph.backward)
    assert ops == {"sum"} and divisions == len(graph.plan.trainable)


@pytest.mark.structure
@pytest.mark.parametrize("regional", [True, False], ids=["regional", "whole-graph"])
def test_gradients_are_packed_once_in_the_reduce_dtype(regional):
    """Under bf16 compute and fp32 reduction every reduce-scatter reads what a pack in the
    step's graph wrote in fp32 from the bf16 gradients: a bucket's copy-in, or a flat's pack
    (behind a block call too: NOTE: a flat's copies in the block call). Packed in bf16 and
    cast after, every gathered-size gradient was read and written once more (estimated at
    12 ms a step at 8B on an H100; NOTE: gradients packed once). Each pack comes after the
    previous reduce-scatter's wait, so one packed bucket is alive at a time, as in FSDP2 (a
    second one cost 1.1 GB of peak for the Mixtral preset on an H100)."""
    graph = _bf16_step(regional=regional)
    nodes = list(graph.backward.graph.nodes)
    scatters = [n for n in nodes if is_reduce_scatter(n)]
    assert len(scatters) == len(graph.plan.buckets)
    packs = []
    for scatter in scatters:
        source = scatter.args[0]
        while is_view(source):
            source = source.args[0]
        assert is_pack_for_reduce_scatter(source), source.format_node()
        assert source.meta["val"].dtype == torch.float32
        assert [g.meta["val"].dtype for g in source.args[0]] == [torch.bfloat16] * len(source.args[0])
        packs.append(source)
    for scatter, next_pack in zip(scatters, packs[1:]):
        (wait,) = scatter.users
        assert nodes.index(wait) < nodes.index(next_pack), (wait.name, next_pack.name)


@pytest.mark.structure
def test_a_pack_is_widened_only_where_nothing_else_reads_it():
    """pack_in_reduce_dtype writes a pack in the dtype of the cast reading it, with the same
    numbers, but only where nothing else reads the bf16 pack: there, widening it would write
    the gradient twice instead of once."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._pytree import tree_leaves

    from fsdp_compile.bucket_copies import pack_for_reduce_scatter
    from fsdp_compile.passes import check_pack_in_reduce_dtype, pack_in_reduce_dtype
    from fsdp_compile.plan import BackendOptions, Plan

    def alone(a, b):
        return pack_for_reduce_scatter([a, b], 2).view(-1).float()

    def shared(a, b):
        packed = pack_for_reduce_scatter([a, b], 2).view(-1)
        return packed.float(), packed

    grads = (torch.randn(4, 3).bfloat16(), torch.randn(2).bfloat16())
    plan = Plan(graph_name="hand-built", options=BackendOptions())
    for fn, widened in ((alone, True), (shared, False)):
        gm = pack_in_reduce_dtype(make_fx(fn, tracing_mode="fake")(*grads), plan)
        check_pack_in_reduce_dtype(gm, plan)
        packs = [n.meta["val"].dtype for n in gm.graph.nodes if is_pack_for_reduce_scatter(n)]
        assert packs == [torch.float32 if widened else torch.bfloat16], fn.__name__
        got, want = tree_leaves(gm(*grads)), tree_leaves(fn(*grads))
        assert len(got) == len(want) and all(map(torch.equal, got, want)), fn.__name__


def _bf16_gradients(rank, world, *, cfg):
    """One bf16 step's gradients (this rank's rows), uncompiled and compiled both ways."""
    grads = {}
    for mode, options in {"none": None, "regional": {}, "whole-graph": {"regional": False}}.items():
        torch._dynamo.reset()
        model = fully_shard(build_model(cfg), mp_policy=BF16)
        forward = model if options is None else torch.compile(model, backend=MfsdpBackend(compiler="eager", **options))
        tokens, targets = rank_batches(cfg, rank)(0)
        loss_fn(forward(tokens), targets).backward()
        grads[mode] = {n: p.grad.to_local() for n, p in model.named_parameters() if p.grad is not None}
    return grads


@pytest.mark.multirank
def test_bf16_gradients_reduce_as_the_eager_markers_do():
    """On 2 gloo ranks (SUM and a division), a compiled step's bf16-computed, fp32-reduced
    gradients equal the eager markers' bit for bit: packed once in fp32 (a block call's own
    pack, a flat's pack in the step, a bucket's copy-in) they are the markers' bf16 packs
    cast after. The embedding's is left out: AOTAutograd's decomposition of its backward
    accumulates in fp32 where ATen's bf16 kernel accumulates in bf16."""
    for grads in spawn(_bf16_gradients, 2, cfg=TransformerConfig()):
        eager = grads.pop("none")
        for mode, compiled in grads.items():
            assert set(compiled) == set(eager), mode
            for name, grad in compiled.items():
                assert name == "embed.weight" or torch.equal(grad, eager[name]), (mode, name)


def _bf16_run(rank, world, *, cfg, modes, steps):
    ref_losses, ref_params = reference(cfg, world, steps=steps)
    results = {}
    for mode in modes:
        torch._dynamo.reset()
        model = fully_shard(build_model(cfg), mp_policy=BF16)
        forward = model if mode == "none" else torch.compile(model, backend=MfsdpBackend(compiler=mode))
        losses = mean_over_ranks(train(model, forward, rank_batches(cfg, rank), steps=steps))
        error, worst = max_param_error(full_parameters(model), ref_params)
        results[mode] = {
            "loss_error": relative_error(losses.float(), ref_losses),
            "param_error": error,
            "worst": worst,
        }
    return results


@pytest.mark.multirank
def test_bf16_training_tracks_the_fp32_reference():
    """20 steps in bf16 stay within bf16 tolerance of the fp32 unsharded run, compiled and not.

    bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 2e-3 per operation): the loss curve
    stays within 2e-2 of fp32. The fp32 main weights drift further (bound 1e-1, 2-norm) because
    AdamW normalises each element's step: where a gradient is mostly rounding noise, bf16 and
    fp32 take full-size steps in different directions (observed: 5e-3 loss, 6e-2 weights).
    """
    cfg = TransformerConfig()
    for result in spawn(_bf16_run, 2, cfg=cfg, modes=("none", "eager"), steps=20):
        for mode, r in result.items():
            assert r["loss_error"] < 2e-2, (mode, r["loss_error"])
            assert r["param_error"] < 1e-1, (mode, r["param_error"], r["worst"])



FP16 = dict(param_dtype=torch.float16, reduce_dtype=torch.float32)


def _fp16_scaled_run(rank, world, *, cfg, steps):
    """fp16 compute under torch's GradScaler, as FSDP2 users run it where bf16 is missing, for
    FSDP2 and compiled mfsdp: per run the scale after each step and the parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    runs = {}
    for name in ("fsdp2", "mfsdp"):
        torch._dynamo.reset()
        model = build_model(cfg)
        if name == "fsdp2":
            for block in model.layers:
                fsdp2_fully_shard(block, mp_policy=MixedPrecisionPolicy(**FP16))
            forward = fsdp2_fully_shard(model, mp_policy=MixedPrecisionPolicy(**FP16))
        else:
            fully_shard(model, mp_policy=MixedPrecision(**FP16))
            forward = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # The first step overflows and is skipped; the scale then grows every 2 good steps.
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=2)
        scales = []
        for step in range(steps):
            tokens, targets = rank_batches(cfg, rank)(step)
            scaler.scale(loss_fn(forward(tokens).float(), targets)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        runs[name] = (scales, full_parameters(model))
    return runs


@pytest.mark.multirank
def test_fp16_with_a_grad_scaler_skips_and_scales_as_under_fsdp2():
    """A step with an inf or NaN in any rank's gradient shard is skipped on every rank (torch's
    GradScaler reduces DTensor gradients' found-inf over the mesh): the scale follows FSDP2's
    step for step on both ranks, and the parameters stay within fp16 rounding of FSDP2's
    (observed 2.6e-4; the reductions sum in another order)."""
    for result in spawn(_fp16_scaled_run, 2, cfg=TransformerConfig(), steps=8):
        fsdp2_scales, fsdp2_params = result["fsdp2"]
        scales, params = result["mfsdp"]
        assert scales == fsdp2_scales, (scales, fsdp2_scales)
        assert len(set(scales)) > 2, scales  # skipped steps and grown scales both happened
        error, worst = max_param_error({n: p.float() for n, p in params.items()}, fsdp2_params)
        assert error < 2e-3, (error, worst)


@pytest.mark.structure
def test_bad_mixed_precision_is_rejected():
    with pytest.raises(ValueError, match="floating torch.dtype"):
        MixedPrecision(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="narrower than param_dtype"):
        MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)
    MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.bfloat16, allow_lower_precision_reduce=True)



class _AutocastInside(nn.Module):
    """An HF causal LM whose forward enters ``torch.autocast`` itself, around the layers."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, enabled: bool | None) -> torch.Tensor:
        if enabled is None:  # the caller's autocast, whatever it is
            return self.model(input_ids=tokens, labels=tokens).loss
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            return self.model(input_ids=tokens, labels=tokens).loss


def _hf_llama(checkpointed: bool) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, max_position_embeddings=32, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if checkpointed:
        model.gradient_checkpointing_enable()
    return model


@pytest.mark.structure
@pytest.mark.parametrize(
    "where, checkpointed", [("around_the_step", False), ("inside_the_forward", True)],
    ids=["around_the_step", "inside_the_forward-checkpointed"],
)
def test_autocast_reaches_the_blocks_as_in_eager(where, checkpointed):
    """A user's ``torch.autocast(bfloat16)`` on an HF Llama, around the step or entered by the
    model's own forward, steps with and without it alternating: the compiled step (regional
    bodies, the eager runner, one gloo rank) gives the eager model's loss and gradients bit
    for bit, HF's gradient checkpointing (a recompute in the backward) included. Before, the
    bodies ran with autocast off (the step's graph runs so, its casts baked in): the layers'
    matmuls in fp32, the loss off by 3e-5 (NOTE: autocast in a block call, in
    block_runtime.py)."""
    reference = _AutocastInside(_hf_llama(checkpointed)).train()
    with one_rank_group():
        model = _AutocastInside(fully_shard(_hf_llama(checkpointed))).train()
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
        for step, enabled in enumerate([True, False, True]):
            tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
            losses = []
            for run in (forward, reference):
                around = where == "around_the_step"
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled and around):
                    loss = run(tokens, None if around else enabled)
                loss.backward()
                losses.append(loss.detach())
            assert torch.equal(*losses), (step, enabled, losses)
            grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
            for name, p in reference.named_parameters():
                assert torch.equal(grads[name], p.grad), (step, enabled, name)
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)


@pytest.mark.structure
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_model_cast_after_sharding_computes_in_its_new_dtype(compiled):
    """``model.to(torch.bfloat16)`` after ``fully_shard`` computes and reduces in bf16, as the
    unsharded model cast alike: each record's dtypes follow the stored dtype
    (``ShardInfo.stored_as``), a policy's own dtypes stay, and ``.float()`` turns them back.
    Before, the records kept fp32 and the step gathered, computed and returned fp32 without a
    word."""
    from fsdp_compile import shard_info

    cfg = TransformerConfig()
    inputs, targets = make_batch(cfg, 2, 16, 0, 0)
    expected = build_model(cfg).to(torch.bfloat16)
    expected_out = expected(inputs)
    loss_fn(expected_out.float(), targets).backward()
    with one_rank_group():
        model = build_model(cfg)
        for layer in model.layers:
            fully_shard(layer, mp_policy=MixedPrecision(reduce_dtype=torch.float32))
        fully_shard(model)
        model.to(torch.bfloat16)
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager")) if compiled else model
        out = forward(inputs)
        loss_fn(out.float(), targets).backward()
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected_out)
        for (name, param), reference_param in zip(model.named_parameters(), expected.parameters()):
            assert param.dtype == torch.bfloat16, name
            if reference_param.grad is not None:
                assert param.grad.dtype == torch.bfloat16, name
                assert relative_error(param.grad.full_tensor(), reference_param.grad) < 1e-2, name
        block = model.layers[0]._mfsdp_region_flats["_flat0"]
        assert (shard_info(block).param_dtype, shard_info(block).reduce_dtype) == (torch.bfloat16, torch.float32)
        assert shard_info(model.embed.weight).reduce_dtype == torch.bfloat16
        if compiled:  # NOTE: converting after torch.compile, in fsdp_compile/gathered_reads.py
            with pytest.raises(UsageError, match="before torch.compile"):
                model.float()
            assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # refused before any change
            return
        model.float()
        assert {(shard_info(p).param_dtype, shard_info(p).reduce_dtype) for p in model.head.parameters()} == {
            (torch.float32, torch.float32)
        }


@pytest.mark.structure
def test_moving_a_compiled_model_where_it_is_changes_nothing():
    """``model.to(device)`` on its own device and ``.float()`` of an fp32 model, after a
    compiled step (an evaluation helper's habit), leave every parameter the object and the
    values it was (the optimizer's), and the next steps train as the unsharded model on the
    graph already compiled (NOTE: converting after torch.compile, in
    fsdp_compile/gathered_reads.py; torch's swap of each DTensor parameter failed before)."""
    cfg = TransformerConfig()
    expected = build_model(cfg)
    with one_rank_group():
        model = fully_shard(build_model(cfg))
        backend = MfsdpBackend(compiler="eager")
        forward = torch.compile(model, backend=backend)
        params = list(model.parameters())
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, expected)]
        for step in range(3):
            inputs, targets = make_batch(cfg, 2, 16, step, 0)
            for run, opt in zip((forward, expected), opts):
                loss_fn(run(inputs), targets).backward()
                opt.step()
                opt.zero_grad()
            model.to("cpu").float()
            assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
        assert len(backend.graphs) == 1
        for (name, param), want in zip(model.named_parameters(), expected.parameters()):
            assert torch.allclose(param.full_tensor(), want, rtol=1e-5, atol=1e-7), name


class _FloatInputs(nn.Module):
    """Layers called with fp32 tensors (the input, then each scaled by an fp32 tensor): under a
    bf16 ``param_dtype`` each sharded module's call casts its floating inputs, as FSDP2's does."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x * torch.full((8,), 1.1))  # fp32 between the calls: each call's input
        return self.head(x)


@pytest.mark.structure
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fsdp2_mixed_precision_policy_casts_as_under_fsdp2(compiled):
    """FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32)``
    given as it is, on a model called with fp32 inputs: each sharded module's call casts its
    floating inputs to bf16 and its output to fp32, as FSDP2 does. Before, the policy
    was refused, and ``MixedPrecision(param_dtype=bf16)`` failed at the first matmul ("mat1
    and mat2 must have the same dtype"). Loss and gradients equal FSDP2's (one gloo rank)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    theirs = _FloatInputs()
    ours = copy.deepcopy(theirs)
    with one_rank_group():
        for shard, model in ((fsdp2_fully_shard, theirs), (fully_shard, ours)):
            for unit in (*model.layers, model.head):
                shard(unit, mp_policy=policy)
            shard(model, mp_policy=policy)
        expected = theirs(x)
        expected.square().mean().backward()
        forward = torch.compile(ours, backend=MfsdpBackend(compiler="eager")) if compiled else ours
        got = forward(x)
        got.square().mean().backward()
        pairs = zip(ours.named_parameters(), theirs.parameters())
        grads = {name: (p.grad.full_tensor(), q.grad.full_tensor()) for (name, p), q in pairs}
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)
    for name, (mine, fsdp2) in grads.items():
        assert torch.equal(mine, fsdp2), name
