"""GPU benchmark: eager sharded step vs compiled (mfsdp) vs compiled + captured CUDA graph.

    torchrun --standalone --nproc-per-node 1 -m fsdp_compile.bench.cuda_graph [--preset 500m]

Prints a table (rank 0) and one JSON line per mode: median step time, peak allocated memory.
A benchmark, not a test: numbers depend on the GPU, which the output names.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from fsdp_compile import MixedPrecision, capture_step, fully_shard
from fsdp_compile.bench.presets import PRESETS
from fsdp_compile.models import Transformer, train_step_fn

MODES = ("eager", "compiled", "compiled+cudagraph")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    preset: str = "500m"
    batch: int = 8
    seq: int = 1024
    steps: int = 20
    """Timed steps per mode, after warm-up."""
    warmup: int = 3


def run_mode(mode: str, bench: BenchConfig, device: torch.device) -> dict:
    cfg = PRESETS[bench.preset]
    torch.manual_seed(0)
    model = fully_shard(
        Transformer(cfg).to(device),
        mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True, foreach=True)
    forward = model
    if mode != "eager":
        options = {"compiler": "inductor", "cuda_graph": mode.endswith("cudagraph")}
        forward = torch.compile(model, backend="mfsdp", options=options)
    step = train_step_fn(forward, opt)
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (bench.batch, bench.seq + 1), device=device, generator=gen)
    inputs = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    torch.cuda.reset_peak_memory_stats(device)
    compile_start = time.perf_counter()
    if mode.endswith("cudagraph"):
        captured = capture_step(step, *inputs, warmup_steps=bench.warmup)
        step = captured
    else:
        for _ in range(bench.warmup):
            step(*inputs)
    torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - compile_start

    times = []
    for _ in range(bench.steps):
        start = time.perf_counter()
        loss = step(*inputs)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    result = {
        "mode": mode,
        "median_step_ms": 1e3 * statistics.median(times),
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "warmup_and_compile_s": warmup_s,
        "final_loss": float(loss),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    if mode.endswith("cudagraph"):
        captured.teardown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field, default in asdict(BenchConfig()).items():
        parser.add_argument(f"--{field}", type=type(default), default=default)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    bench = BenchConfig(**{k: getattr(args, k) for k in asdict(BenchConfig())})

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    results = []
    for mode in args.modes.split(","):
        results.append(run_mode(mode, bench, device))
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    base = next((r for r in results if r["mode"] == "eager"), results[0])
    if rank == 0:
        gpu = torch.cuda.get_device_name(device)
        print(f"{gpu}, world={dist.get_world_size()}, torch {torch.__version__}, {bench}")
        print(f"{'mode':<20}{'median ms':>11}{'vs eager':>10}{'peak GiB':>10}{'warmup s':>10}")
        for r in results:
            print(
                f"{r['mode']:<20}{r['median_step_ms']:>11.2f}{base['median_step_ms'] / r['median_step_ms']:>9.2f}x"
                f"{r['peak_allocated_gib']:>10.2f}{r['warmup_and_compile_s']:>10.1f}"
            )
        for r in results:
            print(json.dumps({"gpu": gpu, "world": dist.get_world_size(), **asdict(bench), **r}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
