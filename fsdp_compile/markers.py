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
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = [
    "unshard",
    "reduce_grad",
    "padded_rows",
    "local_rows",
    "gathered",
    "reduced",
    "Emit",
    "RUN",
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


aten = torch.ops.aten
_functional = torch.ops._c10d_functional


class Emit(Protocol):
    """Where the marker arithmetic's ops go: run now (``RUN``, the eager markers) or
    inserted as graph nodes (``passes/lower_collectives.py``)."""

    def __call__(self, op: torch._ops.OpOverload, *args: Any) -> Any: ...

    def val(self, value: Any) -> Tensor:
        """The tensor (or its fake value) ``value`` stands for: its shape and dtype."""


class _Run:
    def __call__(self, op: torch._ops.OpOverload, *args: Any) -> Tensor:
        return op(*args)

    def val(self, value: Tensor) -> Tensor:
        return value


RUN: Emit = _Run()
"""Runs each op as it comes: the eager markers."""


def _cast(emit: Emit, value: Any, dtype: torch.dtype) -> Any:
    if emit.val(value).dtype == dtype:
        return value
    return emit(torch.ops.prims.convert_element_type.default, value, dtype)


def pad_rows(emit: Emit, value: Any, rows: int) -> Any:
    """``value`` zero-padded on dim 0 to ``rows`` rows (nothing when it has them)."""
    shape = emit.val(value).shape
    missing = rows - shape[0]
    if missing == 0:
        return value
    # constant_pad_nd lists (before, after) pairs from the last dim back to dim 0.
    return emit(aten.constant_pad_nd.default, value, [0, 0] * (len(shape) - 1) + [0, missing])


def first_rows(emit: Emit, value: Any, rows: int) -> Any:
    if emit.val(value).shape[0] == rows:
        return value
    return emit(aten.slice.Tensor, value, 0, 0, rows)


def gathered(
    emit: Emit, shard: Any, *, param_dtype: torch.dtype, gathers: bool, world: int, global_rows: int, group_name: str
) -> Any:
    """What ``unshard`` computes, once for both of its forms (NOTE: one marker arithmetic):
    the shard cast to ``param_dtype`` (first, so the wire carries it), and for a gathering
    strategy padded to equal pieces, all-gathered over ``group_name`` and trimmed to
    ``global_rows``."""
    local = _cast(emit, shard, param_dtype)
    if not gathers:
        return local
    padded = pad_rows(emit, local, padded_rows(global_rows, world))
    whole = emit(_functional.wait_tensor.default, emit(_functional.all_gather_into_tensor.default, padded, world, group_name))
    return first_rows(emit, whole, global_rows)


def reduced(
    emit: Emit,
    grad: Any,
    pending: Any | None,
    *,
    strategy: str,
    reduce_dtype: torch.dtype,
    shard_dtype: torch.dtype,
    op: GradReduceOp,
    world: int,
    rank: int,
    shard_rows: int,
    grad_divisor: int,
    group_name: str,
    replicate_group_name: str,
) -> Any:
    """What ``reduce_grad`` computes, once for both of its forms (NOTE: one marker
    arithmetic): ``grad`` (+ ``pending``) in ``reduce_dtype``, reduce-scattered (ZeRO-2/3) or
    all-reduced (``optim``, ``no_shard``) over ``group_name``, then all-reduced over the
    replicas (HSDP), averaged over ``grad_divisor`` ranks (by the collectives with ``op``
    "avg", else by a division: NOTE: averaging in the collective), this rank's
    ``shard_rows`` rows in ``shard_dtype``.

    NOTE: one marker arithmetic
        The markers run eagerly (the uncompiled model, the baseline every test compares
        with) and are lowered into the compiled graphs. Both forms are these two functions:
        eagerly they run their ops (``RUN``), the lowering passes an ``Emit`` that inserts
        each op as a node, with the plan's facts where the eager marker asks the process
        groups. So compiled and eager compute the same ops in the same order by
        construction, and the chains the passes match (fsdp_compile/patterns.py) are the
        ones drawn there.
    """
    if pending is not None:  # the micro-batches accumulated without sync
        grad = emit(aten.add.Tensor, _cast(emit, grad, reduce_dtype), pending)
    rows = padded_rows(emit.val(grad).shape[0], world)
    if strategy in SCATTERING_STRATEGIES:
        # Cast last, as the collective's input: in the compiled step a pack
        # (pack_in_reduce_dtype) or a bucket's copy-in takes the cast over.
        padded = _cast(emit, pad_rows(emit, grad, rows * world), reduce_dtype)
        collective = emit(_functional.reduce_scatter_tensor.default, padded, op, world, group_name)
    else:
        collective = emit(_functional.all_reduce.default, _cast(emit, grad, reduce_dtype), op, group_name)
    whole = emit(_functional.wait_tensor.default, collective)
    if replicate_group_name:
        across = emit(_functional.all_reduce.default, whole, op, replicate_group_name)
        whole = emit(_functional.wait_tensor.default, across)

    def averaged(value: Any) -> Any:
        return value if op == "avg" else emit(aten.div.Tensor, value, grad_divisor)

    if strategy == "optim":
        # Average the whole gradient, then view this rank's rows: every rank keeps the
        # whole averaged gradient (ZeRO-1 shards only the optimizer state).
        mine = emit(aten.slice.Tensor, averaged(whole), 0, rows * rank, rows * rank + shard_rows)
    else:
        mine = averaged(first_rows(emit, whole, shard_rows))
    return _cast(emit, mine, shard_dtype)


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
    world = _resolve_process_group(group_name).size()
    gathers = strategy in GATHERING_STRATEGIES
    full = gathered(
        RUN, shard, param_dtype=param_dtype, gathers=gathers, world=world, global_rows=global_rows, group_name=group_name
    )
    # A custom op returns no alias of its input: no_shard in the stored dtype copies.
    return full.clone() if full is shard else full


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
    return reduced(
        RUN,
        full_grad.contiguous(),  # torch's functional collectives take contiguous inputs
        pending,
        strategy=strategy,
        reduce_dtype=reduce_dtype,
        shard_dtype=shard_dtype,
        op=gradient_reduce_op(group_name, replicate_group_name, grad_divisor, reduce_dtype),
        world=group.size(),
        rank=group.rank(),
        shard_rows=shard_rows,
        grad_divisor=grad_divisor,
        group_name=group_name,
        replicate_group_name=replicate_group_name,
    )


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
    # Held on ctx, not saved: a non-reentrant checkpoint counts the tensors a forward saves
    # and its recompute saves again, and the recompute's read finds the sum taken by the
    # forward's (``unshard_marker``). The backward that runs is the forward's, which holds it.
    ctx.pending = pending
    # A gathered weight the step's backward gives no gradient (read only under no_grad in a
    # block's body: NOTE: parameters without a gradient) reaches the backward as None, not
    # as zeros: its parameter's .grad stays None, and no reduction of zeros runs (the
    # partitioner moved such a zeros-only chain into the forward on some ranks and left it in
    # the backward's bucket on others: mismatched collectives).
    ctx.set_materialize_grads(False)


def _unshard_backward(ctx, grad: Tensor | None):
    if grad is None:
        return (None,) * 11
    if ctx.accumulates:
        # A micro-batch without gradient sync: no collective; autograd sums the full
        # gradient into accumulator.grad, in reduce_dtype so bf16 compute accumulates in fp32.
        return None, grad.to(ctx.reduce_dtype), *[None] * 9
    # Taken once: a second backward through a retained graph adds its gradient again, as the
    # unsharded model's does, but not the micro-batches' sum.
    pending, ctx.pending = ctx.pending, None
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
