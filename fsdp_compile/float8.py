"""Float8 weights gathered in float8: torchao's float8 linears under fully_shard.

A model converted with ``torchao.float8.convert_to_float8_training(model,
config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))`` holds each converted linear's
weight as a ``WeightWithDynamicFloat8CastTensor`` around its fp32 master. ``fully_shard``
shards the master itself (the optimizer, ``state_dict`` and DCP see plain fp32 shards) and
keeps what the cast needs in ``Float8Gather``; reading the weight returns a
``Float8TrainingTensor``, which the float8 linear multiplies without casting it again.

NOTE: float8 gathers
    The scale is torchao's tensorwise dynamic scale of the *whole* weight, computed from the
    max over every shard in the step that uses it: each rank takes the max of ``abs`` of its
    shard, one all-reduce (MAX) per bucket agrees on the weight's amax, and every rank
    computes the same scale. Then each rank casts its own shard to float8 and the all-gather
    moves float8 bytes (half of bf16's; as ``uint8``, the type gloo and NCCL move), and the
    gathered bytes and the scale make the ``Float8TrainingTensor``. The max is exact, so the
    gathered weight is bit for bit the one the unsharded float8 model casts.

    Why not torchao's other choice, a scale precomputed after the optimizer step
    (``precompute_float8_dynamic_scale_for_fsdp``): it is a call the user must remember
    after every step (forgotten, the weights are cast with stale scales, silently), it runs
    outside the compiled step, and it needs its own all-reduce anyway. In the graph the
    amax all-reduce is a few bytes per bucket, issued with the bucket's gather.

    A weight tensor parallelism split (NOTE: tensor-parallel blocks, in region_body.py) is
    gathered over "dp" as this rank's piece, and the piece's max is then reduced over "tp"
    too, so the scale is still the whole weight's: the unsharded float8 model's, and torchao's
    when it splits the model over "tp" alone. (FSDP2 + torchao reduces the max over FSDP's
    mesh only, so there each piece gets a scale of its own.) The maxes over "tp" are a second
    all-reduce per bucket, never merged with the one over "dp" (their groups differ), which
    asks every split to be even (``_check_even_splits``, sharding_checks.py); the gathered
    float8 piece is read as the tensor-parallel DTensor around the ``Float8TrainingTensor``.

    A bucket may hold float8 weights beside other parameters (their unit's norms): the
    bucket key is the compute dtype, and the bucket's gather packs each member's bytes as
    they are (NOTE: bucket layout, in passes/bucket_collectives.py), so float8 costs no
    extra collective.

    Traced, a read is ``unshard`` (the marker, in the stored dtype) then ``float8_cast``
    (below); ``lower_collectives`` turns the pair into the amax all-reduce, the cast of the
    shard and the float8 gather. Run eagerly (no compiler) the marker gathers the stored
    dtype and the cast follows: the same numbers, more bytes on the wire. The gradient goes
    straight through the cast (torchao's convention) to the marker, whose backward reduces
    it as for any parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from fsdp_compile.errors import UsageError

__all__ = [
    "Float8Gather", "float8_gather_of", "is_float8_weight", "master_weight", "float8_weight", "float8_from_parts",
    "amax", "scale", "cast", "float8_extra_missing",
]

# torch._scaled_mm takes operands whose both dims are multiples of 16.
_SCALED_MM_MULTIPLE = 16


@dataclass(frozen=True, kw_only=True)
class Float8Gather:
    """How a float8 linear's weight is cast: torchao's settings for it."""

    dtype: torch.dtype
    """The float8 dtype of the gathered weight (``float8_e4m3fn`` by torchao's default)."""
    round_scales_to_power_of_2: bool
    """torchao's ``Float8LinearConfig.round_scales_to_power_of_2``."""
    linear_mm_config: object
    """torchao's ``LinearMMConfig`` for the weight's matmuls (a named tuple)."""


def float8_extra_missing() -> str:
    return (
        "float8 training needs torchao: pip install 'fsdp_compile[float8]' "
        "(or pip install torchao)."
    )


def is_float8_weight(param: object) -> bool:
    """A weight torchao converted for float8 all-gather (none exists without torchao)."""
    if type(param).__name__ != "WeightWithDynamicFloat8CastTensor":  # no import for the rest
        return False
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return isinstance(param, WeightWithDynamicFloat8CastTensor)


def float8_gather_of(module: nn.Module, name: str, param: nn.Parameter, strategy: str) -> Float8Gather | None:
    """The float8 record of ``module.<name>`` when it is a weight torchao converted for float8
    all-gather, else None. Raises ``UsageError`` where it cannot be gathered in float8."""
    if not is_float8_weight(param):
        return None
    where = f"{type(module).__name__}.{name}"
    if strategy == "no_shard":
        raise UsageError(
            f"{where} is a float8 weight (enable_fsdp_float8_all_gather=True), but "
            "strategy='no_shard' gathers nothing: use a sharded strategy, or convert with "
            "Float8LinearConfig(enable_fsdp_float8_all_gather=False)."
        )
    if param.ndim != 2 or any(size % _SCALED_MM_MULTIPLE for size in param.shape):
        raise UsageError(
            f"{where} has shape {tuple(param.shape)}; the float8 matmul (torch._scaled_mm) "
            f"takes weights whose dims are multiples of {_SCALED_MM_MULTIPLE}. Leave this "
            "linear out of the conversion (convert_to_float8_training(..., module_filter_fn=...))."
        )
    config = getattr(module, "config", None)
    return Float8Gather(
        dtype=param._dtype,
        round_scales_to_power_of_2=bool(getattr(config, "round_scales_to_power_of_2", False)),
        linear_mm_config=param._linear_mm_config,
    )


def master_weight(param: nn.Parameter) -> Tensor:
    """The fp32 master a float8 weight wraps (what is sharded and saved)."""
    return param._tensor


def scale(weight_amax: Tensor, dtype: torch.dtype, round_scales_to_power_of_2: bool) -> Tensor:
    from torchao.float8.float8_utils import amax_to_scale

    return amax_to_scale(weight_amax, dtype, round_scales_to_power_of_2)


def cast(tensor: Tensor, weight_scale: Tensor, dtype: torch.dtype) -> Tensor:
    # As torchao's _ToFloat8ConstrFunc: upcast, scale, saturate.
    from torchao.float8.float8_utils import to_fp8_saturated

    return to_fp8_saturated(tensor.to(torch.float32) * weight_scale, dtype)


def amax(tensor: Tensor) -> Tensor:
    from torchao.float8.float8_utils import tensor_to_amax

    return tensor_to_amax(tensor)


def amax_over(local_amax: Tensor, group_name: str) -> Tensor:
    """The max of every rank's ``local_amax`` over ``group_name``'s ranks."""
    return funcol.wait_tensor(funcol.all_reduce(local_amax, "max", group_name))


@torch.library.custom_op("fsdp_compile::float8_cast", mutates_args=())
def float8_cast(
    weight: Tensor, dtype: torch.dtype, round_scales_to_power_of_2: bool, tensor_parallel_group: str
) -> tuple[Tensor, Tensor]:
    """The whole ``weight`` cast to float8 with torchao's tensorwise dynamic scale:
    ``(data, scale)``. ``tensor_parallel_group``: where ``weight`` is this rank's
    tensor-parallel piece, the group holding the other pieces, whose max the scale takes too;
    "" otherwise. Traced, it follows the ``unshard`` marker, and lower_collectives casts the
    shard before the gather instead (see NOTE: float8 gathers)."""
    weight_amax = amax(weight)
    if tensor_parallel_group:
        weight_amax = amax_over(weight_amax, tensor_parallel_group)
    weight_scale = scale(weight_amax, dtype, round_scales_to_power_of_2)
    return cast(weight, weight_scale, dtype), weight_scale


@float8_cast.register_fake
def _(weight, dtype, round_scales_to_power_of_2, tensor_parallel_group):
    return weight.new_empty(weight.shape, dtype=dtype), weight.new_empty((), dtype=torch.float32)


FLOAT8_CAST = torch.ops.fsdp_compile.float8_cast.default


def _training_tensor(data: Tensor, weight_scale: Tensor, cast: Float8Gather, orig_dtype: torch.dtype) -> Tensor:
    """torchao's ``Float8TrainingTensor`` of a weight's float8 ``data`` and scale."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    return Float8TrainingTensor(data, weight_scale, orig_dtype, cast.linear_mm_config, GemmInputRole.WEIGHT)


class _Float8Weight(torch.autograd.Function):
    """The gathered weight as torchao's ``Float8TrainingTensor``; the gradient passes straight
    through to the gathered high-precision weight (torchao's convention for its casts)."""

    @staticmethod
    def forward(ctx, gathered: Tensor, cast: Float8Gather, orig_dtype: torch.dtype, tensor_parallel_group: str):
        # The op, not the custom_op object: that one's Python __call__ would be traced too.
        data, weight_scale = torch.ops.fsdp_compile.float8_cast.default(
            gathered, cast.dtype, cast.round_scales_to_power_of_2, tensor_parallel_group
        )
        return _training_tensor(data, weight_scale, cast, orig_dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


def float8_weight(gathered: Tensor, cast: Float8Gather, orig_dtype: torch.dtype, tensor_parallel_group: str = "") -> Tensor:
    """``gathered`` (the marker's output, stored dtype) as a float8 weight whose matmuls
    compute in ``orig_dtype``; a tensor-parallel piece (``tensor_parallel_group``: the group
    of the other pieces) is scaled as the whole weight is."""
    return _Float8Weight.apply(gathered, cast, orig_dtype, tensor_parallel_group)


class _Float8FromParts(torch.autograd.Function):
    """A gathered float8 weight, from its float8 data and scale, as a block's body reads it;
    its gradient goes to ``carrier`` (NOTE: float8 weights in a block call, in block_call.py)."""

    @staticmethod
    def forward(ctx, carrier: Tensor, data: Tensor, weight_scale: Tensor, cast: Float8Gather, orig_dtype: torch.dtype):
        return _training_tensor(data, weight_scale, cast, orig_dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None, None


def float8_from_parts(
    data: Tensor, weight_scale: Tensor, cast: Float8Gather, orig_dtype: torch.dtype, carrier: Tensor | None
) -> Tensor:
    """The ``Float8TrainingTensor`` of a gathered weight's float8 ``data`` and its scale, whose
    gradient (in ``orig_dtype``, the weight's shape) reaches ``carrier``: a leaf of that dtype
    and shape, of no storage to speak of (all strides 0). None: no gradient is taken."""
    if carrier is None:
        return _training_tensor(data, weight_scale, cast, orig_dtype)
    return _Float8FromParts.apply(carrier, data, weight_scale, cast, orig_dtype)
