"""The records ``fully_shard`` leaves for the compiler: a parameter's ``ShardInfo`` (on the
parameter object, ``param._mfsdp``), the ``MixedPrecision`` policy, and the queries on them.

The bottom of the package: everything that reads what ``fully_shard`` decided imports this,
and this imports nothing of the package's but its errors, the strategies and float8's record.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_compile.errors import UsageError
from fsdp_compile.float8 import Float8Gather
from fsdp_compile.markers import Strategy


__all__ = ["MixedPrecision", "ShardInfo", "shard_info", "is_fully_sharded", "gathered_params", "repeated_block"]


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Compute and communication dtypes (FSDP2's ``MixedPrecisionPolicy``, same names and
    meaning; ``fully_shard`` takes that too).

    The stored parameters, the optimizer's view and ``.grad`` keep the parameters' own dtype
    (fp32 main weights). Shards are cast to ``param_dtype`` before the all-gather (the wire
    carries ``param_dtype``), and gradients are reduced in ``reduce_dtype``. As under FSDP2,
    each module ``fully_shard`` is called on casts the floating tensors it is called with to
    ``param_dtype`` (``cast_forward_inputs``), and what it returns to ``output_dtype``.
    """

    param_dtype: torch.dtype | None = None
    """Dtype of gathered parameters and of the compute; None keeps the stored dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of the gradient reduce-scatter; None means ``param_dtype`` (as FSDP2)."""
    output_dtype: torch.dtype | None = None
    """Dtype the floating tensors a sharded module returns are cast to; None leaves them."""
    cast_forward_inputs: bool = True
    """Whether a sharded module casts the floating tensors it is called with to ``param_dtype``
    (where that is set)."""
    allow_lower_precision_reduce: bool = False
    """Opt in to ``reduce_dtype`` narrower than ``param_dtype`` (gradients lose precision)."""

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype", "output_dtype"):
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


