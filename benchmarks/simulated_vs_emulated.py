"""The simulator's estimate of a compiled step beside what the bench's emulated link measured.

    python benchmarks/simulated_vs_emulated.py --world 64 --step-ms 222.2

Compiles ``hf-llama-small`` (2 x 128 tokens, eager runner) as rank 0 of ``--world`` on the
fake process group, then runs ``fsdp_compile.simulate`` on its graphs for the InfiniBand-class
link the bench emulates (``--emulate-link ib``), with compute calibrated to the CPU: FLOP/s =
the step's model FLOPs / ``--step-ms`` (the bench's mfsdp median without a link), memory
bandwidth ``--memory-gbs``. Prints, per step: the link time of every collective (what a step
that waits at each issue exposes, as FSDP2 does on a CPU) and the simulator's exposed
communication for its three schedules. docs/performance.md compares them with the bench.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.bench.presets import PRESETS, build, materialize, train_flops
from fsdp_compile.patterns import collective_facts, is_collective
from fsdp_compile.cost_model import collective_seconds
from fsdp_compile.simulate import INFINIBAND_GPU, simulate
from fsdp_compile.testing.models import loss_fn, make_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--step-ms", type=float, required=True)
    parser.add_argument("--memory-gbs", type=float, default=5.0)
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    preset = PRESETS["hf-llama-small"]
    torch.manual_seed(0)
    model = build(preset)
    fully_shard(model)
    backend = MfsdpBackend(compiler="eager", compile_cache=False)
    forward = torch.compile(model, backend=backend)
    materialize(model, torch.device("cpu"), 0)
    tokens, targets = make_batch(preset, 2, 128, 0, 0)
    loss_fn(forward(input_ids=tokens).logits, targets).backward()
    link_s = sum(
        collective_seconds(collective_facts(node), INFINIBAND_GPU)
        for graph in backend.graphs
        for gm in (graph.forward, graph.backward)
        for node in gm.graph.nodes
        if is_collective(node)
    )
    hardware = dataclasses.replace(
        INFINIBAND_GPU,
        name="InfiniBand link, CPU-calibrated compute",
        flops=train_flops(preset, 2, 128) / (args.step_ms / 1e3),
        memory_bandwidth=args.memory_gbs * 1e9,
    )
    estimate = simulate(backend.graphs, hardware)
    print(json.dumps({
        "world": args.world,
        "link_ms_per_step": 1e3 * link_s,
        "calibrated_flops": hardware.flops,
        **{name: {"step_ms": 1e3 * s.step_seconds, "exposed_ms": 1e3 * s.exposed_comm_seconds}
           for name, s in estimate.schedules.items()},
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
