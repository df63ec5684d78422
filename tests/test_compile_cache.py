"""The compile cache: a stable key, and no cached graph that breaks the step.

torch 2.13's FX graph cache and AOTAutograd cache, once the key is the same in two processes,
hand the second one compiled graphs whose DTensor gradients lost their DeviceMesh: its
backward fails ("found no DeviceMesh from dtensor args for aten::detach", seen with a
two-layer MLP at world 2). So the backend turns both off for its graphs (see NOTE: no compile
cache, in fsdp_compile/backend.py), and these tests hold that a restart trains, and that the
key itself is ready for the day the caches can be used: the same in every process and rank,
different when the plan differs.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.backend import _Partitioner
from fsdp_compile.models import TransformerConfig
from harness import build_model, rank_batches, spawn, train


def _compile_and_step(rank, world, *, cache_dir):
    """One Inductor-compiled step of a small MLP, as a fresh process sees it."""
    from torch._dynamo.utils import counters

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    loss = torch.compile(model, backend=MfsdpBackend(compiler="inductor"))(torch.randn(4, 8)).sum()
    loss.backward()
    grads = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    caches = {k: v for k, v in {**counters["inductor"], **counters["aot_autograd"]}.items() if "cache" in k}
    return loss.detach(), grads, caches


def test_a_restart_compiles_again_and_trains(tmp_path):
    """The second process over the same cache folder computes the same step (it used to
    fail in backward on the cached graphs) and reads nothing from the caches."""
    first = spawn(_compile_and_step, 2, cache_dir=str(tmp_path))
    second = spawn(_compile_and_step, 2, cache_dir=str(tmp_path))
    for (loss_a, grads_a, _), (loss_b, grads_b, caches) in zip(first, second):
        assert torch.equal(loss_a, loss_b) and torch.equal(grads_a, grads_b)
        assert not any(k.endswith("_hit") for k in caches), caches


def _partitioner_keys(rank, world, *, cfg):
    model = fully_shard(build_model(cfg))
    backend = MfsdpBackend(compiler="eager")
    train(model, torch.compile(model, backend=backend), rank_batches(cfg, rank), steps=1)
    return [_Partitioner(graph).uuid() for graph in backend.graphs]


# Every parameter's rows split evenly over 2 ranks: both ranks compile the same code.
EVEN = TransformerConfig(vocab=64, n_heads=4, n_layers=2)


def test_the_partitioners_cache_key_is_the_same_in_every_process_and_rank():
    """Labels are counters a fresh process hands out alike, not addresses (unit names once
    held id(module)); pass timings are kept off the graphs, which the key hashes; ranks with
    alike shards share a key; and a different plan (one layer more) gives a different key."""
    first, second = spawn(_partitioner_keys, 2, cfg=EVEN), spawn(_partitioner_keys, 2, cfg=EVEN)
    assert first[0] == second[0] and first[1] == second[1]
    assert first[0] == first[1]
    deeper = spawn(_partitioner_keys, 2, cfg=TransformerConfig(vocab=64, n_heads=4, n_layers=3))[0]
    assert deeper != first[0]
