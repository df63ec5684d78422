"""Expert parallelism: experts owned by EP ranks, kept out of data-parallel sharding.

Ownership is explicit, never guessed from names: a module with ``expert_parallel_enabled = True``
holds experts, in one of two forms,

- stacked: every parameter has the experts on dim 0 (``[num_experts, ...]``, e.g. fused 3-D
  weights read by a grouped GEMM inside a custom ``autograd.Function``);
- an ``nn.ModuleList`` whose entries are the experts.

Given ``expert_mesh`` (2-D, dims ``("ep", "edp")``, over the same ranks as the data-parallel
mesh), ``fully_shard`` gives each EP rank ``num_experts / ep`` experts and leaves the module's
parameters out of data-parallel sharding. They are still DTensors read through the marker (so a
fused kernel reading the raw weight is covered, as every parameter is), with no gather over the
data-parallel mesh; their gradient is summed over the expert-data-parallel (``edp``) group.
With ``shard_experts=True`` they are in addition sharded over ``edp`` (SimpleFSDP's "efsdp"):
gathered over ``edp`` before use, gradients reduce-scattered over ``edp``.

The MoE layer sends tokens to the experts' owners with ``dispatch_to_experts`` and brings the
results back with ``combine_from_experts`` (all-to-all over the EP group, autograd-aware, traced
by Dynamo as functional collectives). docs/moe.md has the picture.

NOTE: expert gradient scale
    The reference averages every gradient over the global batch. A dense parameter's gradient
    on a rank covers that rank's tokens, so the sum over the data-parallel world W is divided
    by W. An expert's gradient on its EP rank already sums the tokens of every rank in the EP
    group (the backward all-to-all brings them), so summing over ``edp`` covers all W ranks'
    tokens exactly once: the divisor is again W = ep * edp, not the ``edp`` group's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from fsdp_compile.errors import UsageError
from fsdp_compile.markers import GATHERING_STRATEGIES

__all__ = [
    "EXPERT_MESH_DIMS",
    "expert_mesh",
    "ExpertParallelGroup",
    "ExpertParam",
    "RemoteExpert",
    "expert_modules",
    "check_expert_parallel",
    "assign_experts",
    "dispatch_to_experts",
    "combine_from_experts",
]

EXPERT_MESH_DIMS = ("ep", "edp")
"""Dimension names an expert mesh must carry, in this order."""


def expert_mesh(device_type: str, ep_size: int, *, dp_mesh: DeviceMesh | None = None) -> DeviceMesh:
    """A ``("ep", "edp")`` mesh over the default process group, ``ep_size`` ranks per EP group;
    under tensor parallelism, over the data-parallel ranks ``dp_mesh`` (what ``fully_shard``
    gets as ``mesh``: ``mesh["dp"]``, or ``mesh["replicate", "dp"]`` for HSDP), so that no
    EP group crosses a tensor-parallel one.

    Each EP group is ``ep_size`` consecutive ranks of the default group, or of ``dp_mesh``
    read in row-major order, as HSDP numbers them without tensor parallelism (inside one node
    where they fit, where the all-to-all is cheapest); the ``edp`` group joins the ranks
    holding the same experts.
    """
    if dp_mesh is not None and (dp_mesh.ndim not in (1, 2) or not dp_mesh.mesh_dim_names):
        raise UsageError(
            f"dp_mesh must be the data-parallel dimensions of the mesh tensor parallelism "
            f"splits over (mesh['dp'], or mesh['replicate', 'dp'] for HSDP), got {dp_mesh}."
        )
    ranks = dp_mesh.size() if dp_mesh is not None else dist.get_world_size()
    over = "the data-parallel mesh's size" if dp_mesh is not None else "the world size"
    if not isinstance(ep_size, int) or ep_size < 1 or ranks % ep_size:
        raise UsageError(
            f"expert parallel size {ep_size!r} does not divide {over} {ranks}; pick an "
            f"EP size that divides it (e.g. one of {[d for d in range(1, ranks + 1) if ranks % d == 0]})."
        )
    if dp_mesh is None:
        # On the CPU explicitly: a model built under `with torch.device("meta")` may be sharded there.
        grid = torch.arange(ranks, device="cpu").view(ranks // ep_size, ep_size).t()  # [ep, edp]
        return DeviceMesh(device_type, grid, mesh_dim_names=EXPERT_MESH_DIMS)
    # Every data-parallel group of the whole mesh cut alike (each rank makes every group):
    # [group, dp rank] -> [group, ep, edp], then this rank's group.
    root = dp_mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    if not set(dp_mesh.mesh_dim_names) <= set(names):
        raise UsageError(
            f"dp_mesh {dp_mesh.mesh_dim_names} is not made of dimensions of its mesh {names} (a "
            "flattened one?): pass the data-parallel dimensions themselves, e.g. "
            "mesh['replicate', 'dp']."
        )
    data = [names.index(name) for name in dp_mesh.mesh_dim_names]
    others = [dim for dim in range(root.ndim) if dim not in data]
    groups = root.mesh.permute(*others, *data).reshape(-1, ranks).cpu()
    grid = groups.view(-1, ranks // ep_size, ep_size).transpose(1, 2)
    return DeviceMesh(device_type, grid, mesh_dim_names=("dp_groups", *EXPERT_MESH_DIMS))[EXPERT_MESH_DIMS]


@dataclass(frozen=True, kw_only=True)
class ExpertParallelGroup:
    """What a MoE layer needs to send tokens to its experts; ``fully_shard`` sets it on each
    marked module as ``module.expert_parallel_group``."""

    group_name: str
    """EP process group: tokens travel over it by all-to-all."""
    size: int
    """Ranks in the EP group."""
    rank: int
    """This rank's index in it: it owns experts ``[rank * per_rank, (rank + 1) * per_rank)``."""
    num_experts: int
    """Experts in the whole layer."""

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.size

    @property
    def local_experts(self) -> range:
        """Global indices of the experts this rank owns."""
        return range(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)


