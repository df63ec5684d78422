"""A small Llama-style transformer that exercises everything fully_shard must handle.

Attention with causal SDPA, RMSNorm, a SwiGLU MLP whose up-projection is a raw ``Parameter``
consumed inside a custom ``autograd.Function`` (a stand-in for a fused kernel that no module
hook would see), an embedding tied to the output head, a frozen positional table, per-head
temperatures (a parameter with fewer rows than ranks) and sizes not divisible by 4. With
``n_experts`` > 0 the MLPs are mixtures of experts (static capacity), in a ModuleList or as
fused 3-D weights read by a grouped-GEMM ``autograd.Function``; with ``expert_parallel`` the
experts are marked for expert parallelism (see fsdp_compile/expert_parallel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_compile.expert_parallel import combine_from_experts, dispatch_to_experts


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
    checkpoint_blocks: bool = False
    """Run each block under ``torch.utils.checkpoint`` (activation checkpointing)."""
    dropout: float = 0.0
    """Dropout on each block's two residual branches while training (0: none, and no draw)."""
    n_experts: int = 0
    """0: dense SwiGLU MLPs; otherwise each block's MLP is a mixture of this many experts."""
    top_k: int = 2
    capacity_factor: float = 1.25
    """Expert capacity = ceil(capacity_factor * tokens * top_k / n_experts); overflow is dropped."""
    fused_experts: bool = True
    """Experts as 3-D weights in one grouped-GEMM Function (True) or a ModuleList (False)."""
    idle_params: bool = False
    """Give each block two trainable parameters autograd gives no gradient: a linear read only
    under ``torch.no_grad()`` (a gate on the attention branch) and a vector never read. In
    the unsharded model their ``.grad`` stays None, so AdamW neither decays nor moves them."""
    expert_parallel: bool = False
    """Mark each MoE's experts ``expert_parallel_enabled``: ``fully_shard(..., expert_mesh=...)``
    gives each EP rank its experts and tokens travel to them by all-to-all."""


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


def grouped_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[e] @ b[e]`` for every expert ``e``: ``torch._grouped_mm`` where it runs (bf16, rows
    of 16-byte multiples: its meta kernel refuses anything else), else a batched matmul."""
    aligned = all(t.shape[-1] * t.element_size() % 16 == 0 for t in (a, b))
    if aligned and a.dtype == b.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a.contiguous(), b.contiguous())
    return torch.bmm(a, b)


class GroupedExpertMLP(torch.autograd.Function):
    """``silu(x @ w_in^T) @ w_out^T`` per expert, grouped GEMMs, hand-written backward.

    Reads the raw 3-D weights (``[experts, hidden, dim]``, ``[experts, dim, hidden]``) the way a
    fused grouped-GEMM kernel does: no module call, so no module hook would ever see them.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
        pre = grouped_mm(x, w_in.transpose(1, 2))
        act = F.silu(pre)
        ctx.save_for_backward(x, w_in, w_out, pre)
        return grouped_mm(act, w_out.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w_in, w_out, pre = ctx.saved_tensors
        sig = torch.sigmoid(pre)
        act = pre * sig
        grad_act = grouped_mm(grad, w_out)
        grad_w_out = grouped_mm(grad.transpose(1, 2), act)
        grad_pre = grad_act * sig * (1 + pre * (1 - sig))
        return grouped_mm(grad_pre, w_in), grouped_mm(grad_pre.transpose(1, 2), x), grad_w_out


class GroupedExperts(nn.Module):
    """Every expert's weights stacked on dim 0, run by one ``GroupedExpertMLP``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        scale_in, scale_out = cfg.dim**-0.5, cfg.hidden**-0.5
        self.w_in = nn.Parameter(torch.randn(cfg.n_experts, cfg.hidden, cfg.dim) * scale_in)
        self.w_out = nn.Parameter(torch.randn(cfg.n_experts, cfg.dim, cfg.hidden) * scale_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[experts held here, tokens, dim]``."""
        return GroupedExpertMLP.apply(x, self.w_in, self.w_out)


class ExpertMLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.w_in = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w_out = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.silu(self.w_in(x)))


