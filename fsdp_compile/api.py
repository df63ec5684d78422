"""``fully_shard``: turn a module's parameters into ``Shard(0)`` DTensors read through markers.

Each managed parameter is replaced by an ``nn.Parameter`` wrapping a DTensor with the true global
shape, so ``model.parameters()``, torch.optim, ``clip_grad_norm_`` and ``state_dict()`` see
ordinary sharded parameters. The module's class is swapped for a generated subclass whose
property for that name returns ``unshard(param.to_local())``: every read of the attribute, by
``forward``, a custom ``autograd.Function`` or a fused kernel, passes through the marker, and no
module hook exists that a kernel could bypass (see NOTE: why markers, in docs/design.md).

The sharding record lives on the parameter object (``param._mfsdp``): Dynamo hands the backend
the real parameters as example inputs, so the backend reads the plan's facts from them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map_only

from fsdp_compile.compat import (
    checkpoint_rng_states_saved_as_tensors, device_mesh_copies_run_untraced, gather_cpu_tensors_one_work_each,
)
from fsdp_compile.errors import UsageError
from fsdp_compile.expert_parallel import (
    ExpertParam,
    assign_experts,
    check_expert_parallel,
    expert_modules,
)
from fsdp_compile.float8 import Float8Gather, float8_gather_of, is_float8_weight, master_weight
from fsdp_compile.gathered_reads import install_properties
from fsdp_compile.hf import install_prelude
from fsdp_compile.hf_methods import hf_methods
from fsdp_compile.meta_buffers import watch_meta_buffers
from fsdp_compile.markers import GATHERING_STRATEGIES, Strategy, padded_rows
from fsdp_compile.optim_guard import install as install_optimizer_guard
from fsdp_compile.records import (
    MixedPrecision,
    ShardInfo,
    TensorParallelRead,
    block_paths,
    next_param_id,
    repeated_block,
    shard_info,
    unit_name,
)
from fsdp_compile.outermost_unit import install_outermost_hook
from fsdp_compile.regions import install_regions
from fsdp_compile.sharding_checks import (
    check_fsdp2_options,
    check_module,
    check_strategy,
    check_tensor_parallel,
    grouped_modules,
)

__all__ = ["fully_shard"]


def _default_mesh(module: nn.Module) -> DeviceMesh:
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError(
            "fully_shard needs a process group: call torch.distributed.init_process_group() "
            "first (torchrun sets the environment), or pass mesh=init_device_mesh(...)."
        )
    device = next((p.device for p in module.parameters()), torch.device("meta"))
    # A model built on the meta device is materialised later (to_empty) on the device the
    # process group serves: pick the mesh's device type from the backend, not from "meta".
    device_type = device.type if device.type != "meta" else _backend_device_type()
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _backend_device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _managed_params(module: nn.Module) -> dict[int, tuple[str, nn.Parameter]]:
    """Unsharded parameters of ``module`` by identity, each once (tied ones share an entry)."""
    found: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if shard_info(param) is not None:  # already owned by a submodule's fully_shard
            continue
        found.setdefault(id(param), (name, param))
    return found


def _reshards(choice: bool | None, block: str) -> bool:
    """Whether a parameter in the repeated block ``block`` ("" outside every block:
    ``records.repeated_block``) is freed after forward.

    NOTE: the reshard default
        ``reshard_after_forward=None`` (ZeRO-3) does what FSDP2 does with its root: a
        parameter inside a repeated block (``layers.3.``), or owned by a unit that an
        enclosing ``fully_shard`` call wraps (``_reshard_wrapped_units``), is freed after its
        forward use and gathered again in backward; the root's own parameters (embedding,
        final norm, output head) stay gathered from forward to backward, in one bucket
        (NOTE: bucket rules, in fsdp_compile/planner.py). They are read last in forward and first in backward, so
        freeing them buys little and costs one all-gather and one reduce-scatter per step
        more than FSDP2. ``True`` frees every parameter of the unit; ``False`` keeps all.
    """
    return choice if choice is not None else block != ""


def _reshard_wrapped_units(module: nn.Module) -> None:
    """Units inside ``module`` that were left to the default now reshard every parameter: an
    enclosing call makes them non-root units (see NOTE: the reshard default)."""
    for unit_module in module.modules():
        if unit_module is module or not getattr(unit_module, "_mfsdp_reshard_default", False):
            continue
        unit_module._mfsdp_reshard_default = False
        for param in unit_module.parameters():
            info = shard_info(param)
            if info is not None and info.unit == unit_module._mfsdp_unit and not info.reshard_after_forward:
                param._mfsdp = dataclasses.replace(info, reshard_after_forward=True)


def _float8_weights(module: nn.Module, strategy: str, experts) -> dict[int, Float8Gather]:
    """The float8 record of each float8 weight ``module`` holds, by parameter identity;
    checked here, before any process group is touched."""
    for name, expert_module in experts:
        if any(is_float8_weight(p) for p in expert_module.parameters()):
            raise UsageError(
                f"{name or type(module).__name__} holds float8 expert weights: expert-parallel "
                "experts are not gathered in float8. Leave them out of the conversion "
                "(convert_to_float8_training(..., module_filter_fn=...))."
            )
    found = {}
    for key, (fqn, param) in _managed_params(module).items():
        owner_path, _, name = fqn.rpartition(".")
        # A tensor-parallel float8 weight: torchao's wrapper is the DTensor's local piece.
        local = param.to_local() if isinstance(param, DTensor) else param
        float8 = float8_gather_of(module.get_submodule(owner_path), name, local, strategy)
        if float8 is not None:
            found[key] = float8
    return found


def _placements(strategy: str, mesh: DeviceMesh) -> list:
    if strategy not in GATHERING_STRATEGIES:
        return [Replicate()]
    return [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    strategy: Strategy = "optim_grads_params",
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecision | None = None,
    expert_mesh: DeviceMesh | None = None,
    shard_experts: bool = False,
    offload_policy: object = None,
    shard_placement_fn: object = None,
    ignored_params: object = None,
) -> nn.Module:
    """Shard every parameter of ``module`` not yet sharded over ``mesh``.

    ``strategy`` says what stays sharded between uses (docs/user_guide.md has the table):
    ``"optim_grads_params"`` (ZeRO-3, default) parameters, gradients and optimizer state;
    ``"optim_grads"`` (ZeRO-2) gradients and optimizer state: parameters are gathered once in
    forward and kept until backward is done; ``"optim"`` (ZeRO-1) only the optimizer state:
    gradients are all-reduced whole, each rank keeps its rows; ``"no_shard"`` (DDP) nothing:
    parameters are ``Replicate()`` DTensors and gradients are all-reduced.

    ``mesh`` is 1-D, or 2-D ``(replicate, shard)`` for HSDP: gathers and reduce-scatters stay
    in the shard dimension, gradients are then all-reduced across the replicate dimension.
    It holds every rank of the job, itself or as a dimension of a mesh that does (``mesh["dp"]``
    of a ``(dp, tp)`` mesh): a mesh leaving ranks out is refused on every rank (see
    ``sharding_checks._check_mesh_holds_every_rank``). Call it on submodules first (each call
    is a unit, a bucketing hint), then on the root; a call on a submodule after its root is
    refused. Parameters become DTensors (``Shard(0)``, or ``Replicate()`` for no_shard)
    holding this rank's rows; buffers stay replicated. A read of a sharded attribute while a
    module's call runs returns the full tensor, gathered; outside any module's call it returns
    the parameter itself, as under FSDP2 (NOTE: reads outside a forward). The gradient is
    averaged over the mesh and lands as ``.grad`` with the parameter's placements.
    ``reshard_after_forward`` (ZeRO-3 only) frees the gathered parameter after forward and
    gathers again in backward: ``True`` for every parameter of the unit, ``False`` for none;
    the default ``None`` frees those in repeated blocks and in wrapped units and keeps the
    root's own, as FSDP2 keeps its root (NOTE: the reshard default). ``mp_policy`` sets the
    dtypes of the gather and of the gradient reduction. A model built on the meta device is
    materialised after this call (``module.to_empty``); a forward on real inputs before that
    is refused (``sharding_checks.refuse_meta_parameters``).

    Modules marked ``expert_parallel_enabled = True`` are owned by expert parallelism over
    ``expert_mesh`` (``fsdp_compile.expert_mesh``; see fsdp_compile/expert_parallel.py and
    docs/moe.md): each EP rank keeps its experts, not sharded over ``mesh``, and their
    gradients are reduced over the ``edp`` group; ``shard_experts`` also shards them over
    ``edp`` with ``strategy``. FSDP2's ``offload_policy``, ``shard_placement_fn`` and
    ``ignored_params`` are taken where they ask for what this does anyway, else refused
    (``check_fsdp2_options``). A list of modules is one unit, as FSDP2 groups it (torchtitan's
    ``fully_shard([model.norm, model.output])``): their parameters may share a bucket, and
    ``set_requires_gradient_sync`` on one sets it for all. Returns ``module``.
    """
    modules = grouped_modules(module)
    for each in modules:  # every module checked before any is sharded
        check_fsdp2_options(each, offload_policy, shard_placement_fn, ignored_params)
        check_module(each, mesh)
        check_tensor_parallel(each, mesh)
    reshard_after_forward = check_strategy(strategy, reshard_after_forward, mesh)
    install_optimizer_guard()
    mp_policy = _mixed_precision(mp_policy)
    unit = unit_name(*modules)
    for each in modules:
        _shard_unit(each, unit, mesh, strategy, reshard_after_forward, mp_policy, expert_mesh, shard_experts)
        if len(modules) > 1:  # where a method called on one finds them all, as FSDP2's group
            each.__dict__["_mfsdp_unit_modules"] = tuple(modules)
    return module


def _shard_unit(
    module: nn.Module, unit: str, mesh: DeviceMesh | None, strategy: Strategy, reshard_after_forward: bool | None,
    mp_policy: MixedPrecision, expert_mesh: DeviceMesh | None, shard_experts: bool,
) -> None:
    """``fully_shard``'s work on one module of the unit ``unit``, its arguments checked."""
    marked = expert_modules(module)
    float8_weights = _float8_weights(module, strategy, marked)
    if marked:
        dense_ranks = set(mesh.mesh.flatten().tolist()) if mesh is not None else set(range(dist.get_world_size()))
        check_expert_parallel(marked, expert_mesh, dense_ranks, strategy, shard_experts)
    mesh = mesh if mesh is not None else _default_mesh(module)
    if mesh.device_type == "cpu":
        gather_cpu_tensors_one_work_each()  # every step's gathers on gloo (compat.py says why)
    checkpoint_rng_states_saved_as_tensors()  # per-block compiles under checkpoints (ditto)
    device_mesh_copies_run_untraced()  # a backward inside a function Dynamo traces (ditto)

    sharded: dict[int, nn.Parameter] = {}
    blocks = block_paths(module)
    for name, expert_module in marked:
        experts = assign_experts(name, expert_module, expert_mesh, strategy, shard_experts, unit_name(expert_module))
        for expert in experts:
            sharded[id(expert.param)] = _expert_shard(expert, repeated_block(expert.fqn, blocks), reshard_after_forward, mp_policy)
    for key, (fqn, param) in _managed_params(module).items():
        if key in sharded:
            continue
        if hasattr(param, "_mfsdp_sharded_as"):
            # Tied to a parameter an earlier (submodule) call already sharded: reuse that one.
            sharded[key] = param._mfsdp_sharded_as
            continue
        float8 = float8_weights.get(key)
        block = repeated_block(fqn, blocks)
        reshards = _reshards(reshard_after_forward, block)
        if isinstance(param, DTensor):  # placed by tensor parallelism (check_tensor_parallel)
            sharded[key] = _tensor_parallel_shard(param, fqn, block, unit, strategy, mesh, reshards, mp_policy, float8)
            continue
        info = _dense_info(param, fqn, block, unit, strategy, mesh, reshards, mp_policy, float8)
        # A float8 weight: the fp32 master inside torchao's wrapper is what is sharded.
        values = master_weight(param) if float8 else None
        sharded[key] = _shard(param, mesh, _placements(strategy, mesh), info, values)
    _swap_in(module, sharded)
    _reshard_wrapped_units(module)
    install_regions(module)
    install_outermost_hook(module)
    watch_meta_buffers(module)  # NOTE: non-persistent buffers after a meta init
    # An HF model decides its attention masks from its inputs' values before Dynamo traces
    # it (NOTE: HF's value-dependent decisions, made before the trace, in hf.py).
    install_prelude(module)
    _install_casts(module, mp_policy)
    module._mfsdp_unit = unit
    module._mfsdp_reshard_default = reshard_after_forward is None and strategy == "optim_grads_params"


