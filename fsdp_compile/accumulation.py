"""Gradient accumulation without sync: the state the ``unshard`` marker takes, turned off and
on by ``set_requires_gradient_sync``, and the sums no read takes reduced into ``.grad``.

With sync off, each parameter's read hands its marker an accumulator: a full-shape leaf whose
``.grad`` autograd sums the unreduced gradients into, in ``reduce_dtype`` (ShardInfo's
``accumulation`` dict holds it). Sync on again turns that sum into ``pending``, which the next
read with gradients takes and its backward adds before the one reduction. A flat parameter
accumulates for its members (NOTE: flat parameters, in flat_params.py). A read traced for
another backend (NOTE: a block compiled by another backend, in gathered_reads.py) sums into an
accumulator of its own (``anonymous``): sync on again reduces the parameter's sums at once,
so such a read finds no ``pending`` sum unless other reads made it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compile.errors import UsageError
from fsdp_compile.flat_params import forget_graded, hand_out
from fsdp_compile.records import ShardInfo, built_class_name, gathered_params, is_outermost_unit, shard_info

__all__ = [
    "marker_args", "read_state", "unshard_marker", "set_requires_gradient_sync", "reduce_untaken_sums",
    "reduce_orphaned_sums", "settle_changed_sums", "sum_outdated", "ACCUMULATION_METHODS",
]


def marker_args(info: ShardInfo, stored_dtype: torch.dtype, *, param_id: int | None = None) -> tuple:
    """The ``unshard`` marker's constant arguments for a parameter (its ``ShardInfo``, its
    storage dtype), after the shard and the accumulation state; ``param_id`` in place of the
    record's."""
    return (
        info.param_id if param_id is None else param_id,
        info.global_shape[0],
        info.group_name,
        info.replicate_group_name,
        info.strategy,
        # A float8 weight is cast from its stored dtype, as torchao casts the master.
        info.param_dtype if info.float8 is None else stored_dtype,
        info.reduce_dtype,
        info.grad_divisor,
    )


def read_state(param: nn.Parameter, info: ShardInfo) -> dict:
    """The accumulation state a read of ``param`` hands its marker: none for a frozen weight,
    whose read neither sums nor takes a sum. Its sum so far goes to ``.grad`` when
    ``settle_changed_sums`` runs: before the next forward, or, where Dynamo traced that
    forward's hook (the user compiled the model's call), at the next
    ``set_requires_gradient_sync``; failing that, at ``fsdp_compile.clip_grad_norm_`` or the
    optimizer's step (``reduce_orphaned_sums``)."""
    return info.accumulation if param.requires_grad else {}


def unshard_marker(local: torch.Tensor, constants: tuple, accumulation: dict, *, anonymous: bool = False) -> torch.Tensor:
    """The ``unshard`` marker on a parameter's local shard: a real collective when run eagerly,
    one graph node when traced. ``constants``: ``marker_args(info, param.dtype)``;
    ``accumulation``: the record's accumulation state (``ShardInfo.accumulation``), which
    Dynamo guards on, so a step recompiles when sync is turned off or on.

    The sum the micro-batches accumulated without sync (``pending``) goes to the first read
    after sync is turned on that can make a gradient: a read under ``torch.no_grad()`` or
    ``inference_mode`` (an evaluation before the last micro-batch) leaves it, as FSDP2, which
    adds the sum in backward, keeps it. An ``anonymous`` read (traced for another backend)
    sums into the ``anonymous`` accumulator; it finds a sum only where reads of another kind
    made it (sync on reduces its own sums at once: a non-reentrant checkpoint recomputing its
    frame would find the sum its forward took gone, and trace a graph that saves other
    tensors)."""
    # Read the state's entries only when there are some: each read is a guard, and a pop a
    # side effect Dynamo records, for every parameter of every layer.
    # The op itself, not the custom_op object, whose Python __call__ Dynamo would trace for
    # every parameter of every layer (3% of Dynamo's time on a 32-layer HF Llama, profiled).
    take = accumulation and torch.is_grad_enabled()
    return torch.ops.fsdp_compile.unshard.default(
        local,
        accumulation.get("anonymous" if anonymous else "accumulator") if accumulation else None,
        _take_pending(accumulation) if take else None,
        *constants,
    )


