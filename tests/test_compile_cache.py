"""The compile cache: a restart loads its compiled graphs, and they compute the same step.

A second process compiling the same model on the same machine (the same cache folder) reads
the compiled forward, backward and repeated-block bodies from AOTAutograd's and Inductor's
caches: the partitioner's key is stable across processes and differs per rank and per plan
(a body's, which holds nothing rank-specific, is the same on every rank).
torch 2.13 keys a graph with DeviceMesh inputs differently in every process and loads a
cached graph without its opaque constants (the gradients' DeviceMesh); ``fsdp_compile.compat``
works around both, which these tests hold: restarts used to miss, and a hit used to fail in
backward ("found no DeviceMesh from dtensor args for aten::detach").
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.backend import _Partitioner
from fsdp_compile.testing.models import TransformerConfig
from harness import build_model, rank_batches, spawn, train

pytestmark = pytest.mark.multirank


def _cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    both = {**counters["inductor"], **counters["aot_autograd"]}
    return {k: v for k, v in both.items() if "cache" in k}


def _mlp_step(rank, world, *, cache_dir, **options):
    """One Inductor-compiled step of a small MLP whose shards are uneven (15 rows over 2
    ranks), as a fresh process sees it: loss, gradients and where each gradient lives."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(8, 15), nn.ReLU(), nn.Linear(15, 4)))
    forward = torch.compile(model, backend=MfsdpBackend(compiler="inductor", **options))
    loss = forward(torch.randn(4, 8)).sum()
    loss.backward()
    params = list(model.parameters())
    grads = torch.cat([p.grad.full_tensor().flatten() for p in params])
    meshes = [
        (p.grad.device_mesh == p.device_mesh, p.grad.device_mesh.get_coordinate(), p.grad.placements)
        for p in params
    ]
    return loss.detach(), grads, meshes, _cache_counters()


def test_a_restart_reads_the_caches_and_computes_the_same_step(tmp_path):
    """The second process hits both caches and gets the first one's loss and gradients,
    bit for bit, each gradient a DTensor on this rank's mesh coordinate; with
    ``compile_cache=False`` a third compiles afresh (no hit) to the same numbers."""
    cold = spawn(_mlp_step, 2, cache_dir=str(tmp_path))
    warm = spawn(_mlp_step, 2, cache_dir=str(tmp_path))
    fresh = spawn(_mlp_step, 2, cache_dir=str(tmp_path), compile_cache=False)
    for rank in range(2):
        (loss, grads, meshes, cold_caches), (_, _, _, warm_caches) = cold[rank], warm[rank]
        # The cold run compiles; a body (here each Linear, a repeated block of the Sequential)
        # holds nothing rank-specific, so one rank may load what its peer wrote a moment ago.
        assert cold_caches.get("fxgraph_cache_miss", 0) >= 2, cold_caches
        assert warm_caches.get("autograd_cache_hit", 0) >= 1, warm_caches
        assert warm_caches.get("fxgraph_cache_hit", 0) >= 2, warm_caches  # forward and backward
        assert not any(k.endswith("_hit") for k in fresh[rank][3]), fresh[rank][3]
        for other in (warm[rank], fresh[rank]):
            assert torch.equal(other[0], loss) and torch.equal(other[1], grads)
            assert other[2] == meshes
        assert all(same and coordinate == (rank,) for same, coordinate, _ in meshes), meshes


CFG = TransformerConfig(vocab=64, n_heads=4, n_layers=2)


def _transformer_run(rank, world, *, cache_dir):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    model = fully_shard(build_model(CFG))
    compiled = torch.compile(model, backend="mfsdp")
    losses = train(model, compiled, rank_batches(CFG, rank), steps=3)
    return losses, _cache_counters()


def test_repeated_block_bodies_come_from_the_cache_too(tmp_path):
    """Regional compilation (the default) and the caches compose: the restart trains three
    steps to the same losses with every graph Inductor compiled loaded, none compiled: the
    block's forward and backward bodies, and the step's forward and backward. (With
    ``compile_outside_blocks=False`` the bodies are compiled as here and the rest runs as
    Python, NOTE: what Inductor compiles; not run again.) The test model's fused linear is an
    ``autograd.Function``, which AOTAutograd's cache refuses, so this reads Inductor's cache
    alone (the MLP above reads both)."""
    cold = spawn(_transformer_run, 2, cache_dir=str(tmp_path))
    warm = spawn(_transformer_run, 2, cache_dir=str(tmp_path))
    for (cold_losses, cold_caches), (warm_losses, warm_caches) in zip(cold, warm):
        assert torch.equal(cold_losses, warm_losses)
        # What the cold run compiled, or loaded from its peer rank (a body's entry is the same
        # on every rank).
        compiled = cold_caches["fxgraph_cache_miss"] + cold_caches.get("fxgraph_cache_hit", 0)
        assert compiled >= 2, cold_caches
        assert warm_caches.get("fxgraph_cache_hit", 0) == compiled, (cold_caches, warm_caches)
        assert warm_caches.get("fxgraph_cache_miss", 0) == 0, warm_caches


def _partitioner_keys(rank, world, *, cfg):
    model = fully_shard(build_model(cfg))
    backend = MfsdpBackend(compiler="eager")
    train(model, torch.compile(model, backend=backend), rank_batches(cfg, rank), steps=1)
    return [_Partitioner(graph).uuid() for graph in backend.graphs]


def test_the_partitioners_cache_key_is_stable_across_processes_and_differs_per_rank_and_plan():
    """Labels are counters a fresh process hands out alike, not addresses (unit names once
    held id(module)); pass timings are kept off the graphs, which the key hashes. The rank
    is part of the key even where shards are alike (the backward returns this rank's mesh),
    and a different plan (one layer more) gives a different key."""
    first, second = spawn(_partitioner_keys, 2, cfg=CFG), spawn(_partitioner_keys, 2, cfg=CFG)
    assert first == second
    assert first[0] != first[1]
    deeper = spawn(_partitioner_keys, 2, cfg=TransformerConfig(vocab=64, n_heads=4, n_layers=3))[0]
    assert deeper != first[0]
