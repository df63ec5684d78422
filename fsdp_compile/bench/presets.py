"""Model sizes the benches share: this project's test ``Transformer`` and HuggingFace models.

``tiny`` and ``small`` (``fsdp_compile.testing.models.Transformer``) run on a CPU in seconds; ``500m``
and ``1b`` are Llama-style shapes of it for GPUs. The ``hf-*`` presets are HuggingFace causal
LMs built from a config (no download; ``pip install fsdp_compile[bench]`` brings
``transformers``), which is what users compare on: ``hf-llama-1b``, ``-8b`` and ``-70b`` are
Llama 3.2 1B, Llama 3 8B and Llama 3 70B shapes, ``hf-mixtral-2b`` a Mixtral of 8 layers and
8 experts (top 2), and ``hf-llama-tiny``, ``hf-llama-small`` and ``hf-mixtral-tiny`` the same
families at CPU sizes.
HF presets are built on the meta device and materialised after sharding, each rank
allocating only its shard (a 70B shape never exists whole on one device). The Llama ones can
be split by tensor parallelism (``layer_tp_plan``); ``tensor_parallel_refusal`` says why the
others cannot.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from fsdp_compile.testing.models import Transformer, TransformerConfig


@dataclass(frozen=True)
class HFPreset:
    """A HuggingFace causal LM: ``transformers.<family>ForCausalLM(<family>Config(**config))``."""

    family: str
    """"Llama" or "Mixtral"."""
    config: dict = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return self.config["vocab_size"]

    @property
    def max_seq(self) -> int:
        return self.config["max_position_embeddings"]


Preset = TransformerConfig | HFPreset


def _llama(**config) -> HFPreset:
    return HFPreset("Llama", {"use_cache": False, "rope_theta": 500000.0, **config})


PRESETS: dict[str, Preset] = {
    # 1.9 M parameters.
    "tiny": TransformerConfig(vocab=1024, dim=256, n_layers=2, n_heads=4, hidden=704, max_seq=256),
    # 17.3 M parameters.
    "small": TransformerConfig(
        vocab=8192, dim=512, n_layers=4, n_heads=8, hidden=1408, max_seq=512
    ),
    # 503.8 M parameters.
    "500m": TransformerConfig(
        vocab=32000, dim=1536, n_layers=16, n_heads=12, hidden=4096, max_seq=1024
    ),
    # 1.14 B parameters (Llama 3.2 1B's dim, depth, heads and MLP, without grouped KV heads).
    "1b": TransformerConfig(
        vocab=32000, dim=2048, n_layers=16, n_heads=32, hidden=8192, max_seq=2048
    ),
    "hf-llama-tiny": _llama(
        vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    ),
    # 16.0 M parameters: the Llama family at about the `small` preset's size, for CPU tables.
    "hf-llama-small": _llama(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    # 1.24 B parameters, tied embedding.
    "hf-llama-1b": _llama(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # 8.03 B parameters.
    "hf-llama-8b": _llama(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    ),
    # 70.6 B parameters.
    "hf-llama-70b": _llama(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
    ),
    "hf-mixtral-tiny": HFPreset("Mixtral", dict(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        num_local_experts=4, num_experts_per_tok=2, use_cache=False,
    )),
    # 80.6 M parameters: Mixtral's 8 experts, top 2, at hf-llama-small's width, for CPU tables.
    "hf-mixtral-small": HFPreset("Mixtral", dict(
        vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        num_local_experts=8, num_experts_per_tok=2, use_cache=False,
    )),
    # 2.4 B parameters (8 layers, 8 experts of Mixtral 8x7B's width, top 2).
    "hf-mixtral-2b": HFPreset("Mixtral", dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
        num_local_experts=8, num_experts_per_tok=2, use_cache=False,
    )),
}  # fmt: skip


def build(preset: Preset) -> nn.Module:
    """The unsharded model: on the current default device for ``TransformerConfig``s, on
    the meta device for HF presets (``materialize`` allocates them after sharding)."""
    if isinstance(preset, TransformerConfig):
        return Transformer(preset)
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as missing:
        raise ImportError(
            "HF presets need transformers: pip install 'fsdp_compile[bench]'"
        ) from missing
    config = getattr(transformers, f"{preset.family}Config")(**preset.config)
    with torch.device("meta"):
        return getattr(transformers, f"{preset.family}ForCausalLM")(config)


def blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated decoder layers: FSDP2's units."""
    return model.model.layers if hasattr(model, "model") else model.layers


def tensor_parallel_refusal(preset: Preset, tp: int) -> str | None:
    """Why ``--tp`` cannot split ``preset`` over ``tp`` ranks, naming the fix; None when
    ``layer_tp_plan`` can."""
    if isinstance(preset, TransformerConfig):
        return (
            "the test Transformer has no tensor-parallel plan: its fused wqkv split by columns "
            "would hand each rank a mix of q, k and v rows, not whole heads; use an hf-llama-* preset"
        )
    if preset.family != "Llama":
        return (
            f"transformers' plan for {preset.family} splits its experts with styles of its own "
            "(packed_colwise, moe_tp_experts), not torch's column- and row-parallel ones the "
            "bench applies; use an hf-llama-* preset"
        )
    kv_heads = preset.config["num_key_value_heads"]
    if kv_heads % tp:
        # A column-parallel k or v projection would hand a rank part of a head.
        return f"its {kv_heads} key-value heads do not divide over {tp} ranks; pick a --tp that divides {kv_heads}"
    return None


def layer_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Each decoder layer's split: transformers' own plan for the model (the ``layers.*.``
    entries of ``config.base_model_tp_plan``), "colwise" and "rowwise" as torch's styles."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {
        name.removeprefix("layers.*."): styles[style]()
        for name, style in model.config.base_model_tp_plan.items()
        if name.startswith("layers.*.")
    }


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-built, sharded model on ``device`` and initialise it: each rank draws
    its own shard of every weight (normal, std 0.02; norms at one), and rotary tables are
    computed again from the config (``to_empty`` leaves buffers uninitialised)."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            local.fill_(1.0)
        else:
            local.normal_(0.0, 0.02, generator=generator)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))


def train_flops(preset: Preset, batch: int, seq: int, tp: int = 1) -> int:
    """Model FLOPs of one forward and backward on ``batch`` x ``seq`` tokens, as MFU counts
    them (PaLM's appendix B): 6 per token per active matmul weight, plus 12 x layers x width
    x sequence per token for attention. Active: embedding lookups are not matmuls (the
    output head is, tied or not), and each stacked expert weight counts at
    ``experts_per_token / experts``. With ``tp`` > 1, one rank's share of its tensor-parallel
    group's: the model's FLOPs over ``tp`` (the output head, which every rank of the group
    computes whole, counts once, as MFU counts model FLOPs, not the hardware's).
    ``torch.utils.flop_counter`` cannot run HF models on the meta device (their masks call
    ``.item()``), hence the formula."""
    with torch.device("meta"):
        model = build(preset)
    head = model.lm_head if isinstance(preset, HFPreset) else model.head
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    top_k = preset.config.get("num_experts_per_tok", 1) if isinstance(preset, HFPreset) else 1
    experts = preset.config.get("num_local_experts", 1) if isinstance(preset, HFPreset) else 1
    active = head.weight.numel() if id(head.weight) in lookups else 0
    for param in model.parameters():
        if param.ndim >= 2 and id(param) not in lookups and param.requires_grad:
            active += param.numel() * (top_k / experts if param.ndim == 3 else 1)
    layers, width = len(blocks(model)), head.weight.shape[1]
    return int(batch * seq * (6 * active + 12 * layers * width * seq) / tp)
