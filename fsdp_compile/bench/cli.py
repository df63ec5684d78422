"""``mfsdp-bench`` / ``python -m fsdp_compile.bench``: eager vs FSDP2 vs mfsdp training steps.

    python -m fsdp_compile.bench --preset small --world-size 2            # CPU: spawns gloo ranks
    torchrun --nproc-per-node 8 -m fsdp_compile.bench --preset 1b         # GPUs: nccl
    python -m fsdp_compile.bench --preset hf-llama-8b --fake-world 8      # one rank of 8
    python -m fsdp_compile.bench --preset hf-llama-8b --fake-world 64 --emulate-link ib
    python -m fsdp_compile.bench --preset hf-llama-8b --fake-world 8 --tp 2  # one rank of dp 4 x tp 2

Launched by torchrun (RANK and WORLD_SIZE set) it runs in those ranks; otherwise it spawns
``--world-size`` ranks on 127.0.0.1 itself (gloo on CPU, nccl with one GPU each). Rank 0 prints
a table and one JSON line, and writes the JSON to ``--json``. With ``--fake-world N`` this
process is rank 0 of an N-rank job on torch's fake process group: its compute and memory are
one rank's of that job, its collectives return at once without moving data (so its losses
mean nothing and are not compared); ``--emulate-link`` gives each collective its modeled
duration on that link instead, and the table its exposed communication. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import time
from dataclasses import asdict, dataclass, fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_compile.bench.emulated_link import LINKS, init_emulated_group
from fsdp_compile.bench.modes import (
    check_float8_available,
    MODES,
    RunConfig,
    agree_across_ranks,
    run_mode,
    skip_reason,
    warm_up_process,
)
from fsdp_compile.bench.presets import PRESETS, tensor_parallel_refusal
from fsdp_compile.bench.report import (
    add_derived,
    baseline_mode,
    machine_info,
    peak_tflops,
    print_report,
    write_json,
)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """The command line; every field is an option of the same name (``--world-size``)."""

    preset: str = "small"
    """A key of ``fsdp_compile.bench.presets.PRESETS``."""
    modes: str = ",".join(MODES)
    """Comma-separated, run in this order; a mode the device cannot run is skipped, and said so."""
    world_size: int = 2
    """Ranks to spawn when not launched by torchrun."""
    fake_world: int = 0
    """Run this process alone as rank 0 of this many on the fake process group (0: off)."""
    emulate_link: str = ""
    """With --fake-world: collectives take their modeled time on this link, "nvlink" or "ib"
    (fsdp_compile/bench/emulated_link.py); empty: they take none."""
    tp: int = 1
    """With --fake-world W: tensor-parallel ranks, the world a (W / tp, tp) mesh of ("dp",
    "tp"), each decoder layer split over "tp" by the preset's plan in every mode; 1: none."""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    batch: int = 4
    """Sequences per rank per step."""
    seq: int = 128
    warmup: int = 3
    """Untimed steps first (the first compiles)."""
    steps: int = 20
    """Timed steps."""
    compiler: str = ""
    """mfsdp's compiler, "inductor" or "eager"; empty: inductor on CUDA, eager on CPU."""
    param_dtype: str = "float32"
    """"float32" or "bfloat16" (mixed precision: fp32 weights, fp32 gradient reduction)."""
    float8: str = "off"
    """"on": torchao float8 linears gathered in float8, every mode (FSDP2 with torchao's
    float8 all-gather); needs ``pip install 'fsdp_compile[float8]'``."""
    lr: float = 1e-3
    seed: int = 0
    compile_cache: str = ""
    """Compile each mode with Inductor's and AOTAutograd's caches on, in a folder of its own
    inside this one (the process's warm-up too): run the bench twice over one folder and the
    second run's warm-up is a restart's (empty: every mode compiles cold, in a fresh folder,
    the caches off)."""
    memory_sites: int = 0
    """CUDA: record the allocator's history with Python stacks (slower steps) and print, per
    mode, this many allocation sites holding the most memory after the last timed step and
    at the timed steps' peak (0: off)."""
    json: str = ""
    """Write the results here too (empty: only print)."""
    timeout_s: float = 3600.0
    """Kill the spawned ranks past this, and the per-collective timeout of the process group."""

    def run_config(self) -> RunConfig:
        return RunConfig(
            preset=self.preset,
            batch=self.batch,
            seq=self.seq,
            warmup=self.warmup,
            steps=self.steps,
            compiler=self.compiler or ("inductor" if self.device == "cuda" else "eager"),
            param_dtype=getattr(torch, self.param_dtype),
            float8=self.float8 == "on",
            lr=self.lr,
            seed=self.seed,
            compile_cache=self.compile_cache,
            memory_sites=self.memory_sites,
            tp=self.tp,
        )


