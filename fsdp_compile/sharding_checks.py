"""Every precondition of ``fully_shard``, checked on every rank before any collective, so a
mistake stops every rank with one ``UsageError`` that names the fix and no rank waits."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from fsdp_compile.errors import UsageError
from fsdp_compile.float8 import is_float8_weight
from fsdp_compile.markers import STRATEGIES
from fsdp_compile.records import ShardInfo, built_class_name, is_fully_sharded, shard_info


def grouped_modules(module: object) -> list[nn.Module]:
    """The modules one ``fully_shard`` call makes one unit of: ``module``, or of FSDP2's list
    of modules (``fully_shard([model.norm, model.output])``) those inside no other, as FSDP2
    takes them."""
    if isinstance(module, nn.Module):
        return [module]
    if not isinstance(module, (list, tuple)) or not module or not all(isinstance(m, nn.Module) for m in module):
        raise UsageError(
            f"fully_shard expects an nn.Module or a non-empty list of them (FSDP2's grouping), "
            f"got {type(module).__name__}."
        )
    inside = {id(sub) for m in module for sub in m.modules() if sub is not m}
    return [m for m in dict.fromkeys(module) if id(m) not in inside]


def check_module(module: nn.Module, mesh: DeviceMesh | None) -> None:
    """Every precondition, checked before any collective so no rank is left waiting."""
    if not isinstance(module, nn.Module):
        raise UsageError(f"fully_shard expects an nn.Module, got {type(module).__name__}.")
    if is_fully_sharded(module):
        raise UsageError(
            f"fully_shard was already called on this {type(module).__name__}; call it once per "
            "module (submodules first, then the root)."
        )
    by_fsdp2 = next((name for name, m in module.named_modules() if isinstance(m, FSDPModule)), None)
    if by_fsdp2 is not None:
        raise UsageError(
            f"this model{f' (its {by_fsdp2})' if by_fsdp2 else ''} was sharded by torch's FSDP2 "
            "(torch.distributed.fsdp.fully_shard, or transformers' DistributedConfig with "
            "fsdp_size or dp_replicate_size above 1, which applies it): its parameters are "
            "already data-parallel shards. Shard it with one of the two: build the model "
            "without FSDP2, then call fsdp_compile.fully_shard."
        )
    owned = _sharded_by_an_enclosing_call(module)
    if owned is not None:
        name, info = owned
        raise UsageError(
            f"fully_shard on this {built_class_name(module)} comes after fully_shard on a module "
            f"enclosing it, which already sharded its parameter {name!r} (unit {info.unit}) "
            "and stays its owner. Call fully_shard on submodules first, then on the root (the "
            "order FSDP2 takes too)."
        )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise UsageError(
            f"mesh must be a DeviceMesh (torch.distributed.device_mesh.init_device_mesh), got "
            f"{type(mesh).__name__}."
        )
    if mesh is not None and mesh.ndim not in (1, 2):
        raise UsageError(
            f"fully_shard takes a 1-D mesh (shard) or a 2-D mesh (replicate, shard) for HSDP, "
            f"got a {mesh.ndim}-D mesh {mesh}."
        )
    if mesh is not None:
        _check_mesh_holds_every_rank(mesh)
    devices = {p.device for p in module.parameters() if not isinstance(p, DTensor)}
    if len(devices) > 1:
        raise UsageError(
            "fully_shard found parameters on several devices "
            f"({', '.join(sorted(map(str, devices)))}); move the module to one device first, "
            "e.g. module.to('cuda')."
        )
    for name, param in module.named_parameters():
        if not isinstance(param, DTensor) and not param.is_floating_point():
            raise UsageError(
                f"parameter {name!r} has dtype {param.dtype}; only floating-point parameters "
                "can be sharded. Register it as a buffer (module.register_buffer) instead."
            )
        if not isinstance(param, DTensor) and param.ndim == 0:
            raise UsageError(
                f"parameter {name!r} is a 0-dim scalar and cannot be sharded on dim 0; give it "
                "shape [1] instead."
            )


def check_fsdp2_options(
    module: nn.Module, offload_policy: object, shard_placement_fn: object, ignored_params: object
) -> None:
    """FSDP2's ``fully_shard`` options fsdp_compile has no counterpart for, refused before any
    collective unless they ask for what it does anyway: no offload (FSDP2's default
    ``OffloadPolicy()``), every parameter on dim 0, none left out."""
    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise UsageError(
            f"offload_policy={type(offload_policy).__name__}(...): fsdp_compile does not offload "
            "to the CPU; parameters, gradients and optimizer state stay on the mesh's device. "
            "Drop offload_policy; to fit a larger model, shard over more ranks, checkpoint "
            "activations, or gather in float8 (docs/user_guide.md)."
        )
    if shard_placement_fn is not None:
        other = [
            f"{name}: {placement}" for name, param in module.named_parameters()
            if (placement := shard_placement_fn(param)) is not None and placement != Shard(0)
        ]
        if other:
            raise UsageError(
                f"shard_placement_fn places {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}: "
                "fsdp_compile shards every parameter on dim 0. Drop shard_placement_fn."
            )
    if ignored_params:
        raise UsageError(
            "ignored_params: fsdp_compile manages every parameter under the module it is given "
            "(gathered for each use, its gradient reduced over the mesh). Drop ignored_params; "
            "a parameter that must not train can be frozen (requires_grad_(False)): it is then "
            "gathered, never reduced."
        )


def check_tensor_parallel(module: nn.Module, mesh: DeviceMesh | None) -> None:
    """Parameters tensor parallelism placed (DTensors ``fully_shard`` did not make) are
    sharded over the data-parallel ``mesh`` too, as FSDP2 does: ``mesh`` (1-D, or 2-D for
    HSDP) and their 1-D mesh must be dimensions of one mesh (``mesh["dp"]`` and
    ``mesh["tp"]``)."""
    placed = [(n, p) for n, p in module.named_parameters() if isinstance(p, DTensor) and shard_info(p) is None]
    if not placed:
        return
    name, param = placed[0]
    if mesh is None:
        raise UsageError(
            f"parameter {name!r} is a tensor-parallel DTensor ({list(param.placements)} on "
            f"{param.device_mesh}): pass the data-parallel dimension of the same mesh, "
            "fully_shard(model, mesh=mesh['dp']), where parallelize_module got mesh['tp']."
        )
    for name, param in placed:
        _check_one_tensor_parallel(name, param, mesh)
    float8 = next((n for n, p in placed if is_float8_weight(p.to_local())), None)
    if float8 is not None:
        _check_even_splits(placed, float8)


def _check_even_splits(placed: list[tuple[str, DTensor]], float8: str) -> None:
    """Float8 weights split by tensor parallelism take their scales' max over "tp" too (NOTE:
    float8 gathers): a collective mfsdp places on the tensor-parallel group, beside the ones
    the styles trace there, so every rank of that group must plan and order its step alike.
    Its ranks do when every piece has one shape; an uneven split gives them other pieces,
    other buckets and schedules (and float8 matmul shapes one rank refuses and another
    takes)."""
    for name, param in placed:
        for dim in _unevenly_split_dims(param):
            tp = param.device_mesh.size()
            raise UsageError(
                f"parameter {name!r} has {param.shape[dim]} entries on dim {dim}, which tensor "
                f"parallelism splits unevenly over {tp} ranks, and {float8!r} is a float8 weight: "
                "float8 under tensor parallelism needs every split even. "
                f"Pad that dim to a multiple of {tp}, or leave float8 off."
            )


def _unevenly_split_dims(param: DTensor) -> list[int]:
    """The dims of a tensor-parallel parameter its 1-D mesh splits into pieces of unequal size."""
    tp = param.device_mesh.size()
    dims = [p.dim % param.ndim for p in param.placements if p.is_shard()]
    return [d for d in dims if param.shape[d] % tp]


def _check_one_tensor_parallel(name: str, param: DTensor, mesh: DeviceMesh) -> None:
    tp_mesh = param.device_mesh
    if tp_mesh.ndim != 1:
        raise UsageError(
            f"parameter {name!r} is a DTensor on a {tp_mesh.ndim}-D mesh {tp_mesh}: fully_shard "
            "takes tensor parallelism over one mesh dimension."
        )
    if param.ndim == 0:
        raise UsageError(f"parameter {name!r} is a 0-dim DTensor and cannot be sharded on dim 0; give it shape [1].")
    names = set(mesh.mesh_dim_names or ()) & set(tp_mesh.mesh_dim_names or ())
    fix = (
        "they must be distinct dimensions of one mesh with names: mesh = init_device_mesh(device, "
        "(dp, tp), mesh_dim_names=('dp', 'tp')), parallelize_module(model, mesh['tp'], plan), then "
        "fully_shard(model, mesh=mesh['dp'])."
    )
    if tp_mesh._get_root_mesh() != mesh._get_root_mesh() or names or not tp_mesh.mesh_dim_names:
        raise UsageError(f"parameter {name!r} is a tensor-parallel DTensor on {tp_mesh}, and fully_shard got {mesh}: {fix}")
    try:  # what fully_shard builds the parameter's mesh with; it runs no collective
        DeviceMesh._concatenate([mesh, tp_mesh])
    except Exception as error:
        raise UsageError(f"parameter {name!r}: its tensor-parallel mesh {tp_mesh} and {mesh} ({error}): {fix}") from error
    # torch's _StridedShard describes rows cut by tensor parallelism unevenly, then over three
    # or more data-parallel ranks, other than the rows each rank holds (FSDP2 has the same
    # limit): a checkpoint or a full state dict would land rows at the wrong offsets.
    dp_ranks = mesh.size(mesh.ndim - 1)
    if 0 in _unevenly_split_dims(param) and dp_ranks >= 3:
        raise UsageError(
            f"parameter {name!r} has {param.shape[0]} rows, which tensor parallelism cuts unevenly "
            f"over {tp_mesh.size()} ranks; sharded again over {dp_ranks} data-parallel ranks its DTensor "
            "layout (_StridedShard) would not say which rows each rank holds, and checkpoints would "
            "misplace them. Make dim 0 divisible by the tensor-parallel size (pad the vocabulary), "
            "or use at most 2 data-parallel ranks per shard group."
        )


def _check_mesh_holds_every_rank(mesh: DeviceMesh) -> None:
    """Refuse, on every rank and without communicating, a mesh that leaves ranks of the job out.

    A rank outside the mesh sees it: it has no coordinate in it. A rank inside cannot see which
    mesh the others were given, so the rule is one each rank checks alone: the mesh holds every
    rank, itself or as a dimension of a mesh that does (``mesh["dp"]`` of a ``(dp, tp)`` mesh
    over the world is one mesh per group of ranks, every rank in one of them).
    ``DeviceMesh("cpu", [0])`` in a two-rank job breaks it on both ranks: rank 1 is outside,
    and rank 0's mesh was cut from no mesh that holds rank 1.
    """
    world = dist.get_world_size()
    fix = (
        f"Leave mesh unset (all {world} ranks), or build it over every rank: "
        f"init_device_mesh({mesh.device_type!r}, ({world},)), or a dimension of such a mesh."
    )
    if mesh.get_coordinate() is None:
        raise UsageError(
            f"rank {dist.get_rank()} is not in the mesh given to fully_shard (ranks "
            f"{mesh.mesh.tolist()}); every rank of the job must be. {fix}"
        )
    if mesh.size() == world:
        return
    root = mesh._get_root_mesh()  # the mesh it was cut from, or itself (no public spelling)
    if root.size() != world:
        raise UsageError(
            f"the mesh given to fully_shard holds ranks {root.mesh.tolist()}, {root.size()} of "
            f"the job's {world}; the ranks outside it would not train with these. {fix}"
        )


def _sharded_by_an_enclosing_call(module: nn.Module) -> tuple[str, ShardInfo] | None:
    """A parameter under ``module`` (its name and record) that a ``fully_shard`` call on a
    module enclosing ``module`` sharded; None if there is none.

    Sharded parameters belong under ``module`` only inside its units, the submodules earlier
    calls were given (with the expert-parallel and tied parameters those calls sharded). A
    tie's other end outside them still holds the unsharded original, which forwards to the
    shard (``_mfsdp_sharded_as``). So one reached through no unit was sharded by a call on a
    module around ``module``, and ``_managed_params`` would skip it: the call would do nothing.
    """
    pending = [("", module, False)]
    while pending:
        prefix, submodule, in_unit = pending.pop()
        in_unit = in_unit or (submodule is not module and is_fully_sharded(submodule))
        if not in_unit:
            for name, param in submodule._parameters.items():
                info = shard_info(param)
                if info is not None:
                    return prefix + name, info
        pending.extend(
            (f"{prefix}{name}.", child, in_unit) for name, child in submodule._modules.items() if child is not None
        )
    return None


def check_strategy(
    strategy: object, reshard_after_forward: object, mesh: DeviceMesh | None
) -> bool | None:
    """The strategy's checks; returns ``reshard_after_forward`` for this strategy: False where
    the strategy keeps gathered parameters, None where NOTE: the reshard default decides."""
    if strategy not in STRATEGIES:
        raise UsageError(
            f"unknown strategy {strategy!r}; fully_shard takes one of {', '.join(STRATEGIES)} "
            "(default optim_grads_params, ZeRO-3)."
        )
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        reshard_after_forward = _reshard_to(reshard_after_forward, mesh)
    if reshard_after_forward not in (None, True, False):
        raise UsageError(
            f"reshard_after_forward must be True, False or None, got {reshard_after_forward!r}."
        )
    if reshard_after_forward and strategy != "optim_grads_params":
        raise UsageError(
            f"strategy={strategy!r} keeps parameters unsharded from forward to backward, so "
            "reshard_after_forward=True contradicts it; use strategy='optim_grads_params' to "
            "reshard, or leave reshard_after_forward unset."
        )
    if strategy == "no_shard" and mesh is not None and mesh.ndim == 2:
        raise UsageError(
            "strategy='no_shard' replicates over the whole mesh; give it a 1-D mesh (a 2-D "
            "replicate x shard mesh is for the sharded strategies, HSDP)."
        )
    return reshard_after_forward if strategy == "optim_grads_params" else False


def _reshard_to(size: int, mesh: DeviceMesh | None) -> bool:
    """FSDP2's integer ``reshard_after_forward``, the size of the group a gathered parameter is
    resharded to after forward: 1 keeps it gathered (False, as FSDP2 takes it), the shard
    group's size frees it (True); fsdp_compile has no group in between."""
    shard_world = mesh.size(-1) if mesh is not None else dist.get_world_size() if dist.is_initialized() else None
    if size == 1 or size == shard_world:
        return size != 1
    raise UsageError(
        f"reshard_after_forward={size}: FSDP2 reshards to groups of {size} ranks after forward; "
        f"fsdp_compile frees a gathered parameter over its whole shard group "
        f"(reshard_after_forward=True{f', {shard_world} ranks' if shard_world else ''}) or keeps it "
        "(False). Pass True or False."
    )


def refuse_meta_parameters(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse a forward on real inputs while the parameters are still on the meta device.

    A model built under ``torch.device("meta")`` and sharded is materialised with
    ``to_empty``; forgotten, its first op fails on two devices (Dynamo's device mismatch when
    compiled), naming neither the meta device nor the fix. Checked before the forward reads a
    parameter, so on every rank before any collective. A forward on meta inputs is no mistake:
    ``fsdp_compile.simulate`` traces such steps. One parameter stands for all: ``to_empty``
    materialises the whole model.
    """
    param = next(module.parameters(), None)
    if param is None or param.device.type != "meta":
        return
    inputs = (*args, *kwargs.values())
    device = next((v.device for v in inputs if isinstance(v, torch.Tensor) and v.device.type != "meta"), None)
    if device is not None:
        raise UsageError(
            f"the parameters of this {built_class_name(module)} are still on the meta device, its "
            f"inputs on {device}: materialise the model after fully_shard, "
            f"model.to_empty(device={device.type!r}), then load its weights "
            "(set_model_state_dict) or initialise the parameters in place (docs/user_guide.md, "
            "\"meta-device init\")."
        )
