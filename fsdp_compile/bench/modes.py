"""One bench mode, built and run: the same model, seed, data and AdamW, sharded eight ways.

HF presets are built on the meta device, sharded, then materialised (each rank draws its
own shards, the same in every mode); the others are built whole from the seed first. With
``tp`` > 1 every mode first splits each decoder layer by the preset's tensor-parallel plan on
the "tp" dimension of a (dp, tp) mesh, then shards over "dp".

- ``eager``: ``fully_shard(model)`` called directly (our markers run real collectives);
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each block, then on the root;
- ``fsdp2-compile``: ``fsdp2`` with each block compiled on its own (what torchtitan users run):
  Inductor, or ``aot_eager`` when mfsdp's compiler is the eager runner, so both modes compile
  alike;
- ``mfsdp``: ``torch.compile(fully_shard(model), backend=MfsdpBackend(compiler=...))``, the
  ``backend="mfsdp"`` backend as an object, so its compiled graphs can be counted;
- ``mfsdp-whole``: ``mfsdp`` with ``regional=False``: every block traced and compiled in the
  one graph instead of one body per repeated block;
- ``mfsdp-bodies``: ``mfsdp`` with ``compile_outside_blocks=False``: Inductor compiles the
  blocks' bodies only, the code outside them runs as ATen calls (NOTE: what Inductor
  compiles, in fsdp_compile/backend.py);
- ``mfsdp-gather-whole``: ``mfsdp`` with ``gather_whole_members=True``: each layer gathered
  member by member, read as views, no copy-out (NOTE: members gathered whole, in
  fsdp_compile/whole_gathers.py); on ``--emulate-link`` each member is a collective of its own,
  paying the link's latency, where NCCL runs a layer's members as one group;
- ``mfsdp-cudagraph``: ``mfsdp`` with ``cuda_graph=True``, the whole step captured by
  ``capture_step`` (CUDA only).

Step order, the same in every mode: ``warmup`` steps on the first batch (``capture_step`` warms
up on its static inputs, so every mode does), one profiled step (collectives), then the timed
steps, each on a fresh batch.

NOTE: each mode compiles cold
    Modes run one after another in one process, and Inductor keeps what it compiled in its
    cache folder and in memory (kernels by source code): a mode after another would load the
    kernels they share (a block compiled by FSDP2 + per-block compile and the same block's
    body compiled by mfsdp) and its warm-up would not be a first compile. So each mode
    compiles in a folder of its own with the in-memory caches cleared (``compile_caches``):
    by default a fresh one, the FX graph and AOTAutograd caches off, as a first start meets;
    with ``--compile-cache DIR``, ``DIR/<mode>`` with the caches on, so a second run over the
    same folder measures what a restart after preemption meets, and says how many graphs it
    loaded.

    What a process pays once, at its first compile, whichever mode it is for (Inductor's
    compile workers, probing the C++ compiler, importing the code generators: about 12 s on
    a 2-core CPU), is paid before the first mode (``warm_up_process``), so that no mode's
    warm-up carries it: each measures its own compile, in any order. It compiles in a folder
    of its own too, ``DIR/process-warm-up`` with ``--compile-cache DIR``: a restart finds the
    compiler's probes there (9 of those 12 s), as a restarted job finds them in its cache
    folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
from torch._inductor.utils import _set_env, fresh_cache
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.profiler import ProfilerActivity, profile

try:
    from tqdm import tqdm
except ImportError as missing:
    raise ImportError("mfsdp-bench needs its extra: pip install 'fsdp_compile[bench]'") from missing

from fsdp_compile import MfsdpBackend, MixedPrecision, capture_step, fully_shard
from fsdp_compile.bench.comms import (
    attention_op_census,
    graph_census,
    issued_census,
    kernel_census,
    profiled_census,
)
from fsdp_compile.bench.emulated_link import EmulatedLinkGroup
from fsdp_compile.bench.memory import AllocationSites, PeakMemory, collector_off, step_peak_bytes
from fsdp_compile.bench.presets import (
    PRESETS,
    HFPreset,
    blocks,
    build,
    layer_tp_plan,
    materialize,
    train_flops,
)
from fsdp_compile.errors import UsageError
from fsdp_compile.float8 import float8_extra_missing
from fsdp_compile.testing.models import make_batch, train_step_fn

MODES = (
    "eager", "fsdp2", "fsdp2-compile", "mfsdp", "mfsdp-whole", "mfsdp-bodies", "mfsdp-gather-whole", "mfsdp-cudagraph",
)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What every mode of one bench run shares (the CLI's settings, resolved)."""

    preset: str
    batch: int
    """Sequences per rank per step."""
    seq: int
    warmup: int
    steps: int
    """Timed steps, after warm-up and the profiled step."""
    compiler: str
    """``mfsdp``'s compiler: "inductor" or "eager"."""
    param_dtype: torch.dtype
    """Compute and all-gather dtype; gradients are reduced in fp32 and weights kept in fp32."""
    float8: bool = False
    """Linears converted to torchao float8 training, weights gathered in float8."""
    lr: float
    seed: int
    compile_cache: str = ""
    """A folder: each mode compiles with the caches on in a folder of its own inside it (NOTE:
    each mode compiles cold); empty: a fresh folder per mode, the caches off."""
    memory_sites: int = 0
    """CUDA: report this many allocation sites of each mode (``AllocationSites``); 0: off."""
    tp: int = 1
    """Tensor-parallel ranks: the world is a (world / tp, tp) mesh of ("dp", "tp"); 1: none."""


