"""Compile time at depth, per stage: does any stage grow with the number of layers?

    python benchmarks/compile_time.py                               # 8, 32, 128 layers, CPU
    python benchmarks/compile_time.py --layers 8,32 --modes regional,fsdp2-compile --repeats 3

Each measurement is a fresh process (Dynamo's caches are per process; each run gets an empty
Inductor cache folder, and the compile caches are off unless ``--restart``), one rank of a
``--world``-rank job on the fake process group, a tiny-width Llama (HuggingFace
``LlamaForCausalLM`` from a config when ``transformers`` is installed, else this project's
test Transformer), one forward and backward. Modes run
alternately (A B A B) and the table gives medians:

- ``regional``: ``fully_shard`` + ``torch.compile(backend="mfsdp")``, one body per block, the
  default;
- ``bodies``: ``regional`` with ``options={"compile_outside_blocks": False}``: with Inductor only
  the bodies are compiled, the rest runs as Python;
- ``whole``: the same with ``options={"regional": False}``, every layer in the graph;
- ``... restart``, with ``--restart``: the same in a second fresh process over the first one's
  cache folder, caches on: the AOTAutograd and Inductor caches serve what they hold (only
  for ``--compiler inductor``: the eager runner is never cached), Dynamo traces again;
- ``fsdp2-compile``: FSDP2's ``fully_shard`` per block and on the root, each block compiled on
  its own (what torchtitan users run), with ``aot_eager`` for ``--compiler eager`` and
  Inductor for ``--compiler inductor``;
- ``torch-regional``: no sharding at all, ``torch.compile`` of the whole model with each block's
  forward in torch's ``nested_compile_region`` (same compilers as ``fsdp2-compile``): what
  compiling the whole step as one graph costs in torch itself, the floor under ``regional``.

Columns: first step (the seconds from the call to the end of backward, compilation
included), Dynamo (frame conversion, backend excluded), joint (AOTAutograd's joint trace and
metadata), passes (fsdp_compile's passes, every stage), partitioner, compiler (the eager
runner, nothing to speak of, or Inductor: mfsdp's own compiler calls), gc (Python's garbage
collector, which runs inside the other stages, so its seconds are part of theirs); each counts
the step's graphs and the repeated blocks' bodies (frames of their own) together. mfsdp's
backend must stay linear in graph size: the per-layer growth of each column shows where it is
not. Last, ``steps``: the bytecode instructions Dynamo stepped through, every frame together,
the one column that does not move with the machine's noise (the same torch, model and
code give the same count), so a change in what Dynamo traces shows in it first.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("regional", "bodies", "whole", "fsdp2-compile", "torch-regional")


def _model(layers: int):
    import torch

    torch.manual_seed(0)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        from fsdp_compile.testing.models import Transformer, TransformerConfig

        cfg = TransformerConfig(vocab=256, dim=64, n_layers=layers, n_heads=4, hidden=128, max_seq=64)
        return "fsdp_compile Transformer", Transformer(cfg), cfg.vocab
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    return "HF LlamaForCausalLM", LlamaForCausalLM(cfg), cfg.vocab_size


def _blocks(model):
    return model.model.layers if hasattr(model, "model") else model.layers


@functools.cache
def _region_forward(cls):
    """``cls.forward`` as torch's nested compile region, one per class."""
    import torch

    return torch.compiler.nested_compile_region(cls.forward)


def _loss(model, tokens):
    out = model(input_ids=tokens, labels=tokens) if hasattr(model, "model") else model(tokens)
    if hasattr(out, "loss"):
        return out.loss
    import torch.nn.functional as F

    return F.cross_entropy(out.flatten(0, 1), tokens.flatten())


