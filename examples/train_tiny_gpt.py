"""Train a tiny GPT with fully_shard + torch.compile(backend="mfsdp").

    torchrun --standalone --nproc-per-node 2 examples/train_tiny_gpt.py          # CPU, gloo
    torchrun --standalone --nproc-per-node 8 examples/train_tiny_gpt.py          # GPUs, nccl

The task is learnable (each sequence counts up from a random start, modulo the vocabulary), so
the loss printed per step should fall well below ln(vocab).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist

from fsdp_compile import fully_shard
from launch import init_torchrun
from fsdp_compile.testing.models import Transformer, TransformerConfig, loss_fn


def counting_batch(cfg: TransformerConfig, batch: int, seq: int, gen: torch.Generator, device):
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=gen)
    tokens = (start + torch.arange(seq + 1)) % cfg.vocab
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--compiler",
        choices=["inductor", "eager", "none"],
        default=None,
        help="mfsdp's compiler (default: inductor on GPU, eager on CPU); none = uncompiled",
    )
    args = parser.parse_args()

    rank, world, device, compiler = init_torchrun(args.compiler)

    cfg = TransformerConfig(vocab=97, dim=64, n_layers=3, n_heads=4, hidden=172, max_seq=args.seq)
    torch.manual_seed(0)  # every rank builds the same weights; fully_shard keeps its own rows
    model = fully_shard(Transformer(cfg).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step_fn = model if compiler == "none" else torch.compile(model, backend="mfsdp", options={"compiler": compiler})

    gen = torch.Generator().manual_seed(1 + rank)
    if rank == 0:
        print(f"world={world} device={device.type} compiler={compiler} ln(vocab)={math.log(cfg.vocab):.3f}")
    for step in range(args.steps):
        start = time.perf_counter()
        tokens, targets = counting_batch(cfg, args.batch, args.seq, gen, device)
        loss = loss_fn(step_fn(tokens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss := loss.detach())
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item() / world:.4f}  {time.perf_counter() - start:.2f}s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
