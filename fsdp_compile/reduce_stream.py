"""A gradient bucket's pack and reduce-scatter as one op, which on CUDA runs off the compute
stream, and its wait.

NOTE: the reduce-scatter off the compute stream
    The pack of a bucket's gradients into its reduce-scatter input (``pack_for_reduce_scatter``,
    an fp32 ``_chunk_cat`` under mixed precision) is a memory-bound copy of the whole layer's
    gradients. Run on the compute stream it adds its time to every layer's backward (at 70B,
    224 ms of a 1.35 s step on an H100); FSDP2 runs it on its reduce-scatter stream, where it
    overlaps the next layer's backward. ``pack_and_reduce_scatter`` does what FSDP2 does:

    - the side stream waits for the compute stream (the gradients are written), then packs and
      reduce-scatters there, into buffers allocated on the compute stream before the fork
      (one pool: the caching allocator caches freed blocks per stream);
    - ``wait_reduce_scatter``, where schedule_collectives put the reduce-scatter's wait (right
      before the next bucket's pack), makes the compute stream wait for the side stream and
      returns the reduced shard;
    - the issue returns the packed buffer, and the wait takes it and the gradients as
      arguments: so the compiler keeps all of them alive until the wait. Freed earlier, the
      allocator, or Inductor's reuse of a dead buffer, would hand their memory to the compute
      stream while the side stream still reads it (Inductor gives its own collectives'
      inputs that protection: NOTE: [Out-of-Place Collective Safety] in torch/_inductor/ir.py).

    A CUDA graph captures the fork and the join as event edges: every fork is joined by its
    wait before the step returns. Off CUDA the op is the pack then the functional
    reduce-scatter, the arithmetic of the two nodes it replaces (passes/reduce_off_compute_stream.py).

    One side stream per device, created on first use, as FSDP2 has one reduce-scatter stream:
    the packs and reduce-scatters then run in the order they were issued.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from fsdp_compile.bucket_copies import pack_into, packed_like

__all__ = ["pack_and_reduce_scatter", "wait_reduce_scatter"]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}
_ISSUED = "_fsdp_compile_reduce_scatter"
"""The packed buffer's attribute holding what its wait needs: (the side stream's end event or
None, the reduced shard)."""


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device_index)


def _reduced_like(packed: Tensor, group_size: int) -> Tensor:
    return packed.new_empty(packed.numel() // group_size)


@torch.library.custom_op("fsdp_compile::pack_and_reduce_scatter", mutates_args=())
def pack_and_reduce_scatter(
    grads: list[Tensor], reduce_op: str, group_size: int, group_name: str, dtype: torch.dtype | None = None
) -> Tensor:
    """Issue ``reduce_scatter_tensor(pack_for_reduce_scatter(grads, group_size, dtype),
    reduce_op, group_size, group_name)``; returns the packed buffer, which only
    ``wait_reduce_scatter`` may read. On CUDA both run on a side stream (NOTE: the
    reduce-scatter off the compute stream)."""
    packed = packed_like(grads, dtype)
    if grads[0].device.type != "cuda":
        pack_into(grads, group_size, packed)
        reduced = torch.ops._c10d_functional.reduce_scatter_tensor(packed, reduce_op, group_size, group_name)
        setattr(packed, _ISSUED, (None, reduced))
        return packed
    reduced = _reduced_like(packed, group_size)
    compute = torch.cuda.current_stream(grads[0].device)
    side = _side_stream(grads[0].device.index)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        pack_into(grads, group_size, packed)
        group = _resolve_process_group(group_name)
        dist.reduce_scatter_tensor(reduced, packed, op=_REDUCE_OPS[reduce_op], group=group)
        done = side.record_event()
    setattr(packed, _ISSUED, (done, reduced))
    return packed


@pack_and_reduce_scatter.register_fake
def _(grads, reduce_op, group_size, group_name, dtype=None) -> Tensor:
    return packed_like(grads, dtype)


@torch.library.custom_op("fsdp_compile::wait_reduce_scatter", mutates_args=())
def wait_reduce_scatter(packed: Tensor, grads: list[Tensor], group_size: int) -> Tensor:
    """The reduced shard (flat) of the ``pack_and_reduce_scatter`` that returned ``packed``,
    once it is done; ``grads`` are that call's, taken only to be kept alive until here."""
    done, reduced = getattr(packed, _ISSUED)
    delattr(packed, _ISSUED)
    if done is None:
        return torch.ops._c10d_functional.wait_tensor(reduced)
    torch.cuda.current_stream(reduced.device).wait_event(done)
    return reduced


@wait_reduce_scatter.register_fake
def _(packed, grads, group_size) -> Tensor:
    return _reduced_like(packed, group_size)
