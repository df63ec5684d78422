"""A small Llama-style transformer that exercises everything fully_shard must handle.

Attention with causal SDPA, RMSNorm, a SwiGLU MLP whose up-projection is a raw ``Parameter``
consumed inside a custom ``autograd.Function`` (a stand-in for a fused kernel that no module
hook would see), an embedding tied to the output head, a frozen positional table, per-head
temperatures (a parameter with fewer rows than ranks) and sizes not divisible by 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    vocab: int = 67
    """Vocabulary size (odd on purpose: uneven shards)."""
    dim: int = 48
    n_layers: int = 3
    n_heads: int = 3
    hidden: int = 90
    """SwiGLU hidden size (not divisible by 4)."""
    max_seq: int = 32
    graph_break_after: int | None = None
    """Insert ``torch._dynamo.graph_break()`` after this block (tests graph breaks)."""


class FusedLinear(torch.autograd.Function):
    """``x @ weight.T`` with a hand-written backward, reading the raw weight tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad @ weight, grad_weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.head_scale = nn.Parameter(torch.ones(cfg.n_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(2)
        q = q.transpose(1, 2) * self.head_scale.view(1, -1, 1, 1)
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Parameter(torch.randn(cfg.hidden, cfg.dim) / cfg.dim**0.5)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * FusedLinear.apply(x, self.up))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.max_seq, cfg.dim) * 0.02, requires_grad=False)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight
        # Tied with the head: unit-variance rows would start with logits of size sqrt(dim).
        nn.init.normal_(self.embed.weight, std=cfg.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == self.cfg.graph_break_after:
                torch._dynamo.graph_break()
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_batch(cfg: TransformerConfig, batch: int, seq: int, step: int, rank: int = 0):
    """Deterministic tokens and next-token targets for (step, rank), same on every process."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]
