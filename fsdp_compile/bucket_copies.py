"""A bucket's copy-out (after its all-gather) and copy-in (before its reduce-scatter), each one
op the compiler does not look into.

Why ops of our own: spelled in aten, a bucket's copies are a ``split`` and one ``clone`` +
``_unsafe_view`` per member after the gather, and a ``view`` per member and a ``cat`` before
the reduce-scatter: about forty nodes per layer in the outer graphs, which Inductor lowers,
fuses and generates code for at every layer although every layer's kernel comes out the same
(profiled, HF Llama at 32 layers on the CPU: 8.8 of Inductor's 34.8 s on the outer graphs).
As one opaque op per bucket and direction, Inductor emits one fallback call per layer; the
kernels they run are FSDP2's (``split_with_sizes_copy``, ``_chunk_cat``), one launch each.
The layout is the one NOTE: bucket layout (passes/bucket_collectives.py) describes.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._inductor.fx_passes.bucketing import _ALL_DTYPES


def member_shapes(dims: list[int], ranks: list[int]) -> list[list[int]]:
    """Split the concatenated ``dims`` into shapes of ``ranks`` dimensions each (custom op
    schemas take no list of lists)."""
    shapes, start = [], 0
    for rank in ranks:
        shapes.append(dims[start : start + rank])
        start += rank
    return shapes


def _empty_members(buffer: Tensor, dtypes: list[int], dims: list[int], ranks: list[int]) -> list[Tensor]:
    return [buffer.new_empty(shape, dtype=_ALL_DTYPES[d]) for shape, d in zip(member_shapes(dims, ranks), dtypes)]


@torch.library.custom_op("fsdp_compile::split_gathered", mutates_args=())
def split_gathered(
    buffer: Tensor, world: int, sizes: list[int], dtypes: list[int], dims: list[int], ranks: list[int]
) -> list[Tensor]:
    """Each member's full tensor, copied out of a gathered bucket.

    ``buffer`` is rank-major (``world`` rows of ``sum(sizes)`` elements of the bucket's dtype);
    member ``i`` is column block ``i`` of width ``sizes[i]``, of dtype ``_ALL_DTYPES[dtypes[i]]``
    (its bytes, when the bucket mixes dtypes and travels as uint8), and comes out contiguous in
    its shape (``ranks[i]`` dimensions of ``dims``).
    """
    members = _empty_members(buffer, dtypes, dims, ranks)
    columns = [m.view(buffer.dtype).view(world, -1) for m in members]
    torch.split_with_sizes_copy(buffer.view(world, -1), sizes, dim=1, out=columns)
    return members


@split_gathered.register_fake
def _(buffer, world, sizes, dtypes, dims, ranks) -> list[Tensor]:
    return _empty_members(buffer, dtypes, dims, ranks)


def _split_gathered_setup(ctx, inputs, output) -> None:
    buffer, ctx.world, _, _, dims, ranks = inputs
    ctx.buffer_shape = buffer.shape
    ctx.shapes = member_shapes(dims, ranks)


def _split_gathered_backward(ctx, grads: list[Tensor | None]):
    """The members' gradients laid out as the buffer was (a flat parameter's unpacking, see
    NOTE: flat parameters in fsdp_compile/flat_params.py): one ``pack_for_reduce_scatter``."""
    like = next(g for g in grads if g is not None)
    grads = [g if g is not None else like.new_zeros(shape) for g, shape in zip(grads, ctx.shapes)]
    return pack_for_reduce_scatter(grads, ctx.world).view(ctx.buffer_shape), None, None, None, None, None


@torch.library.custom_op("fsdp_compile::pack_for_reduce_scatter", mutates_args=())
def pack_for_reduce_scatter(grads: list[Tensor], world: int, dtype: torch.dtype | None = None) -> Tensor:
    """The members' full gradients laid out rank-major, flat: rank ``r``'s slot holds row block
    ``r`` of every member, in member order. Every gradient's dim 0 is a multiple of ``world``
    (padded by lowering). In ``dtype`` (the gradients' own when None): the copy casts as it
    goes, as FSDP2's copy-in into its reduce-dtype buffer does, so a gradient reduced in
    another dtype than it was computed in is written once (NOTE: gradients packed once, in
    fsdp_compile/passes/pack_in_reduce_dtype.py)."""
    packed = _packed_like(grads, dtype)
    torch._chunk_cat(grads, 0, world, out=packed.view(world, -1))
    return packed


def widens(source: torch.dtype, target: torch.dtype) -> bool:
    """Every ``source`` value is a ``target`` value (bf16 or fp16 to fp32): casting changes
    none, so a pack may cast as it copies."""
    return source.is_floating_point and target.is_floating_point and torch.promote_types(source, target) == target


def _packed_like(grads: list[Tensor], dtype: torch.dtype | None) -> Tensor:
    return grads[0].new_empty(sum(g.numel() for g in grads), dtype=dtype or grads[0].dtype)


@pack_for_reduce_scatter.register_fake
def _(grads, world, dtype=None) -> Tensor:
    return _packed_like(grads, dtype)


split_gathered.register_autograd(_split_gathered_backward, setup_context=_split_gathered_setup)
