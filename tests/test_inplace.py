"""In-place updates are the user's program: every one survives every stage of the backend.

A pass that dropped "dead" nodes removed in-place ops whose result nobody reads: BatchNorm's
``num_batches_tracked.add_(1)`` never ran, ``h.mul_(0.5)`` was skipped (logits twice the
reference's), an EMA buffer under ``no_grad`` stayed zero, all without an error. Each rank
here trains on the same batch, so batch statistics (BatchNorm) equal the single-process
reference's on that batch and every buffer can be compared exactly.

An in-place op inside a subgraph (an ``autograd.Function``'s forward or backward, a
checkpointed region) was dropped too: FX's dead-code elimination, asked to keep the user's
nodes, runs itself again on each subgraph without being asked (fsdp_compile/fx_utils.py).

A repeated block's buffers change inside its body, a frame of its own (NOTE: one op per block
call, in fsdp_compile/block_call.py): a block with a buffer failed to compile there, and run
on fake tensors while the step was traced, a block's op on buffers alone updated the real
buffer once more.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.markers import STRATEGIES
from harness import full_parameters, max_param_error, one_rank_group, relative_error, spawn, train

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


@pytest.mark.multirank
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


class _DoublesItsGradientInPlace(torch.autograd.Function):
    """A custom backward that changes its gradient in place and returns it (HF PhiMoE's
    router does the same with ``scatter_add_``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad_in = grad.clone()
        grad_in.mul_(2.0)
        return grad_in


class _SubgraphBlock(nn.Module):
    """In-place ops whose result nobody reads, inside subgraphs: a custom backward's, and a
    checkpointed region's."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def _checkpointed(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(x)
        h.mul_(0.5)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _DoublesItsGradientInPlace.apply(self.fc(x)).tanh()
        return x + torch.utils.checkpoint.checkpoint(self._checkpointed, h, use_reentrant=False)


class _SubgraphNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_SubgraphBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.structure
@pytest.mark.parametrize("regional", [True, False], ids=["bodies", "whole_graph"])
def test_inplace_ops_inside_subgraphs_survive(regional):
    """A checkpointed ``h.mul_(0.5)`` and a custom backward's ``grad.mul_(2.0)``: the loss and
    every gradient equal the unsharded model's exactly (one gloo rank, the eager runner). Before,
    both were dropped: the loss was off by 0.2 and every gradient wrong."""
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    reference = _SubgraphNet()
    expected = reference(x)
    expected.backward()
    with one_rank_group():
        torch.manual_seed(0)
        model = fully_shard(_SubgraphNet())
        loss = torch.compile(model, backend=MfsdpBackend(compiler="eager", regional=regional))(x)
        loss.backward()
    assert torch.equal(loss, expected)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        assert torch.equal(grads[name], p.grad), name


@pytest.mark.structure
def test_hf_phimoe_router_gets_its_custom_backward():
    """HF PhiMoE routes through ``sparsemixer``, whose ``autograd.Function`` backward adds the
    gradient at the chosen experts with ``scatter_add_``. With its jitter at 0 a router's
    gradient is exactly zero (one expert unmasked: the two terms cancel); compiled, it was
    not (the ``scatter_add_`` dropped). Every gradient equals eager's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.PhimoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, max_position_embeddings=64, router_jitter_noise=0.0,
        input_jitter_noise=0.0, pad_token_id=0,
    )
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).train()
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    reference(input_ids=tokens, labels=tokens).loss.backward()
    with one_rank_group():
        model = fully_shard(model)
        torch.manual_seed(1)
        torch.compile(model, backend=MfsdpBackend(compiler="eager"))(input_ids=tokens, labels=tokens).loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    routers = [name for name in grads if name.endswith("router.weight")]
    assert routers and all(not reference.get_parameter(name).grad.any() for name in routers)
    for name, p in reference.named_parameters():
        assert torch.equal(grads[name], p.grad), name


