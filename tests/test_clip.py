"""``fsdp_compile.clip_grad_norm_``: gradients on several meshes (expert parallelism).

Each check compares against torch's ``clip_grad_norm_`` on the single-process reference of the
same model and global batch: the returned norm, and every gradient after clipping.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fsdp_compile import MfsdpBackend, clip_grad_norm_, fully_shard
from fsdp_compile.testing.models import TransformerConfig, loss_fn
from harness import (
    EP,
    EP_WORLD as WORLD,
    assert_parity,
    build_model,
    global_batch,
    parity_run,
    rank_batches,
    moe_config,
    relative_error,
    spawn,
    with_meshes,
)

MAX_NORM = 0.05
"""Below every test model's gradient norm, so clipping scales."""


def _reference_clip(cfg, world: int, norm_type: float) -> tuple[torch.Tensor, dict]:
    """torch's clip on the unsharded model after one backward on the global batch."""
    model = build_model(cfg)
    tokens, targets = global_batch(cfg, 0, world)
    loss_fn(model(tokens), targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
    assert norm > MAX_NORM
    return norm, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _clip_errors(rank, world, *, cases):
    """For each case (cfg, shard options, mode, norm_type): errors of the returned norm and of
    the worst clipped gradient this rank holds, against the reference."""
    errors = {}
    for key, (cfg, shard_options, mode, norm_type) in cases.items():
        expected_norm, expected_grads = _reference_clip(cfg, world, norm_type)
        torch._dynamo.reset()
        model = fully_shard(build_model(cfg), **with_meshes(shard_options))
        forward = model if mode == "none" else torch.compile(model, backend=MfsdpBackend(compiler=mode))
        tokens, targets = rank_batches(cfg, rank)(0)
        loss_fn(forward(tokens), targets).backward()
        norm = clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        errors[key] = (
            relative_error(norm, expected_norm),
            max(relative_error(g, expected_grads[n]) for n, g in grads.items()),
        )
    return errors


def _assert_small(results):
    for errors in results:
        for key, (norm_error, grad_error) in errors.items():
            assert norm_error < 1e-5 and grad_error < 1e-5, (key, norm_error, grad_error)


EXPERT_CASES = {
    (form, efsdp, mode, norm_type): (
        moe_config(fused=form == "fused"), {"ep_size": EP, "shard_experts": efsdp}, mode, norm_type
    )
    for form in ("fused", "modulelist")
    for efsdp in (False, True)
    for mode, norm_type in (("none", 2.0), ("eager", 2.0), ("none", math.inf))
}


@pytest.mark.multirank
def test_clip_over_dense_and_expert_meshes_matches_the_reference():
    """EP 2 x edp 2, both expert forms, with and without efsdp, uncompiled and compiled, 2-norm
    and inf-norm: the norm covers every expert once (ModuleList experts summed over the EP
    group, which no DTensor mesh shows) and every gradient is scaled as torch scales the
    reference's. torch's own clip_grad_norm_ raises here (mixed meshes)."""
    _assert_small(spawn(_clip_errors, WORLD, cases=EXPERT_CASES))


DENSE = TransformerConfig(n_layers=2)
DENSE_CASES = {
    (strategy, str(mesh_shape), norm_type): (
        DENSE, {"strategy": strategy, **({"mesh_shape": mesh_shape} if mesh_shape else {})}, "eager", norm_type
    )
    for strategy, mesh_shape in (
        ("no_shard", None), ("optim", None), ("optim_grads_params", None), ("optim_grads_params", (2, 2))
    )
    for norm_type in (math.inf,)
}
"""The 2-norm on every layout, over three steps, is the strategy x API matrix's
(tests/test_matrix.py, ``clip_fsdp_compile``); here the inf-norm."""


@pytest.mark.multirank
def test_clip_on_one_mesh_matches_the_reference_for_every_strategy():
    """One mesh (each strategy, and HSDP 2 x 2), the inf-norm: the same result as torch's
    clip on the reference, where torch's clip would work as well."""
    _assert_small(spawn(_clip_errors, WORLD, cases=DENSE_CASES))


@pytest.mark.multirank
@pytest.mark.parametrize("fused", [True, False], ids=["fused-experts", "modulelist-experts"])
def test_expert_parallel_training_with_clipping_keeps_parity(fused):
    """Clipping every step, 3 steps of AdamW, compiled: same losses and weights as the
    reference clipped by torch."""
    results = spawn(
        parity_run, WORLD, cfg=moe_config(fused=fused), modes=("eager",), ep_size=EP, max_norm=MAX_NORM
    )
    assert_parity(results)


@pytest.mark.structure
def test_clip_misuse_is_named():
    with pytest.raises(TypeError, match="pass model.parameters"):
        clip_grad_norm_(nn.Linear(2, 2), 1.0)
    with pytest.raises(ValueError, match="norm_type must be positive"):
        clip_grad_norm_(nn.Linear(2, 2).parameters(), 1.0, norm_type=0)