class MoE(nn.Module):
    """Top-k routed experts with a static capacity (GShard-style dispatch, token dropping).

    Every shape is fixed by (tokens, experts, capacity): no ``nonzero``, no host sync, so the
    layer compiles into one graph and can be captured in a CUDA graph. Under expert
    parallelism (``fully_shard`` set ``experts.expert_parallel_group``) each expert's capacity
    slots travel to the rank owning it and back by all-to-all; the router stays data-parallel.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        if cfg.fused_experts:
            self.experts = GroupedExperts(cfg)
        else:
            self.experts = nn.ModuleList(ExpertMLP(cfg) for _ in range(cfg.n_experts))
        self.experts.expert_parallel_enabled = cfg.expert_parallel

    def capacity(self, tokens: int) -> int:
        cfg = self.cfg
        return math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts)

    def run_experts(self, expert_in: torch.Tensor) -> torch.Tensor:
        """``[experts, capacity, dim]`` slots -> the experts' outputs, same shape."""
        group = getattr(self.experts, "expert_parallel_group", None)
        if group is None:
            return self._local_experts(expert_in, range(self.cfg.n_experts))
        received = dispatch_to_experts(expert_in, group)
        return combine_from_experts(self._local_experts(received, group.local_experts), group)

    def _local_experts(self, expert_in: torch.Tensor, indices: range) -> torch.Tensor:
        if self.cfg.fused_experts:
            return self.experts(expert_in)
        return torch.stack([self.experts[e](expert_in[i]) for i, e in enumerate(indices)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        cfg, capacity = self.cfg, self.capacity(x.shape[0])
        gates, experts = self.router(x).softmax(-1).topk(cfg.top_k, dim=-1)  # [T, k]
        # Comparisons against aranges, not F.one_hot: one_hot checks its input on the host.
        chosen = (experts.unsqueeze(-1) == torch.arange(cfg.n_experts, device=x.device)).to(x.dtype)
        # Slot of each (token, choice) in its expert's buffer, in token order; a slot beyond
        # the capacity matches no column, which drops that choice.
        slot = chosen.flatten(0, 1).cumsum(0).view_as(chosen) - 1  # [T, k, E]
        in_capacity = slot.unsqueeze(-1) == torch.arange(capacity, device=x.device)
        dispatch = chosen.unsqueeze(-1) * in_capacity.to(x.dtype)  # [T, k, E, C]
        expert_in = torch.einsum("tkec,td->ecd", dispatch, x)
        expert_out = self.run_experts(expert_in)
        out = torch.einsum("tkec,ecd,tk->td", dispatch, expert_out, gates)
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = MoE(cfg) if cfg.n_experts else SwiGLU(cfg)
        # None, not a float attribute read in forward: under dynamic=True Dynamo compiled
        # the body twice for that float.
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout else None
        self.gate = nn.Linear(cfg.dim, 1) if cfg.idle_params else None
        self.unread = nn.Parameter(torch.randn(cfg.dim)) if cfg.idle_params else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self._gated(self.attn(self.attn_norm(x)), x))
        return x + self._drop(self.mlp(self.mlp_norm(x)))

    def _gated(self, branch: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return branch
        with torch.no_grad():
            gate = torch.sigmoid(self.gate(x))
        return branch * gate

    def _drop(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.dropout is None else self.dropout(branch)


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
            if self.cfg.checkpoint_blocks:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
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


def train_step_fn(forward, opt: torch.optim.Optimizer):
    """The usual step as one callable: zero_grad, forward, loss, backward, optimizer step.

    ``zero_grad(set_to_none=True)`` comes first so a CUDA-graph capture of this step
    (``fsdp_compile.capture_step``) starts from no gradients and allocates them in its pool.
    Returns ``step(tokens, targets) -> loss`` (detached).
    """

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(forward(tokens), targets)
        loss.backward()
        opt.step()
        return loss.detach()

    return step
