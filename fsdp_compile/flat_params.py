"""Flat parameters: a repeated block's shards in one buffer per group, gathered as one tensor.

NOTE: flat parameters
    Megatron-FSDP keeps each unit's parameters in one contiguous buffer; we do the same for the
    parameters of every repeated block (fsdp_compile/regions.py), for two reasons:

    - Compile time. Dynamo wraps, guards and lifts every parameter a graph reads as an input of
      its own, and AOTAutograd unwraps each DTensor input and traces its marker with autograd:
      about 16 ms per parameter on the CPU proxy, nine parameters a layer (docs/design.md,
      "One body per repeated block"). A flat parameter is one input and one marker per block.
    - The step. The all-gather reads the flat shard where it lies (no copy-in); the
      reduce-scatter's result is the flat's gradient, of which each member's ``.grad`` is a view
      (no copy-out).

    Layout. Members are the block's parameters that share everything their collectives depend
    on (dtype, ``requires_grad``, mesh and placements, strategy, dtypes, reshard decision,
    unit); each gets a slot of ``ceil(rows / world)`` rows (``torch.chunk``'s split, DTensor's
    ``Shard(0)``), this rank's rows first, zero padding after, so every rank's flat has the same
    layout and the gathered flat is rank-major: ``[rank 0: p0 p1 ... | rank 1: p0 p1 ... ]``.
    Each member's full tensor is copied out of it by ``split_gathered`` (FSDP2's
    ``split_with_sizes_copy``), whose backward lays the gradients out rank-major again
    (``_chunk_cat``) for the one reduce-scatter. A replicated group (``no_shard``) has
    ``world`` 1: the flat is the members one after the other.

    The user's parameters stay what ``fully_shard`` made them: ``nn.Parameter(DTensor)`` with
    their own shape and placements, each holding a view of its slot (as FSDP2's parameters hold
    a view of their padded storage). Optimizers, ``state_dict``, DCP and ``clip_grad_norm_`` see
    them as before, and an in-place update (every optimizer's) writes the flat. The flat itself
    is no module parameter: nothing but the compiled step reads it. So it is a plain tensor,
    this rank's buffer, not a DTensor: a DTensor input costs the step's trace per layer what
    its subclass brings (Dynamo's guards on its spec and mesh, AOTAutograd's unwrapping),
    and its sharding is in its ``ShardInfo`` anyway (docs/design.md, "One body per repeated block").

    Gradients. Autograd accumulates the flat's ``.grad`` (a plain tensor); a
    post-accumulate-grad hook then hands each member its rows as a DTensor view (added to a
    ``.grad`` the member already has) and clears the flat's, so ``.grad`` behaves as
    autograd's own: ``zero_grad``, accumulation over several backwards, a member also read
    outside its block.

    NOTE: requires_grad after fully_shard
    Freezing or unfreezing parameters between steps (a backbone frozen for the first epochs,
    layers unfrozen one by one) must train what eager would. A flat requires a gradient when
    any of its members does (``follow_members``, run before each forward of the outermost unit,
    fsdp_compile/outermost_unit.py; traced inside a function of the user's, while Dynamo traces
    it, each member's flag then a guard): Dynamo guards on the flat's flag, so a block all
    frozen or unfrozen recompiles the step and a frozen block computes no weight gradient and
    reduces none. A member frozen beside trainable ones shares their flat's gradient; the
    hand-out leaves its ``.grad`` as autograd leaves a frozen leaf's, so neither the optimizer
    nor weight decay touches it.

    What would break the link is caught: ``nn.Module._apply`` (``to_empty``, ``.to``) would
    give members new storage of their own, so the region's ``_apply`` converts the flat
    instead and links the members to the result (``converted_flat``); a member
    replaced (``module.weight = ...``) or given other storage (``param.data = ...``) is found
    before the next compile or optimizer step (``check_linked``), with an error naming the fix.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch._inductor.fx_passes.bucketing import _ALL_DTYPES

from fsdp_compile.records import ShardInfo, shard_info
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.markers import padded_rows

__all__ = [
    "FlatLayout", "flat_groups", "make_flat", "converted_flat", "check_linked", "is_flat", "note_graded", "note_block_graded",
    "hold_local", "hand_out",
]


@dataclass(frozen=True)
class FlatLayout:
    """Where each member of a flat parameter lives in it: the same on every rank."""

    shapes: tuple[tuple[int, ...], ...]
    """The members' full shapes, in slot order."""
    world: int
    """Ranks a member's rows are split over; 1 for a replicated group."""

    def slot_rows(self, i: int) -> int:
        return padded_rows(self.shapes[i][0], self.world)

    def row_numel(self, i: int) -> int:
        return math.prod(self.shapes[i][1:])

    def offset(self, i: int) -> int:
        return sum(self.slot_rows(j) * self.row_numel(j) for j in range(i))

    @property
    def numel(self) -> int:
        """One rank's flat, padding included."""
        return self.offset(len(self.shapes))

    def unpack_args(self, dtype: torch.dtype) -> tuple:
        """``split_gathered``'s arguments after the gathered flat: each member comes out with
        ``world * slot_rows`` rows (padding rows last), to be trimmed to its own."""
        padded = [(self.world * self.slot_rows(i), *s[1:]) for i, s in enumerate(self.shapes)]
        return (
            self.world,
            [self.slot_rows(i) * self.row_numel(i) for i in range(len(self.shapes))],
            [_ALL_DTYPES.index(dtype)] * len(self.shapes),
            [d for shape in padded for d in shape],
            [len(shape) for shape in padded],
        )

    def trims(self) -> tuple[int | None, ...]:
        """Rows to keep of each unpacked member; None where the padding is empty."""
        return tuple(None if self.world * self.slot_rows(i) == s[0] else s[0] for i, s in enumerate(self.shapes))