class RemoteExpert(nn.Module):
    """Stands in a ModuleList for an expert another EP rank owns, so the local experts keep
    their global indices (and so their state-dict names)."""

    def __init__(self, owner: int) -> None:
        super().__init__()
        self.owner = owner

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"this expert lives on EP rank {self.owner}; dispatch tokens to it")

    def extra_repr(self) -> str:
        return f"owner={self.owner}"


@dataclass(frozen=True, kw_only=True)
class ExpertParam:
    """How ``fully_shard`` stores and reduces one expert parameter."""

    fqn: str
    param: nn.Parameter
    mesh: DeviceMesh
    """DTensor mesh: the expert mesh (stacked experts) or its ``edp`` dimension (ModuleList)."""
    placements: tuple
    read_shape: tuple[int, ...]
    """What a read returns: this EP rank's experts (stacked) or the whole expert (ModuleList)."""
    strategy: str
    """``no_shard`` (replicated over edp), or fully_shard's strategy with ``shard_experts``."""
    group_name: str
    """The edp group: gathers (shard_experts) and the gradient reduction run on it."""
    world: int
    grad_divisor: int
    """The whole data-parallel world (see NOTE: expert gradient scale)."""
    unit: str
    """The marked module: expert parameters never share a unit with dense ones."""
    ep_group_outside_mesh: str
    """ModuleList form: the EP group, which ``mesh`` (``edp`` only) does not cover; "" for
    stacked experts, whose mesh has the ``ep`` dimension."""


def expert_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules under ``module`` (itself included) marked ``expert_parallel_enabled = True``
    that no earlier ``fully_shard`` call has handled."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if getattr(m, "expert_parallel_enabled", False) is True
        and getattr(m, "expert_parallel_group", None) is None
    ]


def _num_experts(name: str, module: nn.Module) -> int:
    if isinstance(module, nn.ModuleList):
        return len(module)
    rows = {tuple(p.shape[:1]) for p in module.parameters()}
    if len(rows) != 1 or rows == {()}:
        raise UsageError(
            f"{name or 'the module'} ({type(module).__name__}) is marked expert_parallel_enabled "
            f"but is neither an nn.ModuleList of experts nor a module whose parameters stack the "
            f"experts on dim 0 (their dim-0 sizes are {sorted(rows)}); mark the module that "
            "holds only the experts."
        )
    return rows.pop()[0]