class _WrittenBeforeTheBlocks(nn.Module):
    """Tensors written in place before torch's own encoder layers take them: the embeddings
    scaled and shifted (``h *= 4``, ``h += pos``: Gemma-style scaling, learned positions) and
    a causal mask built by ``triu_``; each layer makes a float mask of the padding itself."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.pos = nn.Embedding(8, 16)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h *= 4.0
        h += self.pos(torch.arange(tokens.shape[1]))
        causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu_(1)
        padding = torch.zeros(tokens.shape, dtype=torch.bool)
        padding[:, -2:] = True  # right padding
        for layer in self.layers:
            h = layer(h, src_mask=causal, src_key_padding_mask=padding)
        return self.head(h)


@pytest.mark.structure
@pytest.mark.parametrize("regional", [True, False], ids=["bodies", "whole_graph"])
def test_tensors_written_in_place_before_a_repeated_block_keep_eager_results(regional):
    """A repeated block called with tensors written in place before the call (they carry a
    version of their own) writes nothing itself: the block's fake run compared their versions
    with those of leaves detached from them, which start again, and refused the step as
    writing in place to its inputs, naming ``regional=False``, which failed the same way.
    Three AdamW steps match the unsharded model (one gloo rank, the eager runner)."""
    tokens = torch.randint(0, 32, (STEPS, 2, 8), generator=torch.Generator().manual_seed(1))

    def batches(step):
        return tokens[step], tokens[step]

    def criterion(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    reference = _WrittenBeforeTheBlocks()
    model = copy.deepcopy(reference)
    expected = train(reference, reference, batches, steps=STEPS, criterion=criterion)
    with one_rank_group():
        fully_shard(model)
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager", regional=regional))
        losses = train(model, forward, batches, steps=STEPS, criterion=criterion)
        error, name = max_param_error(full_parameters(model), {n: p.detach() for n, p in reference.named_parameters()})
    assert torch.allclose(losses, expected, rtol=1e-6, atol=1e-6), (losses, expected)
    assert error < 1e-5, (error, name)


class _InputWriting(nn.Module):
    """A layer that writes in place to a tensor it is called with: the bias (no gradient), or
    the hidden state (differentiable)."""

    def __init__(self, written: str) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.written = written

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self.written == "bias":
            bias.add_(1.0)
        else:
            h.mul_(2.0)
        return self.linear(h) + bias


class _WritesItsInput(nn.Module):
    """Layers that each write in place to a tensor they are called with."""

    def __init__(self, written: str) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_InputWriting(written) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = self.embed(x), torch.zeros(8)
        for layer in self.layers:
            h = layer(h, bias)
        return h.sum() + bias.sum()


@pytest.mark.structure
@pytest.mark.parametrize("written", ["bias", "hidden"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "no_grad"])
def test_a_repeated_block_writing_to_its_input_is_refused_with_a_fix_that_works(written, training):
    """A repeated block that writes in place to a tensor it is called with cannot have its
    body compiled on its own: refused, naming ``options={'regional': False}``; with it the
    block is traced inline and the step matches the unsharded model (one gloo rank). Before,
    under ``no_grad`` the write went unseen (the fake run's in-place kernels raised no version
    there: a reviewer's Inductor step returned 60.6 where eager's is 188.6); a differentiable
    input failed on autograd's leaf check, under ``regional=False`` too."""
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    grad_mode = contextlib.nullcontext() if training else torch.no_grad()
    torch.manual_seed(0)
    reference = _WritesItsInput(written)
    model = copy.deepcopy(reference)
    with grad_mode:
        expected = reference(x)
    if training:
        expected.backward()
    with one_rank_group():
        fully_shard(model)
        refused = r"writes in place to a tensor it was called with.*'regional': False"
        with pytest.raises(Exception, match=refused), grad_mode:
            torch.compile(model, backend=MfsdpBackend(compiler="eager"))(x)
        with grad_mode:
            loss = torch.compile(model, backend=MfsdpBackend(compiler="eager", regional=False))(x)
        if training:
            loss.backward()
            grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    assert torch.equal(loss, expected)
    for name, p in reference.named_parameters() if training else ():
        assert torch.equal(grads[name], p.grad), name
