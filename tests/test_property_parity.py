"""Property-based parity: random small models train sharded exactly as unsharded.

Random depth, widths (primes included), biases, a tied square layer read through two modules,
a frozen layer, a custom autograd.Function and an optional graph break; world size 2 or 4;
every sharding strategy, and both reshard settings for ZeRO-3 (the flag means nothing to the
others); 3 AdamW steps against the one-process reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.testing.models import FusedLinear
from fsdp_compile.markers import STRATEGIES
from harness import full_parameters, max_param_error, mean_over_ranks, relative_error, spawn

pytestmark = pytest.mark.multirank

WIDTHS = st.sampled_from([1, 2, 3, 5, 7, 8, 11, 13, 16])


class RandomModel(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        widths, self.spec = spec["widths"], spec
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=bias) for a, b, bias in zip(widths, widths[1:], spec["biases"])
        )
        width = widths[-1]
        self.square = nn.Linear(width, width, bias=False)
        if spec["tied"]:
            self.square_again = nn.Linear(width, width, bias=False)
            self.square_again.weight = self.square.weight
        self.fused = nn.Parameter(torch.randn(width, width) / width**0.5)
        if spec["frozen"]:
            self.layers[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if self.spec["graph_break"] and i == 0:
                torch._dynamo.graph_break()
        x = self.square(x)
        if self.spec["tied"]:
            x = self.square_again(torch.tanh(x))
        return FusedLinear.apply(x, self.fused)


@st.composite
def model_specs(draw):
    depth = draw(st.integers(1, 3))
    return {
        "widths": draw(st.lists(WIDTHS, min_size=depth + 1, max_size=depth + 1)),
        "biases": draw(st.lists(st.booleans(), min_size=depth, max_size=depth)),
        "tied": draw(st.booleans()),
        "frozen": draw(st.booleans()),
        "graph_break": draw(st.booleans()),
    }


def _batch(spec, step, rank, batch=3):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(batch, spec["widths"][0], generator=gen), torch.randn(batch, spec["widths"][-1], generator=gen)


def _train(model, forward, batches, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = batches(step)
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _property_run(rank, world, *, spec, strategy, reshard, mode):
    def global_batch(step):
        parts = [_batch(spec, step, r) for r in range(world)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    torch.manual_seed(0)
    reference = RandomModel(spec)
    ref_losses = _train(reference, reference, global_batch)
    torch.manual_seed(0)
    model = fully_shard(RandomModel(spec), strategy=strategy, reshard_after_forward=reshard)
    forward = model if mode == "none" else torch.compile(model, backend=MfsdpBackend(compiler=mode))
    losses = mean_over_ranks(_train(model, forward, lambda step: _batch(spec, step, rank)))
    error, worst = max_param_error(full_parameters(model), {n: p.detach() for n, p in reference.named_parameters()})
    return relative_error(losses, ref_losses), error, worst


# (strategy, reshard_after_forward): None lets the strategy decide.
LAYOUTS = st.sampled_from(
    [(s, None) for s in STRATEGIES if s != "optim_grads_params"]
    + [("optim_grads_params", True), ("optim_grads_params", False)]
)


@given(
    spec=model_specs(),
    world=st.sampled_from([2, 4]),
    layout=LAYOUTS,
    mode=st.sampled_from(["eager", "none"]),
)
def test_random_models_train_sharded_like_unsharded(spec, world, layout, mode):
    strategy, reshard = layout
    results = spawn(
        _property_run, world, spec=spec, strategy=strategy, reshard=reshard, mode=mode
    )
    for loss_error, param_error, worst in results:
        assert loss_error < 1e-5, (spec, layout, loss_error)
        assert param_error < 1e-5, (spec, layout, param_error, worst)
