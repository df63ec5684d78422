"""The two markers every sharded parameter use goes through.

``unshard(shard, ..., param_id)`` stands where a module reads a sharded parameter; its autograd backward is
``reduce_grad(full_grad)``. Both are real collectives when run eagerly (the uncompiled
baseline), and both are opaque single nodes to Dynamo and AOTAutograd, so the backend finds
every parameter use and every gradient in the joint graph and lowers them to functional
collectives it can schedule (see NOTE: why markers, in docs/design.md).

Shards follow ``torch.chunk`` / DTensor ``Shard(0)`` semantics: with ``rows = ceil(n / world)``
rank ``r`` holds rows ``[r * rows, min((r + 1) * rows, n))``, possibly none. Collectives need equal
pieces, so each piece is zero-padded to ``rows`` on the wire and the padding is sliced away.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["unshard", "reduce_grad", "padded_rows", "local_rows"]


# torch 2.13 names these *_single and deprecates the *_tensor spellings; older torch (the
# GPU images we benchmark on) only has the latter.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def padded_rows(global_rows: int, world: int) -> int:
    """Rows of one rank's piece on the wire (ceil division, as ``torch.chunk``)."""
    return -(-global_rows // world)


def local_rows(global_rows: int, world: int, rank: int) -> int:
    """Rows rank ``rank`` owns of a dim-0 size ``global_rows`` (``torch.chunk`` semantics)."""
    rows = padded_rows(global_rows, world)
    return max(0, min(rows, global_rows - rank * rows))


def pad_rows(tensor: Tensor, rows: int) -> Tensor:
    """``tensor`` zero-padded on dim 0 to ``rows`` rows (no copy when already that size)."""
    missing = rows - tensor.shape[0]
    if missing == 0:
        return tensor
    filler = tensor.new_zeros((missing, *tensor.shape[1:]))
    return torch.cat([tensor, filler])


@torch.library.custom_op("fsdp_compile::unshard", mutates_args=())
def unshard(
    shard: Tensor,
    global_rows: int,
    group_name: str,
    param_id: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> Tensor:
    """Cast a dim-0 shard to ``param_dtype`` and all-gather it into ``global_rows`` rows.

    The cast comes first so the wire carries ``param_dtype`` (bf16 under mixed precision);
    ``reduce_dtype`` is only for the backward, which reduces the gradient in it.
    """
    group = _resolve_process_group(group_name)
    world = group.size()
    rows = padded_rows(global_rows, world)
    piece = pad_rows(shard.to(param_dtype), rows).contiguous()
    gathered = piece.new_empty((rows * world, *shard.shape[1:]))
    _all_gather(gathered, piece, group=group)
    return gathered[:global_rows]


@unshard.register_fake
def _(shard, global_rows, group_name, param_id, param_dtype, reduce_dtype) -> Tensor:
    return shard.new_empty((global_rows, *shard.shape[1:]), dtype=param_dtype)


@torch.library.custom_op("fsdp_compile::reduce_grad", mutates_args=())
def reduce_grad(
    full_grad: Tensor,
    shard_rows: int,
    group_name: str,
    param_id: int,
    reduce_dtype: torch.dtype,
    shard_dtype: torch.dtype,
) -> Tensor:
    """Reduce-scatter a full gradient in ``reduce_dtype`` and average it over the group.

    Returns this rank's rows in ``shard_dtype`` (the stored parameter's dtype), so under mixed
    precision an fp32 reduction lands as an fp32 ``.grad`` without a detour through bf16.
    """
    group = _resolve_process_group(group_name)
    world = group.size()
    rows = padded_rows(full_grad.shape[0], world)
    grad = pad_rows(full_grad.to(reduce_dtype), rows * world).contiguous()
    shard = grad.new_empty((rows, *full_grad.shape[1:]))
    # SUM then divide: gloo has no AVG reduce op, and one code path keeps ranks bitwise alike.
    _reduce_scatter(shard, grad, group=group)
    return shard[:shard_rows].div_(world).to(shard_dtype)


@reduce_grad.register_fake
def _(full_grad, shard_rows, group_name, param_id, reduce_dtype, shard_dtype) -> Tensor:
    return full_grad.new_empty((shard_rows, *full_grad.shape[1:]), dtype=shard_dtype)


def _unshard_setup_context(ctx, inputs, output) -> None:
    shard, _global_rows, ctx.group_name, ctx.param_id, _param_dtype, ctx.reduce_dtype = inputs
    ctx.shard_rows = shard.shape[0]
    ctx.shard_dtype = shard.dtype


def _unshard_backward(ctx, grad: Tensor):
    reduced = reduce_grad(
        grad.contiguous(),
        ctx.shard_rows,
        ctx.group_name,
        ctx.param_id,
        ctx.reduce_dtype,
        ctx.shard_dtype,
    )
    return reduced, None, None, None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)
