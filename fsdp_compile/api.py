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
import itertools
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_compile.compat import gather_cpu_tensors_one_work_each
from fsdp_compile.errors import UsageError
from fsdp_compile.expert_parallel import (
    ExpertParam,
    assign_experts,
    check_expert_parallel,
    expert_modules,
)
from fsdp_compile.float8 import Float8Gather, float8_gather_of, float8_weight, is_float8_weight, master_weight
from fsdp_compile.hf import install_prelude
from fsdp_compile.ops import GATHERING_STRATEGIES, STRATEGIES, Strategy
from fsdp_compile.optim_guard import install as install_optimizer_guard

__all__ = [
    "fully_shard",
    "MixedPrecision",
    "ShardInfo",
    "shard_info",
    "is_fully_sharded",
    "set_requires_gradient_sync",
    "gathered_params",
]


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Compute and communication dtypes (FSDP2's ``MixedPrecisionPolicy``, same names).

    The stored parameters, the optimizer's view and ``.grad`` keep the parameters' own dtype
    (fp32 main weights). Shards are cast to ``param_dtype`` before the all-gather (the wire
    carries ``param_dtype``), and gradients are reduced in ``reduce_dtype``.
    """

    param_dtype: torch.dtype | None = None
    """Dtype of gathered parameters and of the compute; None keeps the stored dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of the gradient reduce-scatter; None means ``param_dtype`` (as FSDP2)."""
    allow_lower_precision_reduce: bool = False
    """Opt in to ``reduce_dtype`` narrower than ``param_dtype`` (gradients lose precision)."""

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field_name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise UsageError(
                    f"MixedPrecision.{field_name} must be a floating torch.dtype such as "
                    f"torch.bfloat16, got {dtype!r}."
                )
            # float8 (any variant) and float4: no collective reduces them and no matmul
            # computes in them; torchao's float8 linears gather float8 weights themselves.
            if dtype is not None and dtype.itemsize < 2:
                raise UsageError(
                    f"MixedPrecision.{field_name}={dtype} is narrower than 16 bits: gathers, "
                    "gradient reductions and the compute cannot run in it. Float8 training "
                    "goes through torchao: convert_to_float8_training(model, config="
                    "Float8LinearConfig(enable_fsdp_float8_all_gather=True)) before fully_shard "
                    "gathers the converted weights in float8 (docs/user_guide.md, \"Float8 "
                    f"training\"); {field_name} must be a float of 16 bits or more, such as "
                    "torch.bfloat16."
                )
        narrower = (
            self.param_dtype is not None
            and self.reduce_dtype is not None
            and torch.finfo(self.reduce_dtype).bits < torch.finfo(self.param_dtype).bits
        )
        if narrower and not self.allow_lower_precision_reduce:
            raise UsageError(
                f"reduce_dtype={self.reduce_dtype} is narrower than param_dtype="
                f"{self.param_dtype}: gradients would be summed in less precision than the "
                "compute. Use reduce_dtype=torch.float32, or pass "
                "allow_lower_precision_reduce=True if that is intended."
            )

    def resolve(self, stored: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(param_dtype, reduce_dtype) for a parameter stored as ``stored``."""
        param_dtype = self.param_dtype or stored
        return param_dtype, self.reduce_dtype or param_dtype


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """What ``fully_shard`` decided for one parameter; read by the backend's planner."""

    param_id: int
    """Stable key the markers carry: creation order, identical on ranks that shard alike."""
    fqn: str
    """First name the parameter was found under, relative to the module ``fully_shard`` got."""
    unit: str
    """The ``fully_shard`` call that owns it, by that module's class and call number
    (``Block#3``; a bucketing hint)."""
    global_shape: tuple[int, ...]
    """Shape a read returns: the unsharded parameter, or for stacked expert-parallel weights
    only this EP rank's experts."""
    dtensor_shape: tuple[int, ...]
    """Shape of the stored DTensor (``global_shape`` but for stacked experts: all of them)."""
    strategy: Strategy
    """What stays sharded between uses (see ``fully_shard``)."""
    group_name: str
    """Process group the parameter is sharded over (the mesh's shard dimension); for
    ``no_shard`` the group its gradient is all-reduced over."""
    world: int
    """Ranks in that group."""
    replicate_group_name: str
    """HSDP: the group across replicas (the mesh's first dimension); "" without one."""
    replicate_world: int
    """Ranks in the replicate group (1 without one)."""
    grad_divisor: int
    """Ranks the gradient is averaged over: the mesh's size, or for expert-parallel parameters
    the whole data-parallel world (see NOTE: expert gradient scale, in expert_parallel.py)."""
    reshard_after_forward: bool
    """Free the gathered parameter after forward and gather again in backward (see NOTE: the
    reshard default)."""
    param_dtype: torch.dtype
    """Dtype on the wire and in the compute."""
    reduce_dtype: torch.dtype
    """Dtype of the gradient reduction."""
    float8: Float8Gather | None = None
    """A float8 linear's weight (torchao, ``enable_fsdp_float8_all_gather=True``): gathered
    in float8 and read as a ``Float8TrainingTensor`` computing in ``param_dtype`` (see NOTE:
    float8 gathers, in fsdp_compile/float8.py); None for every other parameter."""
    members: tuple[str, ...] = ()
    """A flat parameter's members (NOTE: flat parameters, in fsdp_compile/flat_params.py), by
    their names relative to the module ``fully_shard`` got; empty for every other parameter."""
    ep_group_outside_mesh: str = ""
    """An expert of an ``nn.ModuleList`` under expert parallelism: the EP group whose other
    ranks hold the layer's other experts. Its DTensor lives on the ``edp`` mesh, which does not
    show them, so a norm over all parameters must also sum over this group
    (``fsdp_compile.clip_grad_norm_``). "" for every other parameter."""


# The first "<name>.<index>." of a dotted path: a ModuleList / Sequential child, i.e. one block.
_BLOCK = re.compile(r"^(.*?\.\d+)\.")


def repeated_block(fqn: str) -> str:
    """The repeated block a dotted parameter path lies in (``layers.3`` of
    ``layers.3.attn.wqkv.weight``): its first ``ModuleList`` / ``Sequential`` child; "" for a
    parameter outside every block (an embedding, a final norm)."""
    match = _BLOCK.match(fqn)
    return match.group(1) if match else ""


def shard_info(param: object) -> ShardInfo | None:
    """The sharding record of a parameter ``fully_shard`` manages, else None."""
    return getattr(param, "_mfsdp", None)


def is_fully_sharded(module: nn.Module) -> bool:
    return getattr(module, "_mfsdp_unit", None) is not None


def _class_name(module: nn.Module) -> str:
    """The name of the class ``module`` was built as, not of the subclass fully_shard gave it."""
    return getattr(type(module), "_mfsdp_base", type(module)).__name__


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


def _check_module(module: nn.Module, mesh: DeviceMesh | None) -> None:
    """Every precondition, checked before any collective so no rank is left waiting."""
    if not isinstance(module, nn.Module):
        raise UsageError(f"fully_shard expects an nn.Module, got {type(module).__name__}.")
    if is_fully_sharded(module):
        raise UsageError(
            f"fully_shard was already called on this {type(module).__name__}; call it once per "
            "module (submodules first, then the root)."
        )
    owned = _sharded_by_an_enclosing_call(module)
    if owned is not None:
        name, info = owned
        raise UsageError(
            f"fully_shard on this {_class_name(module)} comes after fully_shard on a module "
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


def _managed_params(module: nn.Module) -> dict[int, tuple[str, nn.Parameter]]:
    """Unsharded parameters of ``module`` by identity, each once (tied ones share an entry)."""
    found: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if isinstance(param, DTensor):  # already owned by a submodule's fully_shard
            continue
        found.setdefault(id(param), (name, param))
    return found


# Markers carry this key so each joint-graph node names its parameter without guessing from
# graph positions; every rank must shard the same modules in the same order (as with FSDP2).
# Counters, not object ids or addresses: a fresh process that builds the model the same way
# (every rank, every restart) names every parameter and unit alike, so plans and the compile
# cache keys made from them agree across ranks and restarts.
_param_ids = itertools.count()
_unit_ids = itertools.count()


def next_param_id() -> int:
    """The next ``param_id`` (see ``_param_ids``), for a flat parameter a region makes."""
    return next(_param_ids)


def _unit_name(module: nn.Module) -> str:
    return f"{type(module).__name__}#{next(_unit_ids)}"

# Gradient accumulation state, by param_id (a tied parameter read through two modules has one
# entry). While sync is off a parameter has an accumulator: a full-shape leaf whose ``.grad``
# autograd sums the unreduced gradients into. Turning sync back on moves that sum to
# ``_pending``; the next read hands it to the marker, whose backward adds it before the one
# reduction. Module-level dicts, so Dynamo guards on them and recompiles when they change.
_accumulators: dict[int, torch.Tensor] = {}
_pending: dict[int, torch.Tensor] = {}


def marker_args(info: ShardInfo, stored_dtype: torch.dtype) -> tuple:
    """The ``unshard`` marker's constant arguments for a parameter (its ``ShardInfo``, its
    storage dtype), after the shard and the accumulation state."""
    return (
        info.param_id,
        info.global_shape[0],
        info.group_name,
        info.replicate_group_name,
        info.strategy,
        # A float8 weight is cast from its stored dtype, as torchao casts the master.
        info.param_dtype if info.float8 is None else stored_dtype,
        info.reduce_dtype,
        info.grad_divisor,
    )


def unshard_marker(local: torch.Tensor, constants: tuple) -> torch.Tensor:
    """The ``unshard`` marker on a parameter's local shard: a real collective when run eagerly,
    one graph node when traced. ``constants``: ``marker_args(info, param.dtype)``, whose first
    field is the parameter's id."""
    param_id = constants[0]
    # Read the accumulation state only when there is some: a read of a global dict is a
    # guard, and a pop a side effect Dynamo records, for every parameter of every layer.
    # The op itself, not the custom_op object, whose Python __call__ Dynamo would trace for
    # every parameter of every layer (3% of Dynamo's time on a 32-layer HF Llama, profiled).
    return torch.ops.fsdp_compile.unshard.default(
        local,
        _accumulators.get(param_id) if _accumulators else None,
        _pending.pop(param_id, None) if _pending else None,
        *constants,
    )


def gather(param: nn.Parameter, info: ShardInfo) -> torch.Tensor:
    """``param`` (its sharding record ``info``) gathered for use: the ``unshard`` marker, then,
    for a float8 weight, its float8 wrapper."""
    try:
        gathered = unshard_marker(param.to_local(), marker_args(info, param.dtype))
        return gathered if info.float8 is None else float8_weight(gathered, info.float8, info.param_dtype)
    except AttributeError as error:
        # An AttributeError escaping a property makes Python fall back to
        # nn.Module.__getattr__, which would silently hand the *shard* to the caller.
        raise RuntimeError(f"gathering parameter {info.fqn} failed: {error}") from error


def _gathered(self: nn.Module, name: str) -> torch.Tensor:
    """What reading a sharded attribute returns: the gathered parameter.

    A plain tensor (not an ``nn.Parameter``) in ``_parameters`` is returned as it is: a
    repeated block's body finds there the weights its wrapper gathered (see NOTE: one body
    per repeated block, in fsdp_compile/regions.py), and ``torch.func.functional_call`` its
    substitutes.
    """
    param = self._parameters[name]
    if not isinstance(param, nn.Parameter) and isinstance(param, torch.Tensor):
        return param
    info = shard_info(param)
    # isinstance and shape only: Dynamo traces this getter, and both are cheap guards for it.
    if info is None or not isinstance(param, DTensor) or tuple(param.shape) != info.dtensor_shape:
        raise UsageError(
            f"{type(self).__name__}.{name} was replaced after fully_shard (now "
            f"{type(param).__name__} of shape {tuple(param.shape)}); sharding happens once. "
            "Change the model before calling fully_shard, or copy new values into the shard "
            "(param.to_local().copy_(...))."
        )
    return gather(param, info)


# Inside a compiled frame Dynamo inlines the getter, and the marker's sizes are constants of
# that graph. Called from eager code (a frame Dynamo fell back on), the getter must run eagerly
# too: compiled as a frame of its own, its int arguments would turn symbolic after the second
# parameter and the marker would lose its static sizes.
torch._dynamo.eval_frame.skip_code(_gathered.__code__)
torch._dynamo.eval_frame.skip_code(gather.__code__)
torch._dynamo.eval_frame.skip_code(unshard_marker.__code__)


def _reattach_shard_info(self: nn.Module, fn, recurse: bool = True):
    """``nn.Module._apply`` (``to_empty``, ``.to``, ``.cuda``, ``.float``) may wrap converted
    tensors in new Parameter objects; give them back their sharding record."""
    records = {name: shard_info(p) for name, p in self._parameters.items() if shard_info(p) is not None}
    result = self._mfsdp_base._apply(self, fn, recurse)
    for name, info in records.items():
        param = self._parameters[name]
        if param is not None and shard_info(param) is None:
            param._mfsdp = info
    return result


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction off for the micro-batches before the last, and back on for it.

    With sync off, backward runs no collective: each parameter's full, unreduced gradient is
    summed locally (in ``reduce_dtype``; this costs one full-size gradient per parameter, as in
    FSDP2). Turning sync on again makes the next forward/backward reduce that sum together with
    its own gradient, once. Applies to every sharded parameter under ``module``; also a method
    of modules ``fully_shard`` returned (``model.set_requires_gradient_sync(False)``).
    """
    if not isinstance(requires_gradient_sync, bool):
        raise UsageError(
            f"set_requires_gradient_sync takes True or False, got {requires_gradient_sync!r}."
        )
    for param in gathered_params(module):
        info = shard_info(param)
        if info is None or not param.requires_grad:
            continue
        if not requires_gradient_sync:
            if info.param_id not in _accumulators:
                _accumulators[info.param_id] = _accumulator(param, info)
            continue
        accumulator = _accumulators.pop(info.param_id, None)
        if accumulator is not None and accumulator.grad is not None:
            _pending[info.param_id] = accumulator.grad


def gathered_params(module: nn.Module) -> list[nn.Parameter]:
    """The sharded tensors a step gathers for ``module``, each once: its parameters, except
    that the members of a flat parameter (NOTE: flat parameters, in flat_params.py) are
    gathered, and their gradients reduced, as that flat."""
    return list(dict.fromkeys(getattr(p, "_mfsdp_flat", p) for p in module.parameters()))


def _accumulator(param: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    # A full-shape leaf over one element of storage: only its .grad (full size) costs memory.
    one = torch.zeros((), dtype=info.reduce_dtype, device=param.device)
    return one.expand(info.global_shape).requires_grad_(True)


def _set_requires_gradient_sync(self: nn.Module, requires_gradient_sync: bool) -> None:
    set_requires_gradient_sync(self, requires_gradient_sync)


_set_requires_gradient_sync.__doc__ = set_requires_gradient_sync.__doc__


# One generated class per (base class, sharded names): the properties read each instance's own
# parameters, so every block of a repeated class shares its classes, which lets a compiled
# body serve them all (see fsdp_compile/regions.py). Classes only: no instance state here.
_SHARDED_CLASSES: dict[tuple[type, frozenset[str]], type] = {}


def _install_properties(module: nn.Module, names: set[str]) -> None:
    """Swap ``module``'s class for a subclass whose attributes ``names`` read parameters
    gathered."""
    cls = module.__class__
    base = getattr(cls, "_mfsdp_base", cls)
    names = frozenset(getattr(cls, "_mfsdp_names", frozenset()) | names)
    if (base, names) not in _SHARDED_CLASSES:
        namespace = {
            **{name: property(functools.partial(_gathered, name=name)) for name in names},
            "_mfsdp_base": base,
            "_mfsdp_names": names,
            "_apply": _reattach_shard_info,
            "set_requires_gradient_sync": _set_requires_gradient_sync,
            # Printed as the user's class: libraries key registries on str(cls) (HF's output
            # recorders), and the class is the user's but for the getters.
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        }
        _SHARDED_CLASSES[base, names] = type(f"Sharded{base.__name__}", (base,), namespace)
    module.__class__ = _SHARDED_CLASSES[base, names]


def _check_strategy(
    strategy: object, reshard_after_forward: object, mesh: DeviceMesh | None
) -> bool | None:
    """The strategy's checks; returns ``reshard_after_forward`` for this strategy: False where
    the strategy keeps gathered parameters, None where NOTE: the reshard default decides."""
    if strategy not in STRATEGIES:
        raise UsageError(
            f"unknown strategy {strategy!r}; fully_shard takes one of {', '.join(STRATEGIES)} "
            "(default optim_grads_params, ZeRO-3)."
        )
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


def _reshards(choice: bool | None, fqn: str) -> bool:
    """Whether the parameter at ``fqn`` (relative to the module ``fully_shard`` got) is freed
    after forward.

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
    return choice if choice is not None else repeated_block(fqn) != ""


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


def _check_materialised_at_the_outermost_unit(module: nn.Module) -> None:
    """``_refuse_meta_parameters`` runs before the forward of ``module``, and no longer before
    those of the units inside it: once a step, from the module it is called on."""
    for unit_module in module.modules():
        handle = unit_module.__dict__.pop("_mfsdp_meta_check", None)
        if handle is not None:
            handle.remove()
    module._mfsdp_meta_check = module.register_forward_pre_hook(
        _refuse_meta_parameters, prepend=True, with_kwargs=True
    )


def _refuse_meta_parameters(module: nn.Module, args: tuple, kwargs: dict) -> None:
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
            f"the parameters of this {_class_name(module)} are still on the meta device, its "
            f"inputs on {device}: materialise the model after fully_shard, "
            f"model.to_empty(device={device.type!r}), then load its weights "
            "(set_model_state_dict) or initialise the parameters in place (docs/user_guide.md, "
            "\"meta-device init\")."
        )


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
        float8 = float8_gather_of(module.get_submodule(owner_path), name, param, strategy)
        if float8 is not None:
            found[key] = float8
    return found


def _placements(strategy: str, mesh: DeviceMesh) -> list:
    if strategy not in GATHERING_STRATEGIES:
        return [Replicate()]
    return [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    strategy: Strategy = "optim_grads_params",
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecision | None = None,
    expert_mesh: DeviceMesh | None = None,
    shard_experts: bool = False,
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
    ``_check_mesh_holds_every_rank``). Call it on submodules first (each call is a unit, a
    bucketing hint), then on the root; a call on a submodule after its root is refused.
    Parameters become DTensors (``Shard(0)``, or ``Replicate()`` for no_shard) holding this
    rank's rows; buffers stay replicated. Reads of a sharded attribute return the full tensor,
    gathered; its gradient is averaged over the mesh and lands as ``.grad`` with the
    parameter's placements. ``reshard_after_forward`` (ZeRO-3 only) frees the gathered
    parameter after forward and gathers again in backward: ``True`` for every parameter of the
    unit, ``False`` for none; the default ``None`` frees those in repeated blocks and in
    wrapped units and keeps the root's own, as FSDP2 keeps its root (NOTE: the reshard
    default). ``mp_policy`` sets the dtypes of the gather and of the gradient reduction. A
    model built on the meta device is materialised after this call (``module.to_empty``); a
    forward on real inputs before that is refused (``_refuse_meta_parameters``).

    Modules marked ``expert_parallel_enabled = True`` are owned by expert parallelism over
    ``expert_mesh`` (``fsdp_compile.expert_mesh``; see fsdp_compile/expert_parallel.py and
    docs/moe.md): each EP rank keeps its experts, not sharded over ``mesh``, and their
    gradients are reduced over the ``edp`` group; ``shard_experts`` also shards them over
    ``edp`` with ``strategy``. Returns ``module``.
    """
    _check_module(module, mesh)
    reshard_after_forward = _check_strategy(strategy, reshard_after_forward, mesh)
    install_optimizer_guard()
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecision):
        raise UsageError(
            f"mp_policy must be fsdp_compile.MixedPrecision, got {type(mp_policy).__name__}."
        )
    mp_policy = mp_policy or MixedPrecision()
    marked = expert_modules(module)
    float8_weights = _float8_weights(module, strategy, marked)
    if marked:
        dense_world = mesh.size() if mesh is not None else dist.get_world_size()
        check_expert_parallel(marked, expert_mesh, dense_world, strategy, shard_experts)
    mesh = mesh if mesh is not None else _default_mesh(module)
    if mesh.device_type == "cpu":
        gather_cpu_tensors_one_work_each()  # every step's gathers on gloo (compat.py says why)
    shard_dim = mesh.ndim - 1
    group_name = mesh.get_group(shard_dim).group_name
    replicate_group_name = mesh.get_group(0).group_name if mesh.ndim == 2 else ""
    placements = _placements(strategy, mesh)
    unit = _unit_name(module)

    sharded: dict[int, nn.Parameter] = {}
    for name, expert_module in marked:
        experts = assign_experts(name, expert_module, expert_mesh, strategy, shard_experts, _unit_name(expert_module))
        for expert in experts:
            sharded[id(expert.param)] = _expert_shard(expert, reshard_after_forward, mp_policy)
    for key, (fqn, param) in _managed_params(module).items():
        if key in sharded:
            continue
        if hasattr(param, "_mfsdp_sharded_as"):
            # Tied to a parameter an earlier (submodule) call already sharded: reuse that one.
            sharded[key] = param._mfsdp_sharded_as
            continue
        float8 = float8_weights.get(key)
        info = ShardInfo(
            param_id=next(_param_ids),
            fqn=fqn,
            unit=unit,
            global_shape=tuple(param.shape),
            dtensor_shape=tuple(param.shape),
            strategy=strategy,
            group_name=group_name,
            world=mesh.size(shard_dim),
            replicate_group_name=replicate_group_name,
            replicate_world=mesh.size(0) if replicate_group_name else 1,
            grad_divisor=mesh.size(),
            reshard_after_forward=_reshards(reshard_after_forward, fqn),
            float8=float8,
            **dict(zip(("param_dtype", "reduce_dtype"), mp_policy.resolve(param.dtype))),
        )
        # A float8 weight: the fp32 master inside torchao's wrapper is what is sharded.
        sharded[key] = _shard(param, mesh, placements, info, master_weight(param) if float8 else None)

    for submodule in module.modules():
        names = set()
        for name, param in list(submodule._parameters.items()):
            if param is not None and id(param) in sharded:
                submodule._parameters[name] = sharded[id(param)]
                names.add(name)
        if names or submodule is module:
            # The unit's own module gets the class too, for set_requires_gradient_sync.
            _install_properties(submodule, names)
    _reshard_wrapped_units(module)
    _check_materialised_at_the_outermost_unit(module)
    from fsdp_compile.regions import install_regions  # regions build on this module

    install_regions(module)
    # An HF model decides its attention masks from its inputs' values before Dynamo traces
    # it (NOTE: HF's value-dependent decisions, made before the trace, in hf.py).
    install_prelude(module)
    module._mfsdp_unit = unit
    module._mfsdp_reshard_default = reshard_after_forward is None and strategy == "optim_grads_params"
    return module


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
    expert: ExpertParam, reshard_after_forward: bool | None, mp_policy: MixedPrecision
) -> nn.Parameter:
    info = ShardInfo(
        param_id=next(_param_ids),
        fqn=expert.fqn,
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
            _reshards(reshard_after_forward, expert.fqn) and expert.strategy == "optim_grads_params"
        ),
        ep_group_outside_mesh=expert.ep_group_outside_mesh,
        **dict(zip(("param_dtype", "reduce_dtype"), mp_policy.resolve(expert.param.dtype))),
    )
    return _shard(expert.param, expert.mesh, expert.placements, info)
