"""What runs before each forward of the outermost unit, the module a step is called on.

``torch.compile(model)`` (and ``model.compile()``) runs a module's hooks outside Dynamo, before
the compiled frame's guards are checked, so a hook here sees the model as the user left it
between steps: once a step, eagerly. Called inside a function of the user's that Dynamo traces,
the hook is traced with it, and what it must see is made guards of that frame. Each
``fully_shard`` call moves the hook to the module it shards, so only the outermost unit keeps
it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy

from fsdp_compile.flat_params import follow_members
from fsdp_compile.accumulation import reduce_untaken_sums, settle_changed_sums, sum_outdated
from fsdp_compile.gathered_reads import traced_by_mfsdp
from fsdp_compile.meta_buffers import refuse_unfilled_buffers
from fsdp_compile.records import is_fully_sharded
from fsdp_compile.region_tables import BLOCKS
from fsdp_compile.regions import is_region
from fsdp_compile.sharding_checks import refuse_meta_parameters

__all__ = ["install_outermost_hook"]


def install_outermost_hook(module: nn.Module) -> None:
    """``_before_forward`` runs before the forward of ``module``, and no longer before those of
    the units inside it; called once ``module``'s repeated blocks are installed."""
    for unit_module in module.modules():
        for handle in unit_module.__dict__.pop("_mfsdp_outermost_hooks", ()):
            handle.remove()
        unit_module.__dict__.pop("_mfsdp_regions", None)
        unit_module.__dict__.pop("_mfsdp_inner_units", None)
    # Tuples: the model holds its blocks and units. The units inside are where a
    # ``set_requires_gradient_sync`` called on them (FSDP2 allows it on any unit) keeps its
    # accumulation round, which the hook settles too.
    module._mfsdp_regions = tuple(m for m in module.modules() if is_region(m))
    module._mfsdp_inner_units = tuple(m for m in module.modules() if m is not module and is_fully_sharded(m))
    module._mfsdp_outermost_hooks = (
        module.register_forward_pre_hook(_before_forward, prepend=True, with_kwargs=True),
        module.register_forward_hook(_after_forward),
    )


def _before_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse parameters still on the meta device and non-persistent buffers a meta init left
    unfilled; make each block's flats require a gradient as their members now do (NOTE:
    requires_grad after fully_shard, in flat_params.py); settle the sums of weights frozen or
    unfrozen since the last forward during an accumulation (``settle_changed_sums``)."""
    refuse_meta_parameters(module, args, kwargs)
    refuse_unfilled_buffers(module)
    if not torch.compiler.is_compiling():
        _follow_members(module._mfsdp_regions)
        settle_changed_sums(module)
        return
    # Traced, inside a function of the user's (``torch.compile(train_step)``): the flats follow
    # while Dynamo traces, before the blocks read them, and each member's flag read here is a
    # guard of the frame, so a flag changed since traces it again. Traced for mfsdp, a flat
    # summing without sync for other members than those trainable now (a freeze since the
    # last forward, with no ``set_requires_gradient_sync`` between) has its sum settled before
    # the blocks read it: Dynamo breaks the graph there. The members it sums for are a guard
    # too, so a frame traced with nothing to settle runs only while that still holds. (Another
    # backend reads the members one by one, each summing its own.)
    blocks = module._mfsdp_regions
    by_mfsdp = traced_by_mfsdp()
    changed = False
    for block, flats in zip(blocks, _follow_members_in_trace(tuple(block._mfsdp_region_key for block in blocks))):
        for flat, members in zip(block._mfsdp_region_flats.values(), flats):
            now = tuple(block.get_submodule(owner)._parameters[name].requires_grad for owner, name in members)
            if by_mfsdp and sum_outdated(flat, now):
                changed = True
    if changed:
        _settle_changed_sums_untraced(module)


def _after_forward(module: nn.Module, args: tuple, output) -> None:
    """Reduce the sums accumulated without sync that this forward's reads left, each weight
    gathered again (``reduce_untaken_sums``); not under ``no_grad`` (an evaluation leaves them
    to the last micro-batch). Traced, inside a function of the user's, only where sync turned
    on left sums (a guard of the frame): there Dynamo breaks the graph and runs it after the
    forward's reads have taken theirs. Left to the optimizer's step, torch's clipping took
    its norm without them."""
    if not torch.is_grad_enabled():
        return
    if not torch.compiler.is_compiling():
        reduce_untaken_sums(module)
    elif module.__dict__.get("_mfsdp_sums_pending", False):
        _reduce_untaken_sums_untraced(module)


_reduce_untaken_sums_untraced = torch._dynamo.disable(reduce_untaken_sums)
_settle_changed_sums_untraced = torch._dynamo.disable(settle_changed_sums)


def _follow_members(blocks: tuple[nn.Module, ...]) -> None:
    for block in blocks:
        for flat in block._mfsdp_region_flats.values():
            follow_members(flat)


@torch._dynamo.assume_constant_result
def _follow_members_in_trace(block_keys: tuple[int, ...]) -> tuple[tuple[tuple[tuple[str, str], ...], ...], ...]:
    """Run, not traced, by Dynamo (it takes constants only): ``_follow_members``, and per
    block, per flat, where its members are, as (owning submodule's path, parameter name)."""
    blocks = tuple(BLOCKS[key] for key in block_keys)
    _follow_members(blocks)
    return tuple(
        tuple(tuple(path.rpartition(".")[::2] for path in members) for members in block._mfsdp_region.flats)
        for block in blocks
    )


# Run by Python with all it calls: under torch.compile(model) Dynamo offers every frame a hook
# runs to the backend, and would trace each of these once (the loop over the blocks
# included) for no graph: they call no tensor op a graph should hold.
for _hook in (_before_forward, _after_forward):
    set_code_exec_strategy(_hook.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
