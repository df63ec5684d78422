"""Expert parallelism through a model's life: gradient accumulation, DCP checkpoints, meta init.

Each run is EP 2 x edp 2 on 4 gloo ranks (or another layout where a checkpoint moves), both
expert forms, checked against the single-process reference or the uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from fsdp_compile import MfsdpBackend, expert_mesh, fully_shard
from fsdp_compile.testing.models import Transformer
from harness import (
    EP,
    EP_WORLD as WORLD,
    accumulate_run,
    build_model,
    checkpoint_resume_run,
    checkpoint_save_run,
    full_parameters,
    max_param_error,
    mean_over_ranks,
    moe_config,
    rank_batches,
    reference,
    relative_error,
    spawn,
    train,
)

pytestmark = pytest.mark.multirank

FORMS = pytest.mark.parametrize("fused", [True, False], ids=["fused-experts", "modulelist-experts"])


@FORMS
def test_expert_parallel_gradient_accumulation_reduces_once(fused):
    """3 micro-batches per step, sync on the last: parity, and the no-sync backward runs no
    reduction at all (expert all-reduces over edp included)."""
    for mode in ("none", "eager"):
        for result in spawn(
            accumulate_run, WORLD, cfg=moe_config(fused=fused), strategy="optim_grads_params", mode=mode, ep_size=EP
        ):
            assert result["loss_error"] < 1e-5 and result["param_error"] < 1e-5, (mode, result)
            if mode == "eager":
                no_sync, final = result["backward_collectives"]
                assert "reduce_scatter" not in no_sync and "all_reduce" not in no_sync, no_sync
                assert final.get("all_reduce", 0) > 0 and final.get("reduce_scatter", 0) > 0, final


# ---- DCP: save under one expert layout, resume under another ---------------------------------


@FORMS
def test_expert_parallel_checkpoint_resumes_under_another_layout(tmp_path, fused):
    """Saved at world 4 as EP 2 x edp 2; resumed at world 4 as EP 4 x edp 1 and at world 2 as
    EP 2 x edp 1: the same losses as the run that never stopped. Each expert is stored once
    under its global name (ModuleList form: each EP rank writes its own experts' entries;
    stacked: one [E, ...] DTensor), so DCP moves experts between EP ranks."""
    cfg = moe_config(fused=fused)
    path = str(tmp_path / "ckpt")
    uninterrupted = spawn(checkpoint_save_run, WORLD, cfg=cfg, path=path, ep_size=EP)[0]
    for world, ep in ((4, 4), (2, 2)):
        resumed = spawn(checkpoint_resume_run, world, cfg=cfg, path=path, ep_size=ep)[0]
        assert relative_error(resumed, uninterrupted) < 1e-5, (world, ep, resumed, uninterrupted)


# ---- meta init ------------------------------------------------------------------------------------


def _meta_then_load(rank, world, *, cfg):
    """Meta build, shard with experts, materialise, load full pretrained weights, train."""
    ref_losses, ref_params = reference(cfg, world)
    with torch.device("meta"):
        model = Transformer(cfg)
    fully_shard(model, expert_mesh=expert_mesh("cpu", EP))
    model.to_empty(device="cpu")
    held = {n for n, _ in model.named_parameters()}
    # The pretrained file holds every expert; a ModuleList rank keeps only its own.
    pretrained = {n: t for n, t in build_model(cfg).state_dict().items() if n in held}
    set_model_state_dict(model, pretrained, options=StateDictOptions(full_state_dict=True))
    forward = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
    losses = mean_over_ranks(train(model, forward, rank_batches(cfg, rank)))
    params = full_parameters(model)
    error, worst = max_param_error(params, {n: ref_params[n] for n in params})
    return relative_error(losses, ref_losses), error, worst


@FORMS
def test_expert_parallel_meta_init_then_loaded_weights_train_to_parity(fused):
    for loss_error, param_error, worst in spawn(_meta_then_load, WORLD, cfg=moe_config(fused=fused)):
        assert loss_error < 1e-5 and param_error < 1e-5, (loss_error, param_error, worst)