def measure(layers: int, mode: str, world: int, compiler: str, cached: bool) -> dict:
    """One first step in this process; seconds per stage."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import compilation_time_metrics
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    name, model, vocab = _model(layers)
    tokens = torch.randint(0, vocab, (2, 32))
    backend = None
    collecting = _CollectorClock()
    gc.callbacks.append(collecting)
    stepping = _DynamoSteps()
    start = time.perf_counter()
    if mode == "fsdp2-compile":
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        for block in _blocks(model):
            fsdp2_fully_shard(block)
            block.compile(backend="inductor" if compiler == "inductor" else "aot_eager")
        fsdp2_fully_shard(model)
        forward = model
    elif mode == "torch-regional":
        for block in _blocks(model):
            # One wrapped function for all blocks: Dynamo keeps its reuse entries per code object.
            block.forward = _region_forward(type(block)).__get__(block)
        forward = torch.compile(model, backend="inductor" if compiler == "inductor" else "aot_eager")
    else:
        from fsdp_compile import MfsdpBackend, fully_shard

        fully_shard(model)
        backend = MfsdpBackend(
            compiler=compiler, regional=mode != "whole", compile_outside_blocks=mode != "bodies",
            compile_cache=cached,
        )
        forward = torch.compile(model, backend=backend)
    with stepping:
        _loss(forward, tokens).backward()
    total = time.perf_counter() - start
    gc.callbacks.remove(collecting)
    metrics = {k: sum(v) for k, v in compilation_time_metrics.items()}
    ours = {"passes": 0.0, "partitioner": 0.0, "compiler": 0.0}
    for graph in backend.all_graphs() if backend else []:  # the step's, then the blocks' bodies
        for key in ours:
            ours[key] += graph.seconds[key]
    dist.destroy_process_group()
    return {
        "model": name,
        "layers": layers,
        "mode": mode,
        "compiler": compiler,
        "first_step_s": total,
        "dynamo_s": metrics.get("_compile.compile_inner", 0.0) - metrics.get("OutputGraph.call_user_compiler", 0.0),
        "joint_s": metrics.get("aot_trace_joint_graph", 0.0) + metrics.get("aot_collect_metadata", 0.0),
        **{f"{k}_s": v for k, v in ours.items()},
        "gc_s": collecting.seconds,
        "steps": stepping.count,
    }


class _CollectorClock:
    """Seconds Python's garbage collector ran, read from ``gc.callbacks``: a collection of
    the oldest generation walks every tracked object of the process (torch's and
    transformers' included), and a compile that keeps more objects alive starts more of them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


class _DynamoSteps:
    """Counts the bytecode instructions Dynamo steps through while the block is entered, by
    wrapping its (private) ``InstructionTranslatorBase.step``: a benchmark's probe, not
    the product's."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> None:
        from torch._dynamo.symbolic_convert import InstructionTranslatorBase

        self._translator, self._step = InstructionTranslatorBase, InstructionTranslatorBase.step

        def counted(translator):
            self.count += 1
            return self._step(translator)

        InstructionTranslatorBase.step = counted

    def __exit__(self, *exc) -> None:
        self._translator.step = self._step


def _fresh_process(layers: int, mode: str, world: int, compiler: str, cache: str, cached: bool) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    if not cached:
        env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    out = subprocess.run(
        [sys.executable, __file__, "--one", f"{layers},{mode},{world},{compiler},{int(cached)}"],
        env=env, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _runs(layers: int, mode: str, world: int, compiler: str, restart: bool) -> list[dict]:
    """A cold first step in a fresh process on an empty cache folder; with ``restart``, a
    second fresh process on the same folder, caches on (what a restart after preemption
    meets)."""
    with tempfile.TemporaryDirectory() as cache:
        cold = _fresh_process(layers, mode, world, compiler, cache, cached=restart)
        if not restart:
            return [cold]
        warm = _fresh_process(layers, mode, world, compiler, cache, cached=True)
    return [cold, {**warm, "mode": f"{mode} restart"}]


COLUMNS = ("first_step_s", "dynamo_s", "joint_s", "passes_s", "partitioner_s", "compiler_s", "gc_s", "steps")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,32,128")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--compiler", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--restart", action="store_true",
                        help="caches on; each run is followed by a restart on its cache folder")
    parser.add_argument("--json", default="")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        layers, mode, world, compiler, cached = args.one.split(",")
        print(json.dumps(measure(int(layers), mode, int(world), compiler, cached == "1")))
        return
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):
            for mode in args.modes.split(","):  # A B A B: modes alternate, so drift hits all alike
                for run in _runs(layers, mode, args.world, args.compiler, args.restart):
                    runs.setdefault(run["mode"], []).append(run)
        for mode, results in runs.items():
            row = {**results[0], **{c: statistics.median(r[c] for r in results) for c in COLUMNS}}
            rows.append(row)
            print(
                f"{row['model']:>24} {layers:>4} layers {mode:>22} ({args.compiler}): "
                + "  ".join(f"{c.removesuffix('_s')} {row[c]:{'6.2f' if c.endswith('_s') else '7.0f'}}" for c in COLUMNS),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