@dataclass(frozen=True)
class FlatMember:
    """One member parameter of a flat: its rows on this rank are ``flat[offset:offset + numel]``."""

    param: nn.Parameter
    offset: int
    local_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


def is_flat(param: object) -> bool:
    return getattr(param, "_mfsdp_members", None) is not None


_FLAT_PLACEMENTS = ((Shard(0),), (Replicate(),), (Replicate(), Shard(0)))


def _group_key(param: nn.Parameter, info: ShardInfo) -> tuple | None:
    """What a flat's members share; None for a parameter that stays on its own: an expert's
    (its read shape is not its stored one, or its group is not the whole mesh)."""
    if (
        not isinstance(param, DTensor)
        or tuple(param.placements) not in _FLAT_PLACEMENTS
        or info.global_shape != info.dtensor_shape
        or info.ep_group_outside_mesh
        or info.float8 is not None
    ):
        return None
    return (param.dtype, param.requires_grad, param.device_mesh, tuple(param.placements), info.alike())


def flat_groups(params: list[nn.Parameter]) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
    """``params`` (distinct, in body order) split into flat groups of two or more members and
    the parameters left on their own (see NOTE: flat parameters)."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    alone = []
    for param in params:
        key = _group_key(param, shard_info(param))
        if key is None:
            alone.append(param)
        else:
            groups.setdefault(key, []).append(param)
    flats = [g for g in groups.values() if len(g) > 1]
    alone += [g[0] for g in groups.values() if len(g) == 1]
    return flats, alone


def _layout_of(members: list[nn.Parameter]) -> FlatLayout:
    sharded = any(isinstance(p, Shard) for p in members[0].placements)
    world = shard_info(members[0]).world if sharded else 1
    return FlatLayout(shapes=tuple(tuple(p.shape) for p in members), world=world)


def _link(flat_local: torch.Tensor, members: list[nn.Parameter], layout: FlatLayout, copy: bool) -> tuple[FlatMember, ...]:
    """Make each member hold a view of its slot of ``flat_local`` (with ``copy``, after copying
    its rows there); returns the members' places."""
    linked = []
    for i, param in enumerate(members):
        local = param._local_tensor
        offset = layout.offset(i)
        view = flat_local[offset : offset + local.numel()].view(local.shape)
        if copy and not local.is_meta:
            view.copy_(local)
        hold_local(param, view)
        linked.append(FlatMember(param=param, offset=offset, local_shape=tuple(local.shape)))
    return tuple(linked)


