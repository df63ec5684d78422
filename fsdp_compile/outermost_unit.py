"""What runs before each forward of the outermost unit, the module a step is called on.

``torch.compile(model)`` runs a module's hooks outside Dynamo, before the compiled frame's
guards are checked, so a hook here sees the model as the user left it between steps: once a
step, eagerly. Each ``fully_shard`` call moves the hook to the module it shards, so only the
outermost unit keeps it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy

from fsdp_compile.flat_params import follow_members
from fsdp_compile.regions import is_region
from fsdp_compile.sharding_checks import refuse_meta_parameters

__all__ = ["install_outermost_hook"]


def install_outermost_hook(module: nn.Module) -> None:
    """``_before_forward`` runs before the forward of ``module``, and no longer before those of
    the units inside it."""
    for unit_module in module.modules():
        for handle in unit_module.__dict__.pop("_mfsdp_outermost_hooks", ()):
            handle.remove()
        unit_module.__dict__.pop("_mfsdp_regions", None)
    module._mfsdp_outermost_hooks = (module.register_forward_pre_hook(_before_forward, prepend=True, with_kwargs=True),)


def _before_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse parameters still on the meta device; make each block's flats require a gradient
    as their members now do (NOTE: requires_grad after fully_shard, in flat_params.py)."""
    refuse_meta_parameters(module, args, kwargs)
    # Traced inside a frame of the user's, the flags are that frame's guards to keep: reading
    # each member here would make Dynamo wrap every parameter of every layer.
    if torch.compiler.is_compiling():
        return
    for block in _regions(module):
        for flat in block._mfsdp_region_flats.values():
            follow_members(flat)


def _regions(module: nn.Module) -> tuple[nn.Module, ...]:
    """The repeated blocks under ``module``, found at its first forward, when every
    ``fully_shard`` call has installed them (a tuple: the model holds the blocks)."""
    regions = module.__dict__.get("_mfsdp_regions")
    if regions is None:
        regions = module._mfsdp_regions = tuple(m for m in module.modules() if is_region(m))
    return regions


# Run by Python with all it calls: under torch.compile(model) Dynamo offers every frame a hook
# runs to the backend, and would trace each of these once (the walk over the model's modules
# included) for no graph: they call no tensor op a graph should hold.
set_code_exec_strategy(_before_forward.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