def check_expert_parallel(
    marked: list[tuple[str, nn.Module]],
    expert_mesh: DeviceMesh | None,
    dense_ranks: set[int],
    strategy: str,
    shard_experts: bool,
) -> None:
    """Every expert-parallel precondition, checked before any collective. ``dense_ranks``:
    the data-parallel mesh's ranks, which the expert mesh must span."""
    if not marked:
        return
    name, module = marked[0]
    if expert_mesh is None:
        raise UsageError(
            f"{name or 'the module'} ({type(module).__name__}) has expert_parallel_enabled = True "
            "but fully_shard got no expert_mesh: pass "
            "expert_mesh=fsdp_compile.expert_mesh(device_type, ep_size), or set "
            "expert_parallel_enabled = False to shard its parameters like any other."
        )
    if not isinstance(expert_mesh, DeviceMesh) or expert_mesh.mesh_dim_names != EXPERT_MESH_DIMS:
        raise UsageError(
            f"expert_mesh must be a 2-D DeviceMesh with mesh_dim_names={EXPERT_MESH_DIMS}, got "
            f"{expert_mesh!r}; build it with fsdp_compile.expert_mesh(device_type, ep_size)."
        )
    expert_ranks = set(expert_mesh.mesh.flatten().tolist())
    if expert_ranks != dense_ranks:
        raise UsageError(
            f"expert_mesh spans ranks {sorted(expert_ranks)} but the data-parallel mesh "
            f"{sorted(dense_ranks)}: the expert mesh must hold exactly the data-parallel ranks "
            "(ep * edp of them). Under tensor parallelism build it over the data-parallel "
            "dimension, fsdp_compile.expert_mesh(device_type, ep_size, dp_mesh=mesh['dp']), so "
            "that no EP group crosses a tensor-parallel one."
        )
    if shard_experts and strategy not in GATHERING_STRATEGIES:
        raise UsageError(
            f"shard_experts=True shards experts over edp, but strategy={strategy!r} shards "
            "nothing; use a sharded strategy or leave shard_experts off."
        )
    ep = expert_mesh.size(0)
    for name, module in marked:
        experts = _num_experts(name, module)
        if experts % ep:
            raise UsageError(
                f"{name or 'the module'} has {experts} experts, not divisible by the expert "
                f"parallel size {ep}; pick an EP size that divides the number of experts."
            )


def assign_experts(
    name: str,
    module: nn.Module,
    expert_mesh: DeviceMesh,
    strategy: str,
    shard_experts: bool,
    unit: str,
) -> list[ExpertParam]:
    """Give this EP rank its experts of ``module``; return how to store each parameter.

    A ModuleList keeps only this rank's entries (the others become ``RemoteExpert``); stacked
    parameters keep their global shape as DTensors whose local rows are this rank's experts.
    Sets ``module.expert_parallel_group``. ``unit`` names the experts' own unit.
    """
    ep_group, edp_group = expert_mesh.get_group("ep"), expert_mesh.get_group("edp")
    group = ExpertParallelGroup(
        group_name=ep_group.group_name,
        size=ep_group.size(),
        rank=ep_group.rank(),
        num_experts=_num_experts(name, module),
    )
    expert_strategy = strategy if shard_experts else "no_shard"
    over_edp = Shard(0) if shard_experts else Replicate()
    common = dict(
        strategy=expert_strategy,
        group_name=edp_group.group_name,
        world=edp_group.size(),
        grad_divisor=expert_mesh.size(),
        unit=unit,
    )
    stacked = not isinstance(module, nn.ModuleList)
    outside = "" if stacked else group.group_name  # the ep dim is in a stacked weight's mesh
    if not stacked:
        for index in range(len(module)):
            if index not in group.local_experts:
                module[index] = RemoteExpert(owner=index // group.experts_per_rank)
    assigned = []
    for fqn, param in module.named_parameters():
        if stacked:
            mesh, placements = expert_mesh, (Shard(0), over_edp)
            read_shape = (group.experts_per_rank, *param.shape[1:])
        else:
            mesh, placements, read_shape = expert_mesh["edp"], (over_edp,), tuple(param.shape)
        prefix = f"{name}." if name else ""
        assigned.append(
            ExpertParam(
                fqn=prefix + fqn, param=param, mesh=mesh, placements=placements,
                read_shape=read_shape, ep_group_outside_mesh=outside, **common,
            )
        )
    module.expert_parallel_group = group
    return assigned


def dispatch_to_experts(expert_in: torch.Tensor, group: ExpertParallelGroup) -> torch.Tensor:
    """``[num_experts, capacity, dim]`` slots of this rank's tokens -> ``[experts_per_rank,
    ep * capacity, dim]``: every EP rank's tokens for the experts this rank owns.

    One all-to-all of equal splits (static shapes, no host sync); its backward is the reverse
    all-to-all, which brings every EP rank's gradient for these experts' inputs back home.
    """
    experts, capacity, dim = expert_in.shape
    received = all_to_all_single_autograd(expert_in.contiguous(), None, None, group.group_name)
    # received = [source rank, local expert, slot, dim]: group the slots by expert.
    per_source = received.view(group.size, group.experts_per_rank, capacity, dim)
    return per_source.transpose(0, 1).reshape(group.experts_per_rank, group.size * capacity, dim)


def combine_from_experts(expert_out: torch.Tensor, group: ExpertParallelGroup) -> torch.Tensor:
    """The inverse of ``dispatch_to_experts``: each rank gets its own tokens' expert outputs back,
    ``[num_experts, capacity, dim]``."""
    local, slots, dim = expert_out.shape
    capacity = slots // group.size
    per_source = expert_out.view(local, group.size, capacity, dim).transpose(0, 1)
    sent = all_to_all_single_autograd(per_source.contiguous(), None, None, group.group_name)
    return sent.view(group.num_experts, capacity, dim)
