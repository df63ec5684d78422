"""The two markers every sharded parameter use goes through.

``unshard(shard, ...)`` stands where a module reads a sharded parameter; its autograd backward is
``reduce_grad(full_grad, ...)``. Both are real collectives when run eagerly (the uncompiled
baseline), and both are opaque single nodes to Dynamo and AOTAutograd, so the backend finds
every parameter use and every gradient in the joint graph and lowers them to functional
collectives it can schedule (see NOTE: why markers, in docs/design.md).

Shards follow ``torch.chunk`` / DTensor ``Shard(0)`` semantics: with ``rows = ceil(n / world)``
rank ``r`` holds rows ``[r * rows, min((r + 1) * rows, n))``, possibly none. Collectives need equal
pieces, so each piece is zero-padded to ``rows`` on the wire and the padding is sliced away.

What each strategy does (``Strategy``; docs/user_guide.md has the table):

- ``optim_grads_params`` / ``optim_grads``: all-gather forward; reduce-scatter the gradient.
- ``optim``: all-gather forward; all-reduce the gradient; ``.grad`` is this rank's rows, a view
  of the whole averaged gradient every rank keeps.
- ``no_shard``: the local tensor is the whole parameter; all-reduce the gradient.

With a replicate group (HSDP) the reduced gradient is then all-reduced across replicas. The
gradient is averaged over ``grad_divisor`` ranks: the whole mesh for data-parallel parameters,
the whole data-parallel world for expert-parallel ones (their gradient already sums the tokens
of the EP group; see NOTE: expert gradient scale, in fsdp_compile/expert_parallel.py). How:
``gradient_reduce_op`` (NOTE: averaging in the collective).
Gradient accumulation: given an ``accumulator`` the backward reduces nothing and hands the full
gradient to the accumulator (autograd sums it into ``accumulator.grad``); given ``pending``
(the sum of earlier micro-batches) the backward adds it before the one reduction.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = [
    "unshard",
    "reduce_grad",
    "padded_rows",
    "local_rows",
    "gradient_reduce_op",
    "GradReduceOp",
    "Strategy",
    "STRATEGIES",
    "GATHERING_STRATEGIES",
    "SCATTERING_STRATEGIES",
]

Strategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]
STRATEGIES: tuple[str, ...] = ("no_shard", "optim", "optim_grads", "optim_grads_params")
GATHERING_STRATEGIES = frozenset(STRATEGIES) - {"no_shard"}
"""Strategies whose parameters are stored sharded and gathered for use."""
SCATTERING_STRATEGIES = frozenset({"optim_grads", "optim_grads_params"})
"""Strategies whose gradients are reduce-scattered (the others all-reduce)."""

GradReduceOp = Literal["sum", "avg"]
AVERAGING_BACKENDS = frozenset({"nccl", "fake"})
"""Process-group backends whose collectives average (``ReduceOp.AVG``): NCCL, and the fake
group that one-GPU benchmarks stand in for it with. gloo has no AVG."""

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


def gradient_reduce_op(
    group_name: str, replicate_group_name: str, grad_divisor: int, reduce_dtype: torch.dtype
) -> GradReduceOp:
    """How a gradient's collectives reduce: "avg", or "sum" and then a division by
    ``grad_divisor`` (NOTE: averaging in the collective).

    NOTE: averaging in the collective
        A gradient is averaged over ``grad_divisor`` ranks. Summed in the collective and then
        divided, that is one more kernel over the reduced gradient; NCCL averages in the
        collective itself (``ReduceOp.AVG``), as FSDP2 has it do. So the reduction averages
        where every group it runs over (the shard group, the replicate group under HSDP) is
        one whose backend averages (``AVERAGING_BACKENDS``) and has more than one rank (NCCL's
        AVG on one rank is unreliable, FSDP2 says), where their sizes multiply to
        ``grad_divisor`` (not for expert-parallel parameters, averaged over more ranks than
        their groups hold), and where ``reduce_dtype`` is fp32 or bf16 (FSDP2's rule: no
        overflow risk). Elsewhere (gloo, which has no AVG) it sums and divides. The eager
        marker asks here at every call, the compiled lowering reads the answer from the plan
        (``ParamPlan.reduce_op``, which the planner asks here): compiled and eager reduce alike
        on every backend.
    """
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        return "sum"
    groups = [_resolve_process_group(name) for name in (group_name, replicate_group_name) if name]
    sizes = [group.size() for group in groups]
    averages = all(dist.get_backend(group) in AVERAGING_BACKENDS for group in groups)
    if averages and min(sizes) > 1 and math.prod(sizes) == grad_divisor:
        return "avg"
    return "sum"


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
    accumulator: Tensor | None,
    pending: Tensor | None,
    param_id: int,
    global_rows: int,
    group_name: str,
    replicate_group_name: str,
    strategy: str,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    grad_divisor: int,
) -> Tensor:
    """Cast the local tensor to ``param_dtype`` and, for sharded strategies, all-gather it
    into ``global_rows`` rows over ``group_name``.

    The cast comes first so the wire carries ``param_dtype`` (bf16 under mixed precision). The
    remaining arguments are for the backward (see the module docstring).
    """
    local = shard.to(param_dtype)
    if strategy not in GATHERING_STRATEGIES:
        return local.clone() if local is shard else local
    group = _resolve_process_group(group_name)
    world = group.size()
    rows = padded_rows(global_rows, world)
    piece = pad_rows(local, rows).contiguous()
    gathered = piece.new_empty((rows * world, *shard.shape[1:]))
    _all_gather(gathered, piece, group=group)
    return gathered[:global_rows]


@unshard.register_fake
def _(shard, accumulator, pending, param_id, global_rows, group_name, replicate_group_name,
      strategy, param_dtype, reduce_dtype, grad_divisor) -> Tensor:
    return shard.new_empty((global_rows, *shard.shape[1:]), dtype=param_dtype)


@torch.library.custom_op("fsdp_compile::reduce_grad", mutates_args=())
def reduce_grad(
    full_grad: Tensor,
    pending: Tensor | None,
    param_id: int,
    shard_rows: int,
    group_name: str,
    replicate_group_name: str,
    strategy: str,
    reduce_dtype: torch.dtype,
    shard_dtype: torch.dtype,
    grad_divisor: int,
) -> Tensor:
    """Average ``full_grad`` (+ ``pending``) over ``grad_divisor`` ranks in ``reduce_dtype``
    and return this rank's ``shard_rows`` rows in ``shard_dtype``.

    ``shard_dtype`` is the stored parameter's dtype, so under mixed precision an fp32 reduction
    lands as an fp32 ``.grad`` without a detour through bf16. The collectives average, or sum
    and a division follows, as ``gradient_reduce_op`` says for these groups (NOTE: averaging
    in the collective).
    """
    group = _resolve_process_group(group_name)
    world = group.size()
    averages = gradient_reduce_op(group_name, replicate_group_name, grad_divisor, reduce_dtype) == "avg"
    op = dist.ReduceOp.AVG if averages else dist.ReduceOp.SUM
    grad = full_grad.to(reduce_dtype)
    if pending is not None:
        grad = grad + pending
    if strategy in SCATTERING_STRATEGIES:
        rows = padded_rows(full_grad.shape[0], world)
        padded = pad_rows(grad, rows * world).contiguous()
        reduced = padded.new_empty((rows, *full_grad.shape[1:]))
        _reduce_scatter(reduced, padded, op=op, group=group)
        first = 0
    else:
        reduced = grad.contiguous().clone() if grad is full_grad else grad.contiguous()
        dist.all_reduce(reduced, op=op, group=group)
        first = padded_rows(full_grad.shape[0], world) * group.rank() if strategy == "optim" else 0
    if replicate_group_name:
        dist.all_reduce(reduced, op=op, group=_resolve_process_group(replicate_group_name))
    if not averages:
        # Divide before taking the rows: for ``optim`` the rows stay a view of the whole
        # averaged gradient, which every rank keeps (ZeRO-1 shards only the optimizer state).
        reduced.div_(grad_divisor)
    return reduced[first : first + shard_rows].to(shard_dtype)


@reduce_grad.register_fake
def _(full_grad, pending, param_id, shard_rows, group_name, replicate_group_name, strategy,
      reduce_dtype, shard_dtype, grad_divisor) -> Tensor:
    return full_grad.new_empty((shard_rows, *full_grad.shape[1:]), dtype=shard_dtype)


def _unshard_setup_context(ctx, inputs, output) -> None:
    (shard, accumulator, pending, ctx.param_id, _rows, ctx.group_name, ctx.replicate_group_name,
     ctx.strategy, _param_dtype, ctx.reduce_dtype, ctx.grad_divisor) = inputs
    ctx.shard_rows = shard.shape[0]
    ctx.shard_dtype = shard.dtype
    ctx.accumulates = accumulator is not None
    ctx.save_for_backward(pending)


def _unshard_backward(ctx, grad: Tensor):
    if ctx.accumulates:
        # A micro-batch without gradient sync: no collective; autograd sums the full
        # gradient into accumulator.grad, in reduce_dtype so bf16 compute accumulates in fp32.
        return None, grad.to(ctx.reduce_dtype), *[None] * 9
    (pending,) = ctx.saved_tensors
    reduced = reduce_grad(
        grad.contiguous(),
        pending,
        ctx.param_id,
        ctx.shard_rows,
        ctx.group_name,
        ctx.replicate_group_name,
        ctx.strategy,
        ctx.reduce_dtype,
        ctx.shard_dtype,
        ctx.grad_divisor,
    )
    return reduced, *[None] * 10


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)
