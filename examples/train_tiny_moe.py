"""Train a tiny mixture-of-experts GPT with expert parallelism + fully_shard + torch.compile.

    torchrun --standalone --nproc-per-node 4 examples/train_tiny_moe.py          # CPU, gloo
    torchrun --standalone --nproc-per-node 8 examples/train_tiny_moe.py --ep 4   # GPUs, nccl

Each EP group of ``--ep`` ranks splits the experts between them (tokens travel by all-to-all);
the dense parameters (attention, norms, routers, embedding) are sharded over all ranks. The
task is learnable (each sequence counts up from a random start, modulo the vocabulary), so the
loss printed per step should fall well below ln(vocab).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from fsdp_compile import clip_grad_norm_, expert_mesh, fully_shard
from launch import init_torchrun
from fsdp_compile.testing.models import Transformer, TransformerConfig, loss_fn


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    steps: int = 20
    batch: int = 8
    """Sequences per rank."""
    seq: int = 32
    ep: int = 2
    """Expert-parallel size: ranks per EP group (divides the world size and --experts)."""
    experts: int = 8
    fused: bool = True
    """Fused 3-D expert weights (grouped GEMM) or a ModuleList of expert MLPs."""
    shard_experts: bool = False
    """Also shard each EP rank's experts over its expert-data-parallel group (efsdp)."""
    compiler: str | None = None
    """mfsdp's compiler (default: inductor on GPU, eager on CPU); none = uncompiled."""
    max_norm: float = 1.0
    """Gradient clipping over dense and expert parameters together (fsdp_compile.clip_grad_norm_:
    torch's fails across the two meshes)."""


def counting_batch(cfg: TransformerConfig, batch: int, seq: int, gen: torch.Generator, device):
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=gen)
    tokens = ((start + torch.arange(seq + 1)) % cfg.vocab).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def parse_args() -> RunConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, field in RunConfig.__dataclass_fields__.items():
        flag = "--" + name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        elif name == "compiler":
            parser.add_argument(flag, choices=["inductor", "eager", "none"], default=None)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    return RunConfig(**vars(parser.parse_args()))


def main() -> None:
    run = parse_args()
    rank, world, device, compiler = init_torchrun(run.compiler)

    cfg = TransformerConfig(
        vocab=97, dim=64, n_layers=2, n_heads=4, hidden=128, max_seq=run.seq,
        n_experts=run.experts, top_k=2, capacity_factor=1.25, fused_experts=run.fused,
        expert_parallel=True,
    )
    torch.manual_seed(0)  # every rank builds the same weights, then keeps its experts and rows
    model = fully_shard(
        Transformer(cfg).to(device),
        expert_mesh=expert_mesh(device.type, run.ep),
        shard_experts=run.shard_experts,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step_fn = model if compiler == "none" else torch.compile(model, backend="mfsdp", options={"compiler": compiler})

    gen = torch.Generator().manual_seed(1 + rank)
    if rank == 0:
        print(f"world={world} ep={run.ep} edp={world // run.ep} device={device.type} "
              f"compiler={compiler} ln(vocab)={math.log(cfg.vocab):.3f}")
    losses = []
    for step in range(run.steps):
        start = time.perf_counter()
        tokens, targets = counting_batch(cfg, run.batch, run.seq, gen, device)
        loss = loss_fn(step_fn(tokens), targets)
        loss.backward()
        grad_norm = clip_grad_norm_(model.parameters(), run.max_norm)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss := loss.detach())
        losses.append(loss.item() / world)
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  grad norm {grad_norm.item():.3f}  "
                  f"{time.perf_counter() - start:.2f}s")
    if rank == 0:
        print(json.dumps({"run": asdict(run), "world": world, "compiler": compiler,
                          "first_loss": losses[0], "last_loss": losses[-1]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