# torch's compile counters that say whether a graph was compiled or loaded:
# (counters group, key) -> the name the bench reports.
_CACHE_COUNTERS = {
    ("aot_autograd", "autograd_cache_hit"): "aot_autograd_hits",
    ("aot_autograd", "autograd_cache_miss"): "aot_autograd_misses",
    ("inductor", "fxgraph_cache_hit"): "fx_graph_hits",
    ("inductor", "fxgraph_cache_miss"): "fx_graph_misses",
}


@contextlib.contextmanager
def compile_caches(mode: str, folder: str) -> Iterator[dict]:
    """Where ``mode`` compiles (NOTE: each mode compiles cold); yields a dict that holds, on
    exit, the folder and the cache hits and misses of everything compiled inside."""
    before = {(group, key): counters[group][key] for group, key in _CACHE_COUNTERS}
    where = Path(folder, mode).resolve() if folder else None
    report: dict = {"folder": str(where) if where else None}
    if where:
        # Triton's compiled kernels too, where torch's fresh_cache puts them.
        with temporary_cache_dir(str(where)), _set_env("TRITON_CACHE_DIR", str(where / "triton")):
            yield report
    else:
        with (
            fresh_cache(),
            inductor_config.patch(fx_graph_cache=False),
            functorch_config.patch(enable_autograd_cache=False),
        ):
            yield report
    for (group, key), name in _CACHE_COUNTERS.items():
        report[name] = counters[group][key] - before[group, key]


def warm_up_process(run: RunConfig, device: torch.device) -> float:
    """Compile and differentiate a small function with the modes' compiler (NOTE: each mode
    compiles cold), in a folder of its own, before any mode; its seconds."""
    start = time.perf_counter()
    with compile_caches("process-warm-up", run.compile_cache):
        x = torch.randn(16, 16, device=device, requires_grad=True)
        compiled = torch.compile(
            lambda t: (t @ t).softmax(-1).sum(), backend="inductor" if run.compiler == "inductor" else "aot_eager"
        )
        compiled(x).backward()
    _sync(device)
    torch._dynamo.reset()
    return time.perf_counter() - start


def skip_reason(mode: str, device: torch.device) -> str | None:
    if mode == "mfsdp-cudagraph" and device.type != "cuda":
        return "needs CUDA: capture_step records a CUDA graph"
    return None


def check_float8_available() -> None:
    """Raise ``UsageError`` naming the install when torchao is missing."""
    if importlib.util.find_spec("torchao") is None:
        raise UsageError(float8_extra_missing())


def convert_linears_to_float8(model: nn.Module) -> None:
    """torchao float8 training with float8 all-gather for every linear the float8 matmul can
    take (both dims multiples of 16), the output head left in high precision as torchtitan
    does."""
    check_float8_available()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def converted(module: nn.Module, fqn: str) -> bool:
        return fqn not in ("lm_head", "head", "output") and all(s % 16 == 0 for s in module.weight.shape)

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=converted)


