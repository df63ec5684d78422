"""Gathers in flight together on gloo, as every prefetched step issues them.

torch 2.12 and 2.13 run ``_c10d_functional.all_gather_into_tensor`` as a one-tensor coalesced
all-gather, and gloo's coalesced all-gather corrupts the heap when two are in flight: a rank
died in CI with "malloc(): unaligned tcache chunk detected" (once as a segfault in gloo's
worker thread) in the middle of the strategy x API matrix. fsdp_compile registers a CPU
kernel that runs the gather as one ``_allgather_base`` work instead
(``compat.gather_cpu_tensors_one_work_each``). Without it this test's ranks died within
seconds in each of the runs tried here; with it they return the right gathers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_compile import compat
from harness import spawn

pytestmark = pytest.mark.multirank

SIZES = (64, 1000, 48, 4096)
"""Shards of a few layers' sizes, small ones included (their buffers are glibc's cached
chunks, the ones found corrupt)."""
ROUNDS = 20_000


def _gather_rounds(rank: int, world: int) -> list[torch.Tensor]:
    compat.gather_cpu_tensors_one_work_each()  # what fully_shard on a CPU mesh installs
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    group = dist.group.WORLD.group_name
    shards = [torch.full((size,), float(rank)) for size in SIZES]
    for _ in range(ROUNDS):
        gathered = [gather(shard, world, group) for shard in shards]  # all issued, then waited
        gathered = [wait(g) for g in gathered]
    return gathered


def test_gathers_in_flight_together_on_gloo_keep_every_rank_alive_and_right():
    results = spawn(_gather_rounds, 2)
    for gathered in results:
        for size, tensor in zip(SIZES, gathered):
            assert torch.equal(tensor, torch.cat([torch.full((size,), float(r)) for r in range(2)]))