def _take_pending(accumulation: dict) -> torch.Tensor | None:
    """The accumulated sum, taken from the state once. Under ``torch.utils.checkpoint``
    Dynamo refuses a side effect, which an eager recompute would replay, and then compiles
    no part of the step: here the forward's read takes the sum and its backward adds it, and
    the recompute (in the graph, or eager, the sum held by the forward's ``ctx``) takes
    nothing."""
    return torch._dynamo.utils._disable_side_effect_safety_checks_for_current_subtracer(
        accumulation.pop, "pending", None
    )


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction off for the micro-batches before the last, and back on for it.

    With sync off, backward runs no collective: each parameter's full, unreduced gradient is
    summed locally (in ``reduce_dtype``; this costs one full-size gradient per parameter, as in
    FSDP2). Turning sync on again makes the next forward/backward reduce that sum together with
    its own gradient, once (a forward under ``no_grad`` leaves the sum: ``unshard_marker``;
    one whose reads leave some reduces them as it returns: ``reduce_untaken_sums``). Applies
    to every sharded parameter under ``module``; also a method of modules ``fully_shard``
    returned (``model.set_requires_gradient_sync(False)``). A weight frozen or unfrozen since
    the last forward has its sum settled first (``settle_changed_sums``).
    """
    if not isinstance(requires_gradient_sync, bool):
        raise UsageError(
            f"set_requires_gradient_sync takes True or False, got {requires_gradient_sync!r}."
        )
    # A weight frozen or unfrozen since the last forward, whose hook did not settle it if the
    # user compiled the model's call: settled now, before the round's state changes.
    settle_changed_sums(module)
    # Where settle_changed_sums and reset_iter_state look.
    round_ = _round(module, opening=not requires_gradient_sync)
    if requires_gradient_sync and round_ is not None:
        round_["open"] = False
    for param in _accumulating(module):
        info = shard_info(param)
        if info is None:
            continue
        state = info.accumulation  # a tied parameter read through two modules has one
        if not requires_gradient_sync:
            # A flat's own flag follows its members at the next forward (NOTE: requires_grad
            # after fully_shard, in flat_params.py): ask them.
            members = getattr(param, "_mfsdp_members", ())
            trainable = any(_trainable(members)) if members else param.requires_grad
            if trainable and "accumulator" not in state:
                pending, summed_for = state.pop("pending", None), getattr(param, "_mfsdp_summed_for", None)
                _start_sum(param, info)
                # Sync turned on and off again with no forward between (a no_sync context
                # around each micro-batch): the sum so far goes on summing, not to a read
                # whose backward, accumulating, would drop it; still for the members it was
                # summed for, so a freeze since is settled by the next forward.
                state["accumulator"].grad = pending
                if pending is not None and summed_for is not None:
                    param._mfsdp_summed_for = summed_for
            continue
        # Whatever the flag says now: an accumulator left behind would take the next gradient.
        anonymous = state.get("anonymous")
        total = _sum_so_far(state)
        if total is None:
            continue
        if hasattr(param, "_mfsdp_flat") or (anonymous is not None and anonymous.grad is not None):
            # Read traced for another backend (``unshard_marker``): a flat's member (read on
            # its own only there) or any weight that was, reduced now, so a checkpoint's
            # recompute of the frame finds no sum, as its forward found none.
            _reduce_sum(param, info, total, (True,), round_)
            continue
        state["pending"] = total
        # Where the forward's hook looks before finding a sum no read took.
        module.__dict__["_mfsdp_sums_pending"] = True


def reduce_untaken_sums(module: nn.Module) -> None:
    """After a forward with gradients: each sum the micro-batches accumulated without sync
    that no read took (a weight the last micro-batch read only under ``no_grad``, or not at
    all) reduced into its ``.grad``, where the unsharded model holds the earlier
    micro-batches' gradients. Left, the next step's first read would add it to a gradient of
    its own. The weight is gathered once more and differentiated with a zero gradient: its
    backward adds the sum and reduces it, and a flat hands its members their rows, as in a
    step (a weight frozen before this forward had its sum reduced as it began:
    ``settle_changed_sums``; one frozen during it drops it). Every rank runs the same
    reads, so the same collectives. Looked for only where ``set_requires_gradient_sync``
    made sums (called on the model, as FSDP2's users call it)."""
    round_ = _round(module)
    if round_ is not None and not round_["open"]:
        round_["done"] = True  # its last micro-batch's forward ran: the next forward ends it
    if not module.__dict__.pop("_mfsdp_sums_pending", False):
        return
    for param in _accumulating(module):
        info = shard_info(param)
        if info is None or "pending" not in info.accumulation:
            continue
        if not param.requires_grad:
            del info.accumulation["pending"]
            continue
        _reduce_pending(param, info, round_)


@torch._dynamo.disable
def reduce_orphaned_sums(params) -> None:
    """Before an optimizer steps ``params``: each sum accumulated without sync still pending
    for one of them (or for its flat) reduced into ``.grad`` now, as ``reduce_untaken_sums``
    does. The forward's end reduces what its reads left unless Dynamo traced the model's
    hooks (the last micro-batch run inside a function the user compiled), and a block's
    weights read there one by one leave their flat's sum: the step would miss those
    micro-batches, and the next accumulation would add them to its own. A weight frozen
    since sync turned on (its read took nothing, its hook ran traced) keeps the sum in
    ``.grad``, as the unsharded model keeps the gradients from before a freeze. Every rank
    steps the same parameters, so runs the same collectives. Run, not traced, by Dynamo
    (a step compiled whole calls it from the optimizer's hook): it is side effects only."""
    holders = dict.fromkeys(getattr(p, "_mfsdp_flat", p) for p in params)
    for holder in holders:
        info = shard_info(holder)
        if info is None or "pending" not in info.accumulation:
            continue
        if holder.requires_grad:
            with torch.enable_grad():
                _reduce_pending(holder, info, None)
        else:
            summed_for = getattr(holder, "_mfsdp_summed_for", (True,))
            _reduce_sum(holder, info, info.accumulation.pop("pending"), summed_for, None)


def _reduce_pending(param: nn.Parameter, info: ShardInfo, round_: dict | None) -> None:
    """``param``'s pending sum reduced into ``.grad``: gathered once more and differentiated
    with a zero gradient, whose backward adds the sum and reduces it (a flat hands its
    members their rows)."""
    members = getattr(param, "_mfsdp_members", None)
    for target in [m.param for m in members if m.param.requires_grad] if members else [param]:
        _keep_grad_before(target, round_)  # for reset_iter_state, as _reduce_sum keeps it
    local = param.to_local() if isinstance(param, DTensor) else param  # a flat is its local rows
    gathered = unshard_marker(local, marker_args(info, param.dtype), info.accumulation)
    torch.autograd.backward(gathered, torch.zeros_like(gathered))


def settle_changed_sums(module: nn.Module) -> None:
    """Before a forward (run eagerly: outermost_unit.py) and at each
    ``set_requires_gradient_sync`` (eager where that hook runs traced): each sum the
    micro-batches accumulated without sync for a weight frozen or unfrozen since
    (``requires_grad_``) reduced into the ``.grad`` of the weights it was summed for, as the
    unsharded model keeps the gradients each weight had before its freeze, and gives one
    unfrozen since only the later ones. A flat sums for its members together, so when one
    changes the sum so far is reduced now (one collective, on every rank, which change the same
    weights) and a new sum starts for those trainable now. Not traced by Dynamo (a traced
    forward's hook calls it with a graph break where a flat's members changed), nor under
    ``inference_mode`` (the next forward settles then). Looked for during
    an accumulation round begun by ``set_requires_gradient_sync(False)`` on ``module`` (on the
    model, as FSDP2's users call it, or on units inside it: each unit's round is settled for
    its own weights); the forward after the round's last ends it."""
    if torch.is_inference_mode_enabled():
        return
    for unit in _units(module):
        round_ = _round(unit)
        if round_ is not None:
            _settle_round(unit, round_)


def _settle_round(module: nn.Module, round_: dict) -> None:
    """``settle_changed_sums`` for the weights under ``module``, in its accumulation round."""
    if round_["done"]:  # nothing is summed any more, and reset_iter_state has nothing to drop
        del module.__dict__["_mfsdp_round"]
        for param in _accumulating(module):
            param.__dict__.pop("_mfsdp_grad_before", None)
        return
    for param in _accumulating(module):
        info = shard_info(param)
        if info is None or not info.accumulation:
            continue
        members = getattr(param, "_mfsdp_members", None)
        now = _trainable(members) if members else (param.requires_grad,)
        if not (sum_outdated(param, now) if members else not param.requires_grad):
            continue
        summed_for = param._mfsdp_summed_for if members else (True,)
        state = info.accumulation
        summing = "accumulator" in state
        total = _sum_so_far(state)
        if total is not None:
            _reduce_sum(param, info, total, summed_for, round_)
        if summing and any(now):
            _start_sum(param, info)


def sum_outdated(flat: nn.Parameter, trainable: tuple[bool, ...]) -> bool:
    """Whether ``flat`` sums without sync for other members than those ``trainable`` now (one
    frozen or unfrozen since its sum began), which ``settle_changed_sums`` settles. Also read
    by Dynamo in a traced forward's hook, where each read is a guard."""
    return bool(shard_info(flat).accumulation) and getattr(flat, "_mfsdp_summed_for", trainable) != trainable


def _sum_so_far(state: dict) -> torch.Tensor | None:
    """What a parameter's accumulation ``state`` summed without sync (its accumulators'
    gradients and the ``pending`` sum), removed from it; None if nothing was summed."""
    accumulators = (state.pop("accumulator", None), state.pop("anonymous", None))
    summed = [a.grad for a in accumulators if a is not None and a.grad is not None]
    if (pending := state.pop("pending", None)) is not None:
        summed.append(pending)
    return sum(summed[1:], summed[0]) if summed else None


def _reduce_sum(
    param: nn.Parameter, info: ShardInfo, total: torch.Tensor, receiving: tuple[bool, ...], round_: dict | None
) -> None:
    """``total``, a sum accumulated without sync, reduced now (a collective) and added to the
    ``.grad`` of ``param``, or of a flat's members ``receiving`` names; each keeps what its
    ``.grad`` was before the accumulation ``round_`` first added to it, for ``reset_iter_state``."""
    members = getattr(param, "_mfsdp_members", None)
    for target in [m.param for m, r in zip(members, receiving) if r] if members else [param]:
        _keep_grad_before(target, round_)
    local = param.to_local() if isinstance(param, DTensor) else param
    rows = torch.ops.fsdp_compile.reduce_grad.default(
        total, None, info.param_id, local.shape[0], info.group_name, info.replicate_group_name, info.strategy,
        info.reduce_dtype, local.dtype, info.grad_divisor,
    )
    if members:
        hand_out(param, rows, receiving)
        return
    grad = DTensor(rows, param._spec, requires_grad=False)
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


def _keep_grad_before(param: nn.Parameter, round_: dict | None) -> None:
    kept = param.__dict__.get("_mfsdp_grad_before")
    if round_ is not None and (kept is None or kept[0] is not round_):
        param.__dict__["_mfsdp_grad_before"] = (round_, None if param.grad is None else param.grad.detach().clone())


def _round(module: nn.Module, *, opening: bool = False) -> dict | None:
    """The accumulation round ``module`` is in, if any: a dict of its own (its identity names
    the round), from the ``set_requires_gradient_sync(False)`` that began it; ``opening``
    begins a new one unless one is open, or reopens one closed before any forward ran since
    (a no_sync context around each micro-batch). Sync turned on closes it (``open``), its last
    micro-batch's forward marks it ``done``, and the forward after that ends it, so a
    ``reset_iter_state()`` after a forward or backward of the round that raised finds it."""
    current = module.__dict__.get("_mfsdp_round")
    if opening and current is not None and not current["done"]:
        current["open"] = True  # sync off again before a forward: the same micro-batch sequence
    elif opening and (current is None or not current["open"]):
        current = module.__dict__["_mfsdp_round"] = {"open": True, "done": False}
    return current


def _units(module: nn.Module) -> tuple[nn.Module, ...]:
    """``module`` and, for the outermost unit, the units inside it (outermost_unit.py)."""
    return (module, *module.__dict__.get("_mfsdp_inner_units", ()))


def _trainable(members) -> tuple[bool, ...]:
    return tuple(member.param.requires_grad for member in members)


def _start_sum(param: nn.Parameter, info: ShardInfo) -> None:
    """New accumulators for ``param`` (its reads' and, for reads traced for another backend,
    ``anonymous``); a flat records which members it sums for."""
    info.accumulation["accumulator"] = _accumulator(param, info)
    info.accumulation["anonymous"] = _accumulator(param, info)
    if members := getattr(param, "_mfsdp_members", None):
        param._mfsdp_summed_for = _trainable(members)


def _accumulating(module: nn.Module) -> list[nn.Parameter]:
    """The sharded tensors under ``module`` whose reads may accumulate without sync: each
    ``gathered_params``, and the members of flats, which a block traced for another backend
    reads one by one (NOTE: a block compiled by another backend). Only the accumulators a
    step's reads use get a gradient, so only those cost memory."""
    params = gathered_params(module)
    return params + [member.param for flat in params for member in getattr(flat, "_mfsdp_members", ())]


def _accumulator(param: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    # A full-shape leaf over one element of storage: only its .grad (full size) costs memory.
    one = torch.zeros((), dtype=info.reduce_dtype, device=param.device)
    return one.expand(info.global_shape).requires_grad_(True)


# Called inside a function Dynamo traces (a step compiled whole), it runs as Python: it changes
# the state the reads guard on, and traced, its helpers recompiled per parameter shape.
@torch._dynamo.disable
def _set_requires_gradient_sync(self: nn.Module, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    if recurse is not True:
        # FSDP2's recurse=False sets it for the unit's own parameters, not its inner units'.
        raise UsageError(
            "set_requires_gradient_sync(..., recurse=False) is not supported by fsdp_compile: it "
            "sets the flag for every parameter under the module it is called on. Leave recurse "
            "at True."
        )
    # On a module of a unit grouped by ``fully_shard([...])``: the whole unit, as FSDP2 sets
    # its group's flag (sync on for one module alone left the others summing for ever).
    for module in self.__dict__.get("_mfsdp_unit_modules", (self,)):
        set_requires_gradient_sync(module, requires_gradient_sync)


_set_requires_gradient_sync.__doc__ = set_requires_gradient_sync.__doc__


@contextlib.contextmanager
def _no_sync(self: nn.Module) -> Iterator[None]:
    """DDP's (and FSDP1's, Megatron's) context for the micro-batches before the last: gradient
    sync off inside, back to what it was on exit, so the first backward after it reduces the
    sum with its own gradient. ``set_requires_gradient_sync(False)`` and ``(True)`` around
    them, as FSDP2 writes it."""
    round_ = _round(self)  # a grouped unit's modules share the flag: self's says for all
    was_off = round_ is not None and round_["open"]
    _set_requires_gradient_sync(self, False)
    try:
        yield
    finally:
        _set_requires_gradient_sync(self, not was_off)


def _reset_iter_state(self: nn.Module) -> None:
    """FSDP2's recovery after a forward or backward that raised: what the micro-batches
    accumulated without gradient sync since the last reduction is dropped, as FSDP2 drops it
    (restart the micro-batch sequence); sync stays as it was. Nothing else outlives a failed
    step here: the gathers and reductions are the compiled step's own."""
    if not is_outermost_unit(self):
        # On a part of the model it would leave the rest's sum in place, without a word.
        raise UsageError(
            f"reset_iter_state() was called on a {built_class_name(self)} inside the model: call "
            "it on the module fully_shard was called on last (the root), as FSDP2 requires."
        )
    rounds = [round_ for unit in _units(self) if (round_ := _round(unit)) is not None]
    for param in _accumulating(self):
        kept = param.__dict__.pop("_mfsdp_grad_before", None)
        if kept is not None and any(kept[0] is round_ for round_ in rounds):  # what a round reduced early goes too
            param.grad = kept[1]
        info = shard_info(param)
        if info is None:
            continue
        state = info.accumulation
        state.pop("pending", None)
        if "accumulator" in state:
            _start_sum(param, info)
        if hasattr(param, "_mfsdp_members"):
            forget_graded(param)


# Called from eager code (a frame Dynamo fell back on), the marker's call must run eagerly:
# compiled as a frame of its own, its int arguments would turn symbolic.
torch._dynamo.eval_frame.skip_code(unshard_marker.__code__)

# FSDP2's ``FSDPModule`` methods on accumulation, installed on sharded classes (gathered_reads.py).
ACCUMULATION_METHODS = {
    "set_requires_gradient_sync": _set_requires_gradient_sync,
    "reset_iter_state": _reset_iter_state,
    "no_sync": _no_sync,
}
