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
def unshard(shard: Tensor, global_rows: int, group_name: str, param_id: int) -> Tensor:
    """All-gather a dim-0 shard into the full parameter of ``global_rows`` rows."""
    group = _resolve_process_group(group_name)
    world = group.size()
    rows = padded_rows(global_rows, world)
    gathered = shard.new_empty((rows * world, *shard.shape[1:]))
    dist.all_gather_single(gathered, pad_rows(shard, rows).contiguous(), group=group)
    return gathered[:global_rows]


@unshard.register_fake
def _(shard: Tensor, global_rows: int, group_name: str, param_id: int) -> Tensor:
    return shard.new_empty((global_rows, *shard.shape[1:]))


@torch.library.custom_op("fsdp_compile::reduce_grad", mutates_args=())
def reduce_grad(full_grad: Tensor, shard_rows: int, group_name: str, param_id: int) -> Tensor:
    """Reduce-scatter a full gradient and average it over the group: this rank's shard."""
    group = _resolve_process_group(group_name)
    world = group.size()
    rows = padded_rows(full_grad.shape[0], world)
    shard = full_grad.new_empty((rows, *full_grad.shape[1:]))
    # SUM then divide: gloo has no AVG reduce op, and one code path keeps ranks bitwise alike.
    dist.reduce_scatter_single(shard, pad_rows(full_grad, rows * world).contiguous(), group=group)
    return shard[:shard_rows].div_(world)


@reduce_grad.register_fake
def _(full_grad: Tensor, shard_rows: int, group_name: str, param_id: int) -> Tensor:
    return full_grad.new_empty((shard_rows, *full_grad.shape[1:]))


def _unshard_setup_context(ctx, inputs, output) -> None:
    shard, _global_rows, group_name, param_id = inputs
    ctx.shard_rows = shard.shape[0]
    ctx.group_name = group_name
    ctx.param_id = param_id


def _unshard_backward(ctx, grad: Tensor):
    reduced = reduce_grad(grad.contiguous(), ctx.shard_rows, ctx.group_name, ctx.param_id)
    return reduced, None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)
