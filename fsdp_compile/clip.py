"""``clip_grad_norm_`` for gradients on several meshes: dense parameters and experts.

``torch.nn.utils.clip_grad_norm_`` works on a model ``fully_shard`` sharded over one mesh (every
strategy, HSDP included): the gradients are DTensors and torch reduces their norms. Under
expert parallelism they are not on one mesh: dense gradients live on the data-parallel mesh,
stacked experts on the expert mesh, ModuleList experts on its ``edp`` dimension, and torch
stacks the per-gradient norms into one DTensor, which fails ("All operands in
aten.stack.default must have the same mesh"). ModuleList experts hide a second problem: each
EP rank holds different experts, and no DTensor mesh says so, so a norm over one rank's
parameters misses the others' experts.

This function groups the gradients by (mesh, placements, EP group outside the mesh). Per
group, torch computes the norm of this rank's local gradients
(``torch.nn.utils.get_total_norm``), and ``norm ** p`` is summed (the max taken, for the
inf-norm) over every group of ranks holding different parts: the mesh dimensions the
gradients are sharded on, and the EP group for ModuleList experts. The groups' norms combine
into the total, and ``torch.nn.utils.clip_grads_with_norm_`` scales each group (the total handed
over as a replicated DTensor on that group's mesh). torchtitan's EP-aware clip splits the
gradients for the same reason. Written over local tensors rather than DTensor norms because
a rank left without rows by an uneven shard makes DTensor's inf-norm fail (torch's
``_foreach_norm`` has no identity for the max over an empty tensor).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_compile.accumulation import reduce_orphaned_sums
from fsdp_compile.records import shard_info
from fsdp_compile.errors import UsageError

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their joint ``norm_type``-norm
    is at most ``max_norm``; return that norm (before scaling) as a plain tensor, equal on
    every rank. Same arguments and result as ``torch.nn.utils.clip_grad_norm_``, for models
    whose gradients span several meshes (expert parallelism); with one mesh both agree.

    Every rank calls it with its own ``model.parameters()`` (a collective: ranks must agree on
    which parameters have a gradient, as with torch's).
    """
    if isinstance(parameters, nn.Module):
        raise TypeError(
            "clip_grad_norm_ takes parameters, as torch.nn.utils.clip_grad_norm_ does: pass "
            "model.parameters(), not the module."
        )
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise UsageError(f"norm_type must be positive or math.inf, got {norm_type}.")
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    # A sum accumulated without sync that no read took is part of these gradients: the
    # optimizer's step would reduce it (optim_guard), after the norm.
    reduce_orphaned_sums(parameters)
    # (mesh, the groups holding different parts) -> parameters; all checked before any collective
    groups: dict[tuple, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault((mesh, _holders(param)), []).append(param)
    if not groups:
        return torch.tensor(0.0)
    norms = [_group_norm(params, holders, norm_type, foreach) for (_, holders), params in groups.items()]
    total = torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite, foreach)
    for (mesh, _), params in groups.items():
        on_mesh = total if mesh is None else _replicated(total, mesh)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, on_mesh, foreach)
    return total


def _group_norm(params: list[torch.Tensor], holders: tuple, norm_type: float, foreach) -> torch.Tensor:
    """The norm of one group's gradients over every rank that holds a part of them
    (``holders``: the process groups to reduce over)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    # Uneven shards leave some ranks without rows (a 3-element weight at world 4): skipped,
    # since the max over nothing has no identity in torch (torch's own clip fails there).
    held = [g for g in grads if g.numel()]
    norm = torch.nn.utils.get_total_norm(held, norm_type, False, foreach) if held else grads[0].new_zeros(())
    for group in holders:
        if math.isinf(norm_type):
            norm = funcol.wait_tensor(funcol.all_reduce(norm, "max", group))
        else:
            norm = funcol.wait_tensor(funcol.all_reduce(norm**norm_type, "sum", group)) ** (1.0 / norm_type)
    return norm


def _holders(param: torch.Tensor) -> tuple:
    """The process groups across which ranks hold different parts of ``param``'s gradient:
    the mesh dimensions it is sharded on, and for ModuleList experts the EP group."""
    grad, info = param.grad, shard_info(param)
    groups = []
    if isinstance(grad, DTensor):
        for dim, placement in enumerate(grad.placements):
            # A tensor-parallel parameter's data-parallel dimension is a _StridedShard.
            if not isinstance(placement, (Shard, _StridedShard, Replicate)):
                raise TypeError(f"clip_grad_norm_ expects Shard or Replicate gradients, got {placement}.")
            if isinstance(placement, (Shard, _StridedShard)):
                groups.append((grad.device_mesh, dim))
    if info is not None and info.ep_group_outside_mesh:
        groups.append(info.ep_group_outside_mesh)
    return tuple(groups)


def _replicated(total: torch.Tensor, mesh) -> DTensor:
    """``total`` (equal on every rank) as a DTensor on ``mesh``, so torch scales DTensor
    gradients by it without mixing plain tensors into DTensor ops."""
    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