def _mixed_precision(policy: object) -> MixedPrecision:
    """``mp_policy`` as a ``MixedPrecision``: FSDP2's ``MixedPrecisionPolicy`` has the same
    fields and meaning."""
    if policy is None:
        return MixedPrecision()
    if isinstance(policy, MixedPrecision):
        return policy
    if isinstance(policy, MixedPrecisionPolicy):
        return MixedPrecision(
            param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype, output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
    raise UsageError(
        f"mp_policy must be fsdp_compile.MixedPrecision (or FSDP2's MixedPrecisionPolicy), got "
        f"{type(policy).__name__}."
    )


def _install_casts(module: nn.Module, mp_policy: MixedPrecision) -> None:
    """FSDP2's casts at a unit's call, its hooks: the floating tensors ``module`` is called with
    to ``param_dtype`` (``cast_forward_inputs``), those it returns to ``output_dtype``; those
    of an earlier call on it come off first."""
    for handle in module.__dict__.pop("_mfsdp_cast_hooks", ()):
        handle.remove()
    hooks = []
    if mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None:
        cast = functools.partial(_cast_floating, mp_policy.param_dtype)
        hooks.append(module.register_forward_pre_hook(functools.partial(_cast_inputs, cast), with_kwargs=True))
    if mp_policy.output_dtype is not None:
        cast = functools.partial(_cast_floating, mp_policy.output_dtype)
        hooks.append(module.register_forward_hook(functools.partial(_cast_output, cast)))
    module._mfsdp_cast_hooks = tuple(hooks)


def _cast_floating(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


def _cast_inputs(cast, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tree_map_only(torch.Tensor, cast, args), tree_map_only(torch.Tensor, cast, kwargs)


def _cast_output(cast, module: nn.Module, args: tuple, output):
    return tree_map_only(torch.Tensor, cast, output)


def _dtypes(mp_policy: MixedPrecision, stored: torch.dtype) -> dict:
    """A record's dtype fields: the policy and what it resolves to for ``stored``."""
    param_dtype, reduce_dtype = mp_policy.resolve(stored)
    return {"mixed_precision": mp_policy, "param_dtype": param_dtype, "reduce_dtype": reduce_dtype}


def _dense_info(
    param: nn.Parameter, fqn: str, block: str, unit: str, strategy: Strategy, mesh: DeviceMesh, reshards: bool,
    mp_policy: MixedPrecision, float8: Float8Gather | None,
) -> ShardInfo:
    """The record of a parameter sharded over ``mesh``'s last dimension (replicated over its
    first on a 2-D HSDP mesh)."""
    shard_dim = mesh.ndim - 1
    replicate_group_name = mesh.get_group(0).group_name if mesh.ndim == 2 else ""
    return ShardInfo(
        param_id=next_param_id(),
        fqn=fqn,
        block=block,
        unit=unit,
        global_shape=tuple(param.shape),
        dtensor_shape=tuple(param.shape),
        strategy=strategy,
        group_name=mesh.get_group(shard_dim).group_name,
        world=mesh.size(shard_dim),
        replicate_group_name=replicate_group_name,
        replicate_world=mesh.size(0) if replicate_group_name else 1,
        grad_divisor=mesh.size(),
        reshard_after_forward=reshards,
        float8=float8,
        **_dtypes(mp_policy, param.dtype),
    )


def _tensor_parallel_shard(
    param: nn.Parameter, fqn: str, block: str, unit: str, strategy: Strategy, mesh: DeviceMesh, reshards: bool,
    mp_policy: MixedPrecision, float8: Float8Gather | None,
) -> nn.Parameter:
    """A parameter tensor parallelism placed (a DTensor on a 1-D tensor-parallel mesh),
    sharded over the data-parallel ``mesh`` too, as FSDP2 shards it: this rank's
    tensor-parallel piece cut by rows (over an HSDP mesh's shard dimension, replicated over
    its first), a DTensor on the meshes together, whose placement on the shard dimension is
    a ``_StridedShard`` where tensor parallelism also cut rows.
    Its gather runs over ``mesh`` alone and returns the tensor-parallel piece, which a read
    wraps as the DTensor tensor parallelism made (``TensorParallelRead``). A float8 weight's
    piece is torchao's wrapper: its fp32 master is what is sharded."""
    local = param.to_local()
    local = master_weight(local) if float8 else local
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    info = dataclasses.replace(
        _dense_info(local, fqn, block, unit, strategy, mesh, reshards, mp_policy, float8),
        dtensor_shape=tuple(param.shape),
        tensor_parallel=TensorParallelRead(
            tp_mesh, tp_placements, tuple(param.shape), param.stride(), tp_mesh.get_group().group_name
        ),
    )
    piece, dp_placements = local.detach(), [Replicate()] * mesh.ndim
    if strategy in GATHERING_STRATEGIES:  # on an HSDP mesh, over its shard dimension (the last)
        rows = padded_rows(local.shape[0], mesh.size(-1))
        piece = piece[mesh.get_local_rank(mesh.ndim - 1) * rows :][:rows]
        cut_rows = math.prod(tp_mesh.size(i) for i, p in enumerate(tp_placements) if p.is_shard(0))
        dp_placements[-1] = _StridedShard(0, split_factor=cut_rows) if cut_rows > 1 else Shard(0)
    dtensor = DTensor.from_local(
        piece, DeviceMesh._concatenate([mesh, tp_mesh]), (*dp_placements, *tp_placements),
        run_check=False, shape=param.shape, stride=param.stride(),
    )
    new_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    new_param._mfsdp = info
    param._mfsdp_sharded_as = new_param
    return new_param


def _swap_in(module: nn.Module, sharded: dict[int, nn.Parameter]) -> None:
    """Put each sharded parameter (``sharded``, by the identity of the one it replaces) in
    place in every submodule holding it, and give those submodules the gathering getters."""
    for submodule in module.modules():
        names = set()
        for name, param in list(submodule._parameters.items()):
            if param is not None and id(param) in sharded:
                submodule._parameters[name] = sharded[id(param)]
                names.add(name)
        if names or submodule is module:
            # The unit's own module gets the class too, for set_requires_gradient_sync.
            install_properties(submodule, names)
        elif hf_methods(type(submodule)):  # an HF model inside (model.model): its HF methods
            install_properties(submodule, names, fsdp2_methods=False)


def _shard(
    param: nn.Parameter, mesh: DeviceMesh, placements, info: ShardInfo, values: torch.Tensor | None = None
) -> nn.Parameter:
    """``param`` (or the ``values`` it stands for) as an ``nn.Parameter(DTensor)`` carrying
    its sharding record ``info``."""
    # Each rank already holds the full tensor, so cut locally (src_data_rank=None):
    # no broadcast runs and ranks must have been seeded alike, as with FSDP2.
    values = param if values is None else values
    dtensor = distribute_tensor(values.detach(), mesh, placements, src_data_rank=None)
    new_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    new_param._mfsdp = info
    # Modules outside this call may still hold ``param`` (ties across units): leave a
    # forwarding note so the root's call reuses this shard instead of sharding twice.
    param._mfsdp_sharded_as = new_param
    return new_param


def _expert_shard(
    expert: ExpertParam, block: str, reshard_after_forward: bool | None, mp_policy: MixedPrecision
) -> nn.Parameter:
    info = ShardInfo(
        param_id=next_param_id(),
        fqn=expert.fqn,
        block=block,
        unit=expert.unit,
        global_shape=expert.read_shape,
        dtensor_shape=tuple(expert.param.shape),
        strategy=expert.strategy,
        group_name=expert.group_name,
        world=expert.world,
        replicate_group_name="",
        replicate_world=1,
        grad_divisor=expert.grad_divisor,
        reshard_after_forward=(
            _reshards(reshard_after_forward, block) and expert.strategy == "optim_grads_params"
        ),
        ep_group_outside_mesh=expert.ep_group_outside_mesh,
        **_dtypes(mp_policy, expert.param.dtype),
    )
    return _shard(expert.param, expert.mesh, expert.placements, info)
