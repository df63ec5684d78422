"""capture_step: a whole training step (forward, backward, AdamW) replayed from one CUDA graph.

The GPU tests skip cleanly without CUDA; the API's misuse errors are checked everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from fsdp_compile import MfsdpBackend, MixedPrecision, UsageError, capture_step, fully_shard
from fsdp_compile.testing.models import TransformerConfig, train_step_fn
from harness import build_model, global_batch, spawn

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 5
# The bitwise comparison runs the step in two processes: kernels with atomics (the embedding's
# backward) would differ in the last bit between runs, captured or not. cuBLAS needs this set
# before CUDA starts to be deterministic; the ranks import this module first.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.mark.structure
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_capture_step_without_cuda_says_so():
    with pytest.raises(UsageError, match="needs a CUDA device"):
        capture_step(lambda x: x, torch.zeros(1))


@pytest.mark.structure
def test_capture_step_needs_a_warmup():
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        capture_step(lambda x: x, torch.zeros(1), warmup_steps=0)


def _train_losses(rank, world, *, cfg: TransformerConfig, mp: bool, captured: bool):
    """Five steps of the compiled step, either called directly or captured and replayed."""
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda", rank)
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    model = fully_shard(build_model(cfg).to(device), mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    forward = torch.compile(model, backend=MfsdpBackend(compiler="inductor", cuda_graph=True))

    train_step = train_step_fn(forward, opt)
    batches = [tuple(t.to(device) for t in global_batch(cfg, s, 1)) for s in range(STEPS)]
    if not captured:
        return [train_step(*b).float().cpu() for b in batches]
    with capture_step(train_step, *batches[0]) as step:
        losses = [step.warmup_outputs[0].float().cpu()]
        losses += [step(*b).float().cpu() for b in batches[1:]]
    return losses


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "cfg, mp",
    [
        (TransformerConfig(), False),
        (TransformerConfig(), True),
        (TransformerConfig(n_layers=2, n_experts=4, capacity_factor=1.0), False),
    ],
    ids=["fp32", "bf16", "moe-static-capacity"],
)
def test_replayed_step_matches_uncaptured_compiled_step(cfg, mp):
    """Bitwise: replay runs the very kernels the uncaptured compiled step runs, on the same
    inputs, so the loss sequence is identical (warm-up step included)."""
    (eager,) = spawn(_train_losses, 1, backend="nccl", cfg=cfg, mp=mp, captured=False)
    (replayed,) = spawn(_train_losses, 1, backend="nccl", cfg=cfg, mp=mp, captured=True)
    assert torch.equal(torch.stack(replayed), torch.stack(eager)), (replayed, eager)
