"""A flat's all-gather that writes each member whole: no copy-out (``gather_whole_members``).

NOTE: members gathered whole
    A flat's shard is rank-major (NOTE: flat parameters, in flat_params.py): this rank's rows
    of member 0, then of member 1, ... One ``all_gather_into_tensor`` of it gives
    ``[rank 0: m0 m1 ... | rank 1: m0 m1 ... | ...]``, where no member is contiguous, so
    ``split_gathered`` copies every member out: the whole gathered layer read and written once
    more, in line, at each gather (on one H100, 21 ms of a 436 ms step at Llama-3 8B and 196 of
    1348 ms at 70B, docs/performance.md; FSDP2 pays the same copy).

    ``gather_whole_members`` gathers member by member instead, each into its own segment of
    one buffer: ``[m0 of rank 0, m0 of rank 1, ... | m1 of rank 0, ... | ...]``, so member
    ``i`` is a contiguous view of the buffer, rows in order, padding last. The user's
    parameters keep their rows-of-each-parameter shards (the ``DTensor`` shards FSDP2 has),
    the bytes on the wire are the same, and the copy-out is gone. The gradients go back as
    before: the block's backward packs them rank-major for one reduce-scatter.

    One op, one result, one ``wait_tensor``, as a functional all-gather: the op issues the
    members' gathers and registers their completion with torch's functional-collective
    registry for its result, so the step's graph schedules it as any gather. On NCCL the
    members' gathers are one group (``_coalescing_manager``: one launch; the fake process group
    runs the same path). Elsewhere each is its own ``_allgather_base`` work, and the result's
    work waits on each in turn (``_MemberGathers``): gloo's coalesced all-gather corrupts the
    heap when two are in flight (``compat.gather_cpu_tensors_one_work_each``), and a
    prefetched step always has two; a process group written in Python (the bench's emulated
    link) has no c10d backend to coalesce with, and its works' futures need not wait for
    their collectives, which their ``wait`` does.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import _register_work
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["gather_whole_members"]

# torch 2.13 renamed ``all_gather_into_tensor`` (deprecated there) to ``all_gather_single``.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@torch.library.custom_op("fsdp_compile::gather_whole_members", mutates_args=())
def gather_whole_members(shard: Tensor, group_size: int, group_name: str, sizes: list[int]) -> Tensor:
    """``shard`` (1-D, this rank's slots of ``sizes`` elements each, in order) gathered over
    ``group_name`` slot by slot: slot ``i`` of every rank, in rank order, then slot ``i + 1``
    (NOTE: members gathered whole). Wait on the result with ``wait_tensor``."""
    group = _resolve_process_group(group_name)
    out = shard.new_empty(shard.numel() * group_size)
    segments, start = [], 0
    for size in sizes:
        segments.append((out[start * group_size : (start + size) * group_size], shard[start : start + size]))
        start += size
    if _coalesces(group, shard.device):
        with dist._coalescing_manager(group, shard.device, async_ops=True) as gathers:
            for whole, slot in segments:
                _all_gather_single(whole, slot, group=group)
        (work,) = gathers.works
    else:
        work = _MemberGathers([_all_gather_single(whole, slot, group=group, async_op=True) for whole, slot in segments])
    _register_work(out, work)
    return out


# The c10d backends whose coalesced all-gather is one safe group: NCCL's is one launch, the
# fake group's is what the structure tier traces NCCL's path with.
_COALESCING_BACKENDS = frozenset({"nccl", "fake"})


def _coalesces(group: dist.ProcessGroup, device: torch.device) -> bool:
    try:
        backend = group._get_backend(device)
    except RuntimeError:  # a process group written in Python: c10d holds no backend for it
        return False
    return backend.name() in _COALESCING_BACKENDS


class _MemberGathers(dist.Work):
    """The members' gathers as one work: waiting on it waits on each (on CUDA, the current
    stream waits on each, as on one)."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for work in self._works:
            work.wait(timeout)
        return True


@gather_whole_members.register_fake
def _(shard, group_size, group_name, sizes) -> Tensor:
    return shard.new_empty(shard.numel() * group_size)
