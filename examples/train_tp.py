"""Train a tiny GPT with tensor parallelism inside and mfsdp across: the FSDP2 idiom.

    torchrun --standalone --nproc-per-node 4 examples/train_tp.py            # CPU, gloo: dp 2 x tp 2
    torchrun --standalone --nproc-per-node 8 examples/train_tp.py --tp 2     # GPUs, nccl: dp 4 x tp 2

Each block's attention and MLP are split over the "tp" dimension as Megatron splits them
(query, key, value and the MLP's first layer by columns, the output projections by rows) with
torch's ``parallelize_module``; ``fully_shard`` then shards every parameter over "dp". The task
is learnable (each sequence counts up from a random start, modulo the vocabulary), so the loss
printed per step should fall well below ln(vocab).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_compile import fully_shard
from launch import init_torchrun


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        # Under tensor parallelism each rank holds its heads only: -1 counts them.
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


TP_PLAN = {
    "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
    "up": ColwiseParallel(), "down": RowwiseParallel(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (divides the world and the heads)")
    parser.add_argument("--compiler", choices=["inductor", "eager", "none"], default=None,
                        help="mfsdp's compiler (default: inductor on GPU, eager on CPU); none = uncompiled")
    args = parser.parse_args()
    rank, world, device, compiler = init_torchrun(args.compiler)
    vocab, dim, heads = 97, 64, 4

    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # every rank builds the same weights, then keeps its pieces
    model = TinyGPT(vocab, dim, heads, layers=2, seq=args.seq).to(device)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], TP_PLAN)
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step_fn = model if compiler == "none" else torch.compile(model, backend="mfsdp", options={"compiler": compiler})

    # The ranks of one tensor-parallel group read the same batch.
    gen = torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank())
    if rank == 0:
        print(f"world={world} dp={world // args.tp} tp={args.tp} device={device.type} "
              f"compiler={compiler} ln(vocab)={math.log(vocab):.3f}")
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        first = torch.randint(0, vocab, (args.batch, 1), generator=gen)
        tokens = ((first + torch.arange(args.seq + 1)) % vocab).to(device)
        logits = step_fn(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss := loss.detach())
        losses.append(loss.item() / world)
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  {time.perf_counter() - start:.2f}s")
    if rank == 0:
        print(json.dumps({"world": world, "tp": args.tp, "compiler": compiler,
                          "first_loss": losses[0], "last_loss": losses[-1]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
