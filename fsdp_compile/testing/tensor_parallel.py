"""Tensor-parallel plans for the tests and the simulator's estimates (docs/design.md, "Async
tensor parallelism: the next step")."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def hf_llama_sequence_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron's sequence parallelism on HF Llama, as torchtitan splits its Llama: the
    embedding's output, the norms and the residual stream sharded over the sequence
    (``SequenceParallel``), each attention and MLP gathering it back (``PrepareModuleInput``)
    and reduce-scattering its output onto it (row-parallel with ``Shard(1)`` output), the
    head gathering the sequence. The residual stream stays a DTensor
    (``use_local_output=False``): HF computes the rotary positions from its length."""
    sequence = {"output_layouts": Shard(1), "use_local_output": False}
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), **sequence),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })  # fmt: skip
    layer_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        "self_attn.o_proj": RowwiseParallel(**sequence),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(**sequence),
    }
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)


def transformer_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, float8_styles: bool = False) -> None:
    """Megatron's split of the test transformer's dense MLPs (``fsdp_compile.testing.models``):
    ``gate`` by columns, the raw ``up`` weight its custom Function reads cut by rows as a
    column-parallel weight is, ``down`` by rows (one all-reduce of each MLP's output over
    "tp"). The MLP takes its input as a replicated DTensor and keeps the hidden activations
    DTensors, on which the Function computes. Attention stays whole: its 3 heads split evenly
    over no tensor-parallel size but 3. With ``float8_styles`` the float8 linears are split by
    torchao's styles, which cast what crosses "tp" to float8 (the row-parallel output's
    gradient too, so its bias gets a float8-rounded gradient: not the unsharded model's);
    torch's styles leave the float8 linears' arithmetic the unsharded model's."""
    for layer in model.layers:
        mlp = layer.mlp
        parallelize_module(mlp, tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        ))  # fmt: skip
        colwise, rowwise = _float8_styles() if float8_styles else (ColwiseParallel, RowwiseParallel)
        parallelize_module(mlp, tp_mesh, {"gate": colwise(use_local_output=False), "down": rowwise()})
        mlp.up = nn.Parameter(distribute_tensor(mlp.up.detach(), tp_mesh, [Shard(0)]), requires_grad=mlp.up.requires_grad)


def attention_output_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Each attention's output projection ``wo`` of the test transformer split by rows over a
    replicated input (each rank multiplies its half of the features, one all-reduce over
    "tp"); the rest stays whole. What a MoE transformer's layers keep beside experts left to
    expert parallelism (``wqkv`` stays whole: its fused rows do not split into heads)."""
    for layer in model.layers:
        parallelize_module(layer.attn, tp_mesh, {"wo": RowwiseParallel(input_layouts=Replicate())})


def _float8_styles() -> tuple[type, type]:
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return Float8ColwiseParallel, Float8RowwiseParallel
