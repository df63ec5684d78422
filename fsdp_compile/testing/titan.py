"""A Llama 3 laid out as torchtitan lays out its models, which FSDP2's users train.

What differs from the test transformer and from HF's models is how the model holds and feeds
its layers: an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... iterated by ``.values()``; a
complex ``freqs_cis`` buffer (not persistent) handed to every layer with keyword arguments
that are None; ``init_weights`` methods for a model built on the meta device, the root's
recomputing the buffer on the device given; rotary embeddings through ``view_as_complex``,
key/value heads repeated, causal SDPA, ``nn.RMSNorm``; and a per-layer init scale, a float
that differs between layers. Activation checkpointing, as torchtitan applies it, replaces
each layer by torch's ``checkpoint_wrapper``, whole or selective (``checkpoint_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TitanConfig:
    vocab: int = 67
    dim: int = 48
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 80
    max_seq: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0


def rotary_table(head_dim: int, positions: int, theta: float) -> torch.Tensor:
    """Each position's rotation per pair of channels, as unit complex numbers (complex64)."""
    inverse = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(positions), inverse).float()
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = pairs * table[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(turned).flatten(3).type_as(x)


def repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    batch, seq, heads, head_dim = x.shape
    if times == 1:
        return x
    return x.unsqueeze(3).expand(batch, seq, heads, times, head_dim).reshape(batch, seq, heads * times, head_dim)


class Attention(nn.Module):
    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, freqs_cis), rotate(k, freqs_cis)
        k, v = repeat_heads(k, self.n_rep), repeat_heads(v, self.n_rep)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: TitanConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.register_buffer("freqs_cis", self._rotary_table(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def _rotary_table(self) -> torch.Tensor:
        return rotary_table(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq, self.cfg.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """After ``to_empty``: the buffer computed again on ``buffer_device``, every weight drawn."""
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = self._rotary_table()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std = self.cfg.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens, attention_masks=None, positions=None):
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks=attention_masks, positions=positions)
        h = self.norm(h) if self.norm else h
        return self.output(h) if self.output else h


_KEPT_BY_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    """torchtitan's selective policy, simplified: the matmuls' and attention's outputs kept,
    everything else recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_layers(model: Transformer, *, selective: bool = False) -> Transformer:
    """Each layer replaced by torch's ``checkpoint_wrapper`` of it, in place, as torchtitan's
    activation checkpointing does: every activation recomputed, or with ``selective`` the
    matmuls' and attention's outputs kept (torchtitan's op-level selective mode)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    options = {"context_fn": partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention)} if selective else {}
    for key, layer in model.layers.named_children():
        model.layers.register_module(key, checkpoint_wrapper(layer, preserve_rng_state=False, **options))
    return model