def hold_local(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make the DTensor ``param`` (the same object: optimizers may hold it) hold ``view`` as its
    local tensor.

    As FSDP2 does with its padded storage, except that the wrapper is built anew around the
    view and swapped in: a DTensor's wrapper records its local tensor's storage offset and
    dtype, and Dynamo's fake copy of a wrapper whose offset disagrees with its local tensor's
    fails (torch 2.13, meta_utils: "set the storage of a tensor on device cpu to a storage on
    device meta"). ``swap_tensors`` swaps the Python attributes too: they are kept."""
    attributes = {k: v for k, v in param.__dict__.items() if k != "_is_param"}
    dtensor = DTensor.from_local(
        view, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    torch.utils.swap_tensors(param, nn.Parameter(dtensor, requires_grad=param.requires_grad))
    param.__dict__.update(attributes)


def _new_flat(local: torch.Tensor, members: list[nn.Parameter], info: ShardInfo, layout: FlatLayout, copy: bool) -> nn.Parameter:
    """The flat parameter over ``local`` (this rank's buffer; a plain tensor, see NOTE: flat
    parameters), its members linked to it."""
    first = members[0]
    linked = _link(local, members, layout, copy)
    flat = nn.Parameter(local, requires_grad=first.requires_grad)
    flat._mfsdp = info
    flat._mfsdp_layout = layout
    flat._mfsdp_members = linked
    for member in linked:
        member.param._mfsdp_flat = flat
    flat._mfsdp_hands_out = False
    follow_members(flat)
    torch._dynamo.mark_static(flat)
    return flat


def follow_members(flat: nn.Parameter) -> None:
    """Make ``flat`` require a gradient exactly when one of its members does (see NOTE:
    requires_grad after fully_shard): run before each forward of the outermost unit, so a
    member frozen or unfrozen since is what the next step reads, and Dynamo's guard on the
    flat's flag recompiles a step traced under the other."""
    wanted = any(member.param.requires_grad for member in flat._mfsdp_members)
    if flat.requires_grad != wanted:
        flat.requires_grad_(wanted)
    if wanted and not flat._mfsdp_hands_out:
        flat.register_post_accumulate_grad_hook(_hand_out_grads)
        flat._mfsdp_hands_out = True


def make_flat(members: list[nn.Parameter], *, param_id: int, fqn: str, names: tuple[str, ...]) -> nn.Parameter:
    """A flat parameter holding ``members`` (one of ``flat_groups``' groups; ``names``, their
    paths for plans and dumps), which from now on hold views of it (see NOTE: flat
    parameters)."""
    layout = _layout_of(members)
    first = shard_info(members[0])
    rows = layout.numel * (first.world if layout.world > 1 else 1)
    info = ShardInfo(
        param_id=param_id,
        fqn=fqn,
        block=first.block,
        unit=first.unit,
        global_shape=(rows,),
        dtensor_shape=(rows,),
        strategy=first.strategy,
        group_name=first.group_name,
        world=first.world,
        replicate_group_name=first.replicate_group_name,
        replicate_world=first.replicate_world,
        grad_divisor=first.grad_divisor,
        reshard_after_forward=first.reshard_after_forward,
        param_dtype=first.param_dtype,
        reduce_dtype=first.reduce_dtype,
        mixed_precision=first.mixed_precision,
        members=names,
    )
    local = torch.zeros(layout.numel, dtype=members[0].dtype, device=members[0]._local_tensor.device)
    return _new_flat(local, members, info, layout, copy=True)


def converted_flat(flat: nn.Parameter, members: list[nn.Parameter], fn) -> nn.Parameter:
    """``flat`` after ``nn.Module._apply``'s ``fn`` (``to_empty``, ``.to``, ``.half``...),
    with ``members`` (as the module holds them) linked to it: ``fn`` converts the flat once,
    in place of each member, so no member is ever held twice (a meta model materialises at
    its shard's size)."""
    grads = [None if param.grad is None else fn(param.grad) for param in members]
    for param in members:
        param.grad = None  # a gradient must match its parameter's dtype: set again once linked
    converted = fn(flat)
    for param in members:
        param._mfsdp = param._mfsdp.stored_as(converted.dtype)
    info = flat._mfsdp.stored_as(converted.dtype)
    result = _new_flat(converted.data, members, info, flat._mfsdp_layout, copy=False)
    for param, grad in zip(members, grads):
        param.grad = grad
    return result


def note_graded(flat: nn.Parameter, flags: tuple[bool, ...], *, traced: bool) -> None:
    """Record which members of ``flat`` get a gradient (one flag per member; empty: none),
    for the hand-out (see NOTE: parameters without a gradient, in block_fakes.py): ``traced``,
    as the compiled step starting (a new step) found while tracing; otherwise as a backward
    under way found, added to what the others since the last hand-out found (a layer called
    twice, the micro-batches of an accumulation): ``_mfsdp_graded`` holds those flags and
    whether a micro-batch accumulating without gradient sync said them."""
    flags = flags or (False,) * len(flat._mfsdp_members)
    pending = getattr(flat, "_mfsdp_graded", None)
    if traced:
        flat._mfsdp_graded_compiled = flags
        # What a backward said and no hand-out took (``autograd.grad`` to the inputs, a
        # backward that raised) ends as the next step starts, not inside a backward (a
        # checkpoint's recompute); what a micro-batch's backward said waits for the hand-out.
        if pending is not None and not pending[1] and torch._C._current_graph_task_id() == -1:
            flat._mfsdp_graded = None
    else:
        accumulated = "accumulator" in shard_info(flat).accumulation
        flat._mfsdp_graded = (
            (flags, accumulated) if pending is None else (tuple(map(operator.or_, pending[0], flags)), pending[1] or accumulated)
        )


def note_block_graded(block: nn.Module, graded: list[tuple[bool, ...]], *, traced: bool) -> None:
    """``note_graded`` for each flat of a repeated block, as a compiled call's fake run found:
    ``graded`` has a tuple per gathered weight, flats first."""
    for flat, flags in zip(block._mfsdp_region_flats.values(), graded):
        note_graded(flat, flags, traced=traced)


def forget_graded(flat: nn.Parameter) -> None:
    """Drop what backwards said of ``flat`` since its last hand-out: the micro-batches they ran
    for are given up (``reset_iter_state``)."""
    flat._mfsdp_graded = None


def _hand_out_grads(flat: nn.Parameter) -> None:
    """The flat's accumulated gradient, handed to its members as views (see NOTE: flat
    parameters); a member the backward gave no gradient gets none, as autograd would."""
    if flat.grad is None:  # a micro-batch without gradient sync: the accumulator took it
        return
    grad, flat.grad = flat.grad, None
    # A member frozen beside trainable ones shares their flat's gradient, not autograd's
    # answer: it keeps its .grad as a frozen leaf does.
    for param in hand_out(flat, grad, tuple(member.param.requires_grad for member in flat._mfsdp_members)):
        # Autograd ran the flat's hooks, not its members': run theirs, as autograd would
        # have (and FSDP2 does after its reduce-scatter): an optimizer stepped in backward.
        for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(param)


def hand_out(flat: nn.Parameter, grad: torch.Tensor, receiving: tuple[bool, ...]) -> list[nn.Parameter]:
    """Add ``grad``, this rank's rows of ``flat``'s reduced gradient, to the ``.grad`` of each
    member ``receiving`` names that the backwards since the last hand-out gave one; returns
    those members."""
    # An eager backward says for itself; a compiled one as it was traced.
    pending = getattr(flat, "_mfsdp_graded", None)
    graded = pending[0] if pending is not None else getattr(flat, "_mfsdp_graded_compiled", None)
    flat._mfsdp_graded = None
    graded = graded or (True,) * len(flat._mfsdp_members)
    given = []
    with torch.no_grad():
        for member, has_grad, receives in zip(flat._mfsdp_members, graded, receiving):
            if not has_grad or not receives:
                continue
            param = member.param
            # The cheap constructor: the member's own spec (mesh, placements, global shape).
            piece = DTensor(grad[member.offset : member.offset + member.numel].view(member.local_shape), param._spec, requires_grad=False)
            if param.grad is None:
                param.grad = piece
            else:
                param.grad.add_(piece)
            given.append(param)
    return given


def check_linked(flat: nn.Parameter) -> None:
    """Raise a ``UsageError`` unless every member of ``flat`` still holds a view of its slot
    (the compiling kind: the region checks while Dynamo traces its wrapper)."""
    storage = flat.untyped_storage().data_ptr()
    for name, member in zip(flat._mfsdp.members, flat._mfsdp_members):
        local = member.param._local_tensor
        if local.is_meta or local.numel() == 0:
            continue
        if local.untyped_storage().data_ptr() != storage or local.storage_offset() != member.offset:
            raise CompileUsageError(
                f"parameter {name} no longer holds its shard in its block's flat buffer (was it "
                "swapped with torch.utils.swap_tensors?), so training would not see it. Write "
                "new values in place instead: param.to_local().copy_(values)."
            )
