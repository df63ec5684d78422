"""In-place updates are the user's program: every one survives every stage of the backend.

A pass that dropped "dead" nodes removed in-place ops whose result nobody reads: BatchNorm's
``num_batches_tracked.add_(1)`` never ran, ``h.mul_(0.5)`` was skipped (logits twice the
reference's), an EMA buffer under ``no_grad`` stayed zero, all without an error. Each rank
here trains on the same batch, so batch statistics (BatchNorm) equal the single-process
reference's on that batch and every buffer can be compared exactly.

A repeated block's buffers change inside its body, a frame of its own (NOTE: one op per block
call, in fsdp_compile/block_call.py): a block with a buffer failed to compile there, and run
on fake tensors while the step was traced, a block's op on buffers alone updated the real
buffer once more.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.ops import STRATEGIES
from harness import full_parameters, max_param_error, relative_error, spawn, train

pytestmark = pytest.mark.multirank

STEPS = 3


class InPlaceNet(nn.Module):
    """A CNN stem with BatchNorm, attention over its pixels, and in-place ops everywhere."""

    def __init__(self) -> None:
        super().__init__()
        # No bias before BatchNorm, as usual: its gradient is zero up to rounding, and AdamW
        # would turn that rounding noise into steps no two compilers take alike.
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.qkv = nn.Linear(8, 24, bias=False)  # a key bias would have zero gradient too
        self.head = nn.Linear(8, 5)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(images)).relu_()  # in-place activation
        tokens = h.flatten(2).transpose(1, 2)  # [batch, pixels, channels]
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2)
        scores.div_(math.sqrt(q.shape[-1]))  # in-place scaling of the scores
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores.masked_fill_(causal, float("-inf"))  # in-place masking
        pooled = (scores.softmax(-1) @ v).mean(1)
        with torch.no_grad():  # an exponential moving average: a buffer nobody reads back
            self.ema.mul_(0.9).add_(pooled.mean(0), alpha=0.1)
        pooled.mul_(0.5)  # an in-place op whose result is not used: pooled itself changes
        return self.head(pooled)


class NormBlock(nn.Module):
    """A residual block whose buffers change at every call: BatchNorm's statistics, an EMA,
    a call counter (an op on a buffer alone); and a buffer it only reads."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)
        self.bn = nn.BatchNorm1d(width)
        self.register_buffer("ema", torch.ones(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x)).relu_()
        self.calls.add_(1)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        g = h * self.scale
        g.mul_(0.5)
        return x + g


class RepeatedBlockNet(nn.Module):
    """Three ``NormBlock`` layers: repeated blocks, each layer's call one body (regional)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3 * 6 * 6, 8)
        self.layers = nn.ModuleList(NormBlock() for _ in range(3))
        self.head = nn.Linear(8, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.stem(images.flatten(1))
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 6, 6, generator=gen), torch.randint(0, 5, (4,), generator=gen)


def _train(model: nn.Module, forward) -> torch.Tensor:
    return train(model, forward, _batch, steps=STEPS, criterion=F.cross_entropy)


def _every_strategy(rank: int, world: int, *, compiler: str, net: type[nn.Module]) -> dict:
    torch.manual_seed(0)
    reference = net()
    ref_losses = _train(reference, reference)
    ref_params = {n: p.detach() for n, p in reference.named_parameters()}
    results = {}
    for strategy in STRATEGIES:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = fully_shard(net(), strategy=strategy)
        backend = MfsdpBackend(compiler=compiler)
        losses = _train(model, torch.compile(model, backend=backend))
        buffers = dict(model.named_buffers())
        results[strategy] = {
            "loss": relative_error(losses, ref_losses),
            "param": max_param_error(full_parameters(model), ref_params),
            "buffers": {n: relative_error(b.double(), ref.double()) for n, ref in reference.named_buffers() for b in [buffers[n]]},
            "counts": {n: int(b) for n, b in buffers.items() if n.endswith(("num_batches_tracked", "calls"))},
            "bodies": len(backend.bodies),
        }
    return results


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("net", [InPlaceNet, RepeatedBlockNet], ids=["one_graph", "repeated_blocks"])
def test_inplace_ops_and_buffer_updates_survive_every_strategy(compiler, net):
    """BatchNorm's running stats and ``num_batches_tracked``, an EMA buffer under ``no_grad``,
    ``relu_``, ``div_`` and ``masked_fill_`` on attention scores and a bare ``mul_``: losses,
    parameters and every buffer equal the single-process reference, for every strategy; in
    the step's graph, and in the bodies of repeated blocks (a counter counts each layer's
    calls exactly)."""
    for rank_result in spawn(_every_strategy, 2, compiler=compiler, net=net):
        for strategy, r in rank_result.items():
            assert r["bodies"] == (1 if net is RepeatedBlockNet else 0), (strategy, r)
            assert set(r["counts"].values()) == {STEPS}, (strategy, r)
            assert r["loss"] < 1e-5 and r["param"][0] < 1e-5, (strategy, r)
            assert all(error < 1e-5 for error in r["buffers"].values()), (strategy, r)