_CHOICES = {
    "preset": tuple(PRESETS),
    "device": ("cpu", "cuda"),
    "compiler": ("", "inductor", "eager"),
    "param_dtype": ("float32", "bfloat16"),
    "float8": ("off", "on"),
    "emulate_link": ("", *LINKS),
}


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = BenchConfig()
    for field in fields(BenchConfig):
        default = getattr(defaults, field.name)
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=type(default),
            default=default,
            choices=_CHOICES.get(field.name),
            help=f"default: {default!r}",
        )
    bench = BenchConfig(**vars(parser.parse_args(argv)))
    unknown = sorted(set(bench.modes.split(",")) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {','.join(MODES)}")
    if bench.seq > PRESETS[bench.preset].max_seq:
        parser.error(f"--seq {bench.seq} exceeds preset {bench.preset}'s max_seq")
    if bench.warmup < 1 or bench.steps < 1 or bench.world_size < 1:
        parser.error("--warmup, --steps and --world-size must be at least 1")
    if bench.fake_world < 0:
        parser.error("--fake-world must be a number of ranks, or 0 for a real job")
    if bench.memory_sites < 0:
        parser.error("--memory-sites must be a number of sites, or 0 for none")
    if bench.memory_sites and bench.device != "cuda":
        parser.error(
            "--memory-sites needs --device cuda: it replays the CUDA caching allocator's history "
            "(torch.cuda.memory._record_memory_history); a CPU run has none, and its peak "
            "memory is the process's resident set"
        )
    if bench.emulate_link and not bench.fake_world:
        parser.error("--emulate-link needs --fake-world N: it emulates the link of one rank of N")
    if bench.tp != 1:
        _check_tensor_parallel(parser, bench)
    if bench.float8 == "on":
        check_float8_available()
    return bench


def _check_tensor_parallel(parser: argparse.ArgumentParser, bench: BenchConfig) -> None:
    """``--tp`` runs where tensor parallelism composes with every mode, or says what to change."""
    if bench.tp < 1:
        parser.error("--tp must be a number of tensor-parallel ranks, 1 for none")
    if not bench.fake_world or bench.fake_world % bench.tp:
        parser.error(
            f"--tp {bench.tp} needs --fake-world W with W a multiple of {bench.tp}: the run is one "
            f"rank of a (W / {bench.tp}) x {bench.tp} dp x tp job"
        )
    refusal = tensor_parallel_refusal(PRESETS[bench.preset], bench.tp)
    if refusal:
        parser.error(f"--tp cannot split preset {bench.preset}: {refusal}")
    if bench.emulate_link:
        parser.error(
            "--tp with --emulate-link: the emulated link models one group, not a dp and a tp group "
            "on links of their own; drop --emulate-link"
        )


def run_rank(rank: int, world: int, local_rank: int, init_method: str, bench: BenchConfig):
    """Everything one rank does: join the group, run each mode, rank 0 reports."""
    device = torch.device(bench.device, local_rank if bench.device == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if bench.emulate_link:
        init_emulated_group(LINKS[bench.emulate_link], bench.fake_world)
    elif bench.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=bench.fake_world)
    else:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=bench.timeout_s),
        )
    try:
        run, results, skipped = bench.run_config(), [], {}
        machine = machine_info(device)
        process_warmup_s = warm_up_process(run, device)

        def document() -> dict:
            add_derived(results, peak_tflops(machine, bench.param_dtype))
            return {
                "machine": machine,
                "layout": {"dp": world // bench.tp, "tp": bench.tp},
                "baseline": baseline_mode(results),
                "config": asdict(bench),
                "process_warmup_s": process_warmup_s,
                "results": results,
                "skipped": skipped,
            }

        for mode in bench.modes.split(","):
            reason = skip_reason(mode, device)
            if reason:
                skipped[mode] = reason
                if rank == 0:
                    print(f"skipping {mode}: {reason}", flush=True)
                continue
            result = run_mode(mode, run, device)
            # The fake group's collectives do not reduce: one real rank agrees with itself.
            results.append(result if bench.fake_world else agree_across_ranks(result, device))
            if rank == 0 and bench.json:
                # After each mode: a run killed in a later mode keeps the modes it finished.
                write_json(document(), bench.json)
            # Each mode starts from nothing: no compiled frames, no cached blocks.
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            print_report(document())
            if bench.json:
                write_json(document(), bench.json)
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world: int, port: int, bench: BenchConfig) -> None:
    if bench.device == "cpu":
        # Ranks share the cores; more threads than cores would time contention, not work.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    run_rank(rank, world, rank, f"tcp://127.0.0.1:{port}", bench)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(bench: BenchConfig) -> None:
    """Run ``bench.world_size`` ranks; a failing rank stops all; past the timeout, kill them."""
    world = bench.world_size
    context = mp.start_processes(
        _spawned_rank,
        args=(world, _free_port(), bench),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + bench.timeout_s
    while not context.join(timeout=1):  # raises, naming the rank, when one fails
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise SystemExit(f"bench ranks still running after --timeout-s {bench.timeout_s}")


def main(argv: list[str] | None = None) -> None:
    bench = parse_args(argv)
    # Kineto writes lines for each start and stop of the profiler (the profiled step) on every
    # rank at its levels up to 5; level 6 silences them, keeping the progress bars legible.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    if bench.fake_world:
        run_rank(0, bench.fake_world, 0, "", bench)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        bench = replace(bench, world_size=world)  # torchrun's count rules; --world-size is moot
        run_rank(rank, world, int(os.environ.get("LOCAL_RANK", "0")), "env://", bench)
    else:
        spawn(bench)