def _build(mode: str, run: RunConfig, device: torch.device):
    """(model, forward, backend or None): ``forward(tokens)`` gives the logits each step reads."""
    torch.manual_seed(run.seed)
    preset = PRESETS[run.preset]
    model = build(preset)
    if run.float8:
        convert_linears_to_float8(model)
    if not isinstance(preset, HFPreset):
        model = model.to(device)
    mesh = _data_parallel_mesh(model, run, device)
    backend = None
    if mode in ("fsdp2", "fsdp2-compile"):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        policy = MixedPrecisionPolicy(param_dtype=run.param_dtype, reduce_dtype=torch.float32)
        for block in blocks(model):
            fsdp2_fully_shard(block, mesh=mesh, mp_policy=policy)
            if mode == "fsdp2-compile":
                block.compile(backend="inductor" if run.compiler == "inductor" else "aot_eager")
        fsdp2_fully_shard(model, mesh=mesh, mp_policy=policy)
        forward = model
    else:
        policy = MixedPrecision(param_dtype=run.param_dtype, reduce_dtype=torch.float32)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        forward = model
        if mode != "eager":
            backend = MfsdpBackend(
                compiler=run.compiler,
                cuda_graph=mode == "mfsdp-cudagraph",
                regional=mode != "mfsdp-whole",
                compile_outside_blocks=mode != "mfsdp-bodies",
                gather_whole_members=mode == "mfsdp-gather-whole",
                compile_cache=bool(run.compile_cache),
            )
            forward = torch.compile(model, backend=backend)
    materialize(model, device, run.seed + dist.get_rank())
    if isinstance(preset, HFPreset):
        return model, lambda tokens: forward(input_ids=tokens).logits, backend
    return model, forward, backend


