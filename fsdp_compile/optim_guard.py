"""Before each optimizer step: catch an optimizer built before ``fully_shard`` (it would
silently train nothing), and reduce the sums accumulated without sync that no read or
forward took (``accumulation.reduce_orphaned_sums``).

``fully_shard`` replaces each parameter with a new sharded one; an optimizer created earlier
still holds the old tensors, which never receive a gradient again, so ``step()`` skips them
without a word. A global optimizer step pre-hook (torch's ``register_optimizer_step_pre_hook``)
checks each optimizer once, on its first step, and raises naming the fix.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_compile.accumulation import reduce_orphaned_sums
from fsdp_compile.errors import UsageError

_CHECKED = "_mfsdp_checked"


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    _check_params(optimizer)
    reduce_orphaned_sums([p for group in optimizer.param_groups for p in group["params"]])


def _check_params(optimizer: torch.optim.Optimizer) -> None:
    if getattr(optimizer, _CHECKED, False):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if hasattr(param, "_mfsdp_sharded_as"):
                raise UsageError(
                    f"{type(optimizer).__name__} holds a parameter of shape "
                    f"{tuple(param.shape)} that fully_shard has since replaced with its shard: "
                    "this optimizer was built before fully_shard and would update nothing. "
                    "Build the optimizer after fully_shard(model)."
                )
    setattr(optimizer, _CHECKED, True)


def install() -> None:
    """Register the check once per process (by the first ``fully_shard``: importing the
    package changes nothing outside it)."""
    if not getattr(install, "done", False):
        register_optimizer_step_pre_hook(_before_step)
        install.done = True