@dataclass(frozen=True)
class TensorParallelRead:
    """A tensor-parallel parameter as ``parallelize_module`` left it: what a read wraps the
    data-parallel gather (this rank's tensor-parallel piece) into."""

    mesh: DeviceMesh
    """The tensor-parallel mesh."""
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    group_name: str
    """The tensor-parallel group: the collectives DTensor traces for this parameter's layer
    run on it (``explain`` and the simulator count them apart from the data-parallel ones)."""

    def read(self, piece: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            piece, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


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
    block: str
    """The repeated block it lies in, by its path relative to the module ``fully_shard`` got
    (``repeated_block``); "" outside every block. The reshard default and the buckets read it."""
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
    mixed_precision: MixedPrecision = MixedPrecision()
    """The policy ``fully_shard`` got: ``param_dtype`` and ``reduce_dtype`` are it resolved
    for the stored dtype, again whenever that changes (``stored_as``)."""
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
    tensor_parallel: TensorParallelRead | None = None
    """A tensor-parallel parameter: what its gather returns is this rank's piece of it, read
    as a DTensor on the tensor-parallel mesh; None for every other parameter."""

    accumulation: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """The parameter's gradient-accumulation state, the record's one mutable field (see
    ``set_requires_gradient_sync``): its ``"accumulator"`` while sync is off, then its
    ``"pending"`` sum until the next read takes it. Owned by the parameter it describes, so
    two models never see each other's, and carried wherever the record is."""

    def stored_as(self, dtype: torch.dtype) -> ShardInfo:
        """This record once the parameter is stored as ``dtype`` (``model.to(torch.bfloat16)``
        after ``fully_shard``): the policy resolved again, as for a parameter sharded in
        ``dtype``, so the step computes in what the unsharded model would."""
        param_dtype, reduce_dtype = self.mixed_precision.resolve(dtype)
        if (param_dtype, reduce_dtype) == (self.param_dtype, self.reduce_dtype):
            return self
        return dataclasses.replace(self, param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def alike(self) -> ShardInfo:
        """This record less what names one parameter (its id, path and shapes): equal for
        parameters sharded alike in every other respect."""
        return dataclasses.replace(self, param_id=0, fqn="", global_shape=(), dtensor_shape=())


_STACKS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def block_paths(module: nn.Module) -> frozenset[str]:
    """The paths, relative to ``module``, of the blocks ``repeated_block`` reads a
    parameter's from: every child a stack inside ``module`` (``module`` too) holds, but
    stacks of their own (a list, a dict keyed by index); a dict keyed by name in a list is
    one layer's parts, its forward the caller's loop, and a block."""
    paths = {id(m): name for name, m in module.named_modules()}
    return frozenset(paths[id(child)] for stack in module.modules() for child in _stacked(stack) if not _is_stack_of_its_own(child))


def _is_stack_of_its_own(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList) or (isinstance(module, nn.ModuleDict) and bool(_stacked(module)))


def repeated_block(fqn: str, blocks: frozenset[str]) -> str:
    """The repeated block a dotted parameter path lies in: the outermost of ``blocks``
    (``block_paths``) that holds it (``layers.3`` of ``layers.3.attn.wqkv.weight``; in a stack
    of lists, ``groups.0.3``), "" for a parameter outside every block (an embedding, a final
    norm)."""
    parts = fqn.split(".")
    return next((p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in blocks), "")


def _stacked(module: nn.Module) -> list[nn.Module]:
    """The children ``module`` stacks, if it is a ModuleList, Sequential or ModuleDict (a
    ModuleDict's only where keyed by index, as torchtitan keys its layers; the parts nanoGPT
    names ``wte`` and ``wpe`` are no layers)."""
    if not isinstance(module, _STACKS):
        return []
    any_key = not isinstance(module, nn.ModuleDict)
    return [c for key, c in module.named_children() if any_key or key.isdigit()]


def stack_layers(module: nn.Module) -> list[nn.Module]:
    """The layers ``module`` stacks (``_stacked``) that have a forward: not those that are
    lists or dicts themselves, whose own children are the layers. A layer in torch's
    ``checkpoint_wrapper`` (torchtitan's activation checkpointing) is the module it runs:
    its gathers then run inside the checkpoint, in the forward and again in the recompute,
    as in HF's checkpointed layers (a selective checkpoint matches the recompute's ops to
    the forward's one by one)."""
    return [_run_by_wrapper(c) for c in _stacked(module) if not isinstance(c, (nn.ModuleList, nn.ModuleDict))]


def _run_by_wrapper(layer: nn.Module) -> nn.Module:
    while isinstance(layer, CheckpointWrapper):
        layer = layer._checkpoint_wrapped_module
    return layer


def shard_info(param: object) -> ShardInfo | None:
    """The sharding record of a parameter ``fully_shard`` manages, else None."""
    return getattr(param, "_mfsdp", None)


def built_class_name(module: nn.Module) -> str:
    """The name of the class ``module`` was built as, not of the subclass fully_shard gave it
    (``gathered_reads.install_properties``)."""
    return getattr(type(module), "_mfsdp_base", type(module)).__name__


def is_fully_sharded(module: nn.Module) -> bool:
    # Its own attribute: a wrapper passing lookups to the sharded model it holds (PEFT's
    # PeftModel) is not sharded itself.
    return vars(module).get("_mfsdp_unit") is not None


def is_outermost_unit(module: nn.Module) -> bool:
    """Whether ``module`` is the outermost one ``fully_shard`` was called on, the model's root:
    ``outermost_unit.install_outermost_hook`` hangs its hook there alone."""
    return "_mfsdp_outermost_hooks" in vars(module)


def gathered_params(module: nn.Module) -> list[nn.Parameter]:
    """The sharded tensors a step gathers for ``module``, each once: its parameters, except
    that the members of a flat parameter (NOTE: flat parameters, in flat_params.py) are
    gathered, and their gradients reduced, as that flat."""
    return list(dict.fromkeys(getattr(p, "_mfsdp_flat", p) for p in module.parameters()))


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


def unit_name(*modules: nn.Module) -> str:
    """A new unit's name: its modules' classes (several: FSDP2's grouping) and a call number."""
    return f"{'+'.join(type(module).__name__ for module in modules)}#{next(_unit_ids)}"