def _data_parallel_mesh(model: nn.Module, run: RunConfig, device: torch.device) -> DeviceMesh:
    """The mesh a mode shards over: the world, or with ``run.tp`` > 1 the "dp" dimension of a
    (dp, tp) mesh, each decoder layer split over "tp" first (``layer_tp_plan``), as FSDP2
    users split before ``fully_shard``."""
    world = dist.get_world_size()
    if run.tp == 1:
        return init_device_mesh(device.type, (world,))
    mesh = init_device_mesh(device.type, (world // run.tp, run.tp), mesh_dim_names=("dp", "tp"))
    plan = layer_tp_plan(model)
    for block in blocks(model):
        parallelize_module(block, mesh["tp"], plan)
    return mesh["dp"]


def _batches(run: RunConfig, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Warm-up batch, profiled batch, then one per timed step; this data-parallel rank's
    share of each, which the ranks of its tensor-parallel group all read (the mesh is
    row-major: rank = dp rank x tp + tp rank)."""
    preset, rank = PRESETS[run.preset], dist.get_rank() // run.tp
    made = (make_batch(preset, run.batch, run.seq, step, rank) for step in range(run.steps + 2))
    return [(tokens.to(device), targets.to(device)) for tokens, targets in made]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode: str, run: RunConfig, device: torch.device) -> dict:
    """Build, warm up, profile one step, time ``run.steps`` steps; this rank's numbers."""
    with compile_caches(mode, run.compile_cache) as caches:
        result = _run(mode, run, device)
    return {**result, "compile_cache": caches}


def _run(mode: str, run: RunConfig, device: torch.device) -> dict:
    memory = PeakMemory(device)
    sites = AllocationSites(device, run.memory_sites) if run.memory_sites else None
    model, forward, backend = _build(mode, run, device)
    # capturable keeps AdamW's step count on the device, which capture needs; every mode
    # gets the same optimizer.
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, capturable=device.type == "cuda")
    step = train_step_fn(forward, opt)
    batches = _batches(run, device)

    start = time.perf_counter()
    step, first_loss = _warmed_up(mode, step, batches[0], run.warmup)
    _sync(device)
    warmup_s = time.perf_counter() - start
    link = dist.distributed_c10d._get_default_group()
    emulated = isinstance(link, EmulatedLinkGroup)
    prof, profiled, profiled_ms = _profiled_step(step, batches[1], device, link)

    memory.warmup_done()
    times, exposed = [], []
    for tokens, targets in tqdm(batches[2:], desc=mode, disable=dist.get_rank() != 0):
        blocked = getattr(link, "exposed_s", 0.0)
        start = time.perf_counter()
        loss = step(tokens, targets)
        _sync(device)
        times.append(time.perf_counter() - start)
        exposed.append(getattr(link, "exposed_s", 0.0) - blocked)
    held_mib, held_reserved_mib = memory.held_mib()
    result = {
        "mode": mode,
        "median_step_ms": 1e3 * statistics.median(times),
        "step_ms": [1e3 * t for t in times],
        "peak_memory_mib": memory.peak_mib(),
        # CPU: the allocator's peak over the profiled step, above what it held as it began.
        "step_peak_mib": step_peak_bytes(prof) / 2**20 if device.type == "cpu" else None,
        "memory_measure": memory.measure,
        "held_memory_mib": held_mib,
        "held_reserved_mib": held_reserved_mib,
        "warmup_s": warmup_s,
        "loss_step0": float(first_loss),
        "final_loss": float(loss),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        # The job's tokens per step over its ranks: a tensor-parallel group shares its batch.
        "tokens_per_step": run.batch * run.seq / run.tp,
        # Measured where the emulated link can see it: the time a CPU step blocked in waits.
        "exposed_comm_ms": (
            1e3 * statistics.median(exposed)
            if emulated and device.type == "cpu" else None
        ),
        "model_tflops_per_step": train_flops(PRESETS[run.preset], run.batch, run.seq, run.tp) / 1e12,
        "profiled_collectives": profiled,
        "profiled_kernels": kernel_census(prof, profiled_ms) if device.type == "cuda" else None,
        "attention_ops": attention_op_census(prof),
        "memory_sites": sites.report() if sites else None,
    }
    # A graph loaded from the compile cache was never compiled here: nothing to count in it.
    compiled_here = backend is not None and all(g.compiled for g in backend.all_graphs())
    result["collectives"] = (
        graph_census(backend.graphs) if compiled_here else result["profiled_collectives"]
    )
    if mode == "mfsdp-cudagraph":
        step.teardown()
    return result


def _warmed_up(mode: str, step, batch: tuple, warmup: int) -> tuple:
    """``step`` after ``warmup`` steps on ``batch`` (captured whole for mfsdp-cudagraph), and
    the first step's loss."""
    if mode == "mfsdp-cudagraph":
        captured = capture_step(step, *batch, warmup_steps=warmup)
        return captured, captured.warmup_outputs[0]
    first_loss = step(*batch)
    for _ in range(warmup - 1):
        step(*batch)
    return step, first_loss


def _profiled_step(step, batch: tuple, device: torch.device, link) -> tuple:
    """One step under the profiler: the profile, the collectives it issued (as the emulated
    link saw them, or as the profiler did) and its time in ms."""
    emulated = isinstance(link, EmulatedLinkGroup)
    issued_before = len(link.issued) if emulated else 0
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    profiling = profile(activities=activities, record_shapes=True, profile_memory=device.type == "cpu")
    with collector_off(), profiling as prof:
        start = time.perf_counter()
        step(*batch)
        _sync(device)
        profiled_ms = 1e3 * (time.perf_counter() - start)
    profiled = issued_census(link.issued[issued_before:]) if emulated else profiled_census(prof)
    return prof, profiled, profiled_ms


def agree_across_ranks(result: dict, device: torch.device) -> dict:
    """Slowest rank's median, largest peak and held memory (a step waits for every rank, the
    largest rank sets the memory a job needs); mean losses.

    Each rank's loss is on its own batch; their mean is the loss of the global batch.
    """
    peak, held = result["peak_memory_mib"], result["held_memory_mib"]
    worst = torch.tensor([result["median_step_ms"], peak or 0.0, held or 0.0], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    losses = torch.tensor([result["loss_step0"], result["final_loss"]], device=device)
    dist.all_reduce(losses)
    losses /= dist.get_world_size()
    return {
        **result,
        "median_step_ms": worst[0].item(),
        "peak_memory_mib": None if peak is None else worst[1].item(),
        "held_memory_mib": None if held is None else worst[2].item(),
        "loss_step0": losses[0].item(),
        "final_loss": losses[1].item(),
    }
