"""torch.distributed.checkpoint: save on 4 ranks, load on 2 and on 1, resume identically.

The sharded parameters are DTensors, so DCP saves each rank's rows with their global layout
and loads them into any other sharding; the optimizer state is sharded the same way.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from fsdp_compile import fully_shard
from fsdp_compile.testing.models import TransformerConfig
from harness import (
    build_model,
    checkpoint_resume_run,
    checkpoint_save_run,
    checkpoint_setup,
    relative_error,
    spawn,
)


@pytest.mark.multirank
def test_save_on_4_load_on_2_and_1_resumes_the_same_losses(tmp_path):
    cfg = TransformerConfig()
    path = str(tmp_path / "ckpt")
    uninterrupted = spawn(checkpoint_save_run, 4, cfg=cfg, path=path)[0]
    for world in (2, 1):
        resumed = spawn(checkpoint_resume_run, world, cfg=cfg, path=path)[0]
        assert relative_error(resumed, uninterrupted) < 1e-5, (world, resumed, uninterrupted)


# Each checkpoint is loaded under the next strategy: the files do not depend on the strategy
# that wrote them (DCP reshards Shard(0) and Replicate() entries alike).
NEXT_STRATEGY = {
    "no_shard": "optim",
    "optim": "optim_grads",
    "optim_grads": "optim_grads_params",
    "optim_grads_params": "no_shard",
}


@pytest.mark.multirank
@pytest.mark.parametrize("strategy", sorted(NEXT_STRATEGY))
def test_every_strategy_saves_on_4_and_resumes_on_2_under_another(tmp_path, strategy):
    cfg = TransformerConfig(n_layers=2)
    path = str(tmp_path / "ckpt")
    uninterrupted = spawn(checkpoint_save_run, 4, cfg=cfg, path=path, strategy=strategy)[0]
    resumed = spawn(checkpoint_resume_run, 2, cfg=cfg, path=path, strategy=NEXT_STRATEGY[strategy])[0]
    assert relative_error(resumed, uninterrupted) < 1e-5, (resumed, uninterrupted)


@pytest.mark.structure
def test_state_dict_holds_shards_with_global_shapes():
    from torch.distributed.tensor import DTensor

    from harness import fake_process_group

    cfg = TransformerConfig()
    with fake_process_group(4):
        model = fully_shard(build_model(cfg))
        state = model.state_dict()
    reference = build_model(cfg).state_dict()
    assert state.keys() == reference.keys()
    for name, value in state.items():
        assert isinstance(value, DTensor), name
        assert value.shape == reference[name].shape, name


@pytest.mark.structure
def test_a_full_state_dict_loaded_with_load_state_dict_lands_this_rank_s_rows():
    """``model.load_state_dict(full_sd)``, an unsharded model's checkpoint loaded as HF and
    plain PyTorch code load one: each sharded parameter, a repeated block's flat members
    included, takes this rank's rows (3 ranks: uneven), as ``distribute_tensor`` places them,
    with no collective (NOTE: a full state dict copied in). Before, as under FSDP2: "got
    mixed torch.Tensor and DTensor". ``assign=True`` still refuses full tensors. Every rank
    of every layout: the matrix's ``full_state_dict`` cell. Rank 0 only here: in a process
    that made a fake group of the same size before, torch 2.13's ``nn.Parameter(dtensor)``
    holds that group's mesh, whose coordinate is rank 0's."""
    from torch.distributed.tensor import distribute_tensor

    from harness import fake_process_group

    cfg = TransformerConfig()
    full = build_model(cfg, seed=1).state_dict()
    with fake_process_group(3):
        model = fully_shard(build_model(cfg, seed=0))
        model.load_state_dict(full)
        for name, param in model.named_parameters():
            expected = distribute_tensor(full[name], param.device_mesh, param.placements, src_data_rank=None)
            assert torch.equal(param.to_local(), expected.to_local()), name
        flats = [flat for block in model.layers for flat in block._mfsdp_region_flats.values()]
        assert flats and all(flat.abs().sum() > 0 for flat in flats)
        with pytest.raises(ValueError, match="not a DTensor"):
            model.load_state_dict(full, assign=True)


@pytest.mark.structure
def test_a_state_dict_torch_saved_or_deep_copied_holds_this_rank_s_rows(tmp_path):
    """``torch.save(model.state_dict(), f"rank{rank}.pt")`` then ``torch.load`` and
    ``load_state_dict``, and ``copy.deepcopy(model.state_dict())``: a repeated block's
    parameters, views into its flat buffer, give back their rows (NOTE: entries that pickle),
    and the file holds those rows once. Before, both raised "Attempted to access the data
    pointer on an invalid python storage", the file half written. The entries still write
    into the model, as DCP's in-place load writes."""
    import copy

    from harness import fake_process_group

    cfg = TransformerConfig()
    with fake_process_group(3):
        model = fully_shard(build_model(cfg, seed=0))
        state = model.state_dict()
        torch.save(state, tmp_path / "rank0.pt")
        rows = sum(value.to_local().nbytes for value in state.values())
        assert (tmp_path / "rank0.pt").stat().st_size < 1.5 * rows  # 1.13; each flat written whole too: 2.0
        copied = copy.deepcopy(state)
        other = fully_shard(build_model(cfg, seed=1))
        other.load_state_dict(torch.load(tmp_path / "rank0.pt"))
        assigned = fully_shard(build_model(cfg, seed=1))
        assigned.load_state_dict(state, assign=True)  # nn.Parameter(entry) for each: plain DTensors
        assert all(torch.equal(a.to_local(), p.to_local()) for a, p in zip(assigned.parameters(), model.parameters()))
        for (name, param), (_, loaded) in zip(model.named_parameters(), other.named_parameters()):
            assert torch.equal(loaded.to_local(), param.to_local()), name
            assert torch.equal(copied[name].to_local(), param.to_local()), name
        (member, *_), *_ = [flat._mfsdp_members for flat in model.layers[0]._mfsdp_region_flats.values()]
        name = next(n for n, p in model.named_parameters() if p is member.param)
        state[name].to_local().fill_(7.0)
        assert bool((member.param.to_local() == 7.0).all()) and not bool((copied[name].to_local() == 7.0).any())


def _save_then_load_other_shapes(rank, world, *, path):
    model, _, opt = checkpoint_setup(TransformerConfig(), seed=0)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd}, checkpoint_id=path)
    other, _, other_opt = checkpoint_setup(TransformerConfig(hidden=96), seed=0)
    state = {"model": get_state_dict(other, other_opt)[0]}
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as error:  # a BaseException: DCP gathers every rank's failure
        return str(error)
    return "loaded"


@pytest.mark.multirank
def test_loading_a_checkpoint_of_other_shapes_fails_on_every_rank(tmp_path):
    """DCP checks shapes while planning the load, before any data moves: every rank raises
    (``CheckpointException``, carrying each rank's error) naming the mismatched entry."""
    messages = spawn(_save_then_load_other_shapes, 2, path=str(tmp_path / "ckpt"))
    for message in messages:
        assert "Size mismatch" in message and "model.layers.0.mlp.up" in message, message
