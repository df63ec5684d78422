"""What a bench run prints and writes: the machine, a table, ratios against what users run
today (FSDP2 + per-block compile, or FSDP2 when the run has no such mode), JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch
import torch.distributed as dist

_BASELINES = ("fsdp2-compile", "fsdp2")


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine_info(device: torch.device) -> dict:
    return {
        "cpu": cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "process_group": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# Dense bf16 tensor-core peaks (TFLOP/s, datasheet, without sparsity), for MFU.
_PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0, "A100": 312.0}


def peak_tflops(machine: dict, param_dtype: str) -> float | None:
    """The device's peak for the run's compute dtype; None on CPUs, unknown GPUs, fp32."""
    gpu = machine["gpu"] or ""
    if param_dtype != "bfloat16":
        return None
    return next((peak for name, peak in _PEAK_BF16_TFLOPS.items() if name in gpu), None)


def baseline_mode(results: list[dict]) -> str | None:
    """What users run today: FSDP2 + per-block compile when the run has it, else FSDP2."""
    modes = [r["mode"] for r in results]
    return next((m for m in _BASELINES if m in modes), None)


def add_derived(results: list[dict], peak: float | None) -> None:
    """Per result: tokens/s per rank and MFU from the median step; speed-up = baseline median
    / this median and memory = this peak / baseline's, against ``baseline_mode``."""
    name = baseline_mode(results)
    base = next((r for r in results if r["mode"] == name), None)
    for r in results:
        seconds = r["median_step_ms"] / 1e3
        r["tokens_per_s"] = r["tokens_per_step"] / seconds
        r["mfu"] = r["model_tflops_per_step"] / seconds / peak if peak else None
        r["speedup_vs_baseline"] = base and base["median_step_ms"] / r["median_step_ms"]
        both = base and base["peak_memory_mib"] and r["peak_memory_mib"] is not None
        r["memory_vs_baseline"] = r["peak_memory_mib"] / base["peak_memory_mib"] if both else None


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _mib_per_step(census: dict) -> float | None:
    """Bytes of every collective the step ran; None when one kind ran with unknown bytes."""
    kinds = [k for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all") if census[k]]
    if any(census[f"{k}_bytes"] is None for k in kinds):
        return None
    return sum(census[f"{k}_bytes"] for k in kinds) / 2**20


_COLUMNS = (
    ("mode", "<16"),
    ("median ms", ">10"),
    ("speed-up", ">9"),
    ("tok/s/rank", ">11"),
    ("MFU", ">6"),
    ("exposed ms", ">11"),
    ("peak MiB", ">9"),
    ("mem ratio", ">10"),
    ("held MiB", ">9"),
    ("step peak MiB", ">14"),
    ("AG/step", ">8"),
    ("RS/step", ">8"),
    ("AR/step", ">8"),
    ("MiB/step", ">9"),
    ("warm-up s", ">10"),
    ("loss@0", ">9"),
    ("final loss", ">11"),
)


def _row(r: dict) -> tuple:
    comms = r["collectives"]
    return (
        r["mode"],
        _fmt(r["median_step_ms"], ".2f"),
        _fmt(r["speedup_vs_baseline"], ".2f") + ("x" if r["speedup_vs_baseline"] else ""),
        _fmt(r["tokens_per_s"], ".0f"),
        _fmt(r["mfu"], ".1%"),
        _fmt(r["exposed_comm_ms"], ".2f"),
        _fmt(r["peak_memory_mib"], ".1f"),
        _fmt(r["memory_vs_baseline"], ".2f"),
        _fmt(r["held_memory_mib"], ".1f"),
        _fmt(r.get("step_peak_mib"), ".1f"),
        comms["all_gather"],
        comms["reduce_scatter"],
        comms["all_reduce"],
        _fmt(_mib_per_step(comms), ".1f"),
        _fmt(r["warmup_s"], ".1f"),
        _fmt(r["loss_step0"], ".5f"),
        _fmt(r["final_loss"], ".5f"),
    )


def print_report(document: dict) -> None:
    machine, config, results = document["machine"], document["config"], document["results"]
    where = machine["gpu"] or f"{machine['cpu']}, {machine['cpu_cores']} cores"
    layout = document["layout"]
    split = f" as dp {layout['dp']} x tp {layout['tp']}" if layout["tp"] > 1 else ""
    print(
        f"\n{where}; torch {machine['torch']}, {machine['process_group']}, "
        f"world size {machine['world_size']}{' (fake)' if config['fake_world'] else ''}{split}"
        f"{', emulated ' + config['emulate_link'] + ' link' if config['emulate_link'] else ''}; "
        f"preset {config['preset']}, "
        f"{config['batch']} x {config['seq']} tokens per {'data-parallel ' if config.get('tp', 1) > 1 else ''}rank, {config['steps']} timed steps"
    )
    print(f"speed-up and memory ratio against {document['baseline']}")
    print("".join(format(name, spec) for name, spec in _COLUMNS))
    for r in results:
        print("".join(format(value, spec) for value, (_, spec) in zip(_row(r), _COLUMNS)))
    print(
        f"warm-up s: each mode's compile and warm-up steps; the process's one-time compile costs "
        f"came first, {document['process_warmup_s']:.1f} s on rank 0"
    )
    if results:
        print(f"peak memory: {results[0]['memory_measure']} (largest over ranks)")
        held = "allocated" if results[0]["held_reserved_mib"] is not None else "resident set"
        print(f"held MiB: {held} after the last step, above the state before the model was built")
        if results[0].get("step_peak_mib") is not None:
            print("step peak MiB: the CPU allocator's most bytes held during the profiled step, above its start")
    for r in results:
        print(f"collectives of {r['mode']}: {r['collectives']['counted_by']}")
        kernels = r.get("profiled_kernels")
        if kernels:
            print(
                f"kernels of {r['mode']} (profiled step): {kernels['kernel_ms']:.1f} ms in "
                f"{kernels['launches']} launches, step {kernels['step_ms']:.1f} ms under the profiler"
            )
        if r["held_reserved_mib"] is not None:
            print(
                f"held by {r['mode']} after the last step: {r['held_memory_mib']:.1f} MiB allocated, "
                f"{r['held_reserved_mib']:.1f} MiB reserved (a captured graph's pool counts here)"
            )
        print(f"attention of {r['mode']} (profiled step): {attention_summary(r)}")
    for r in results:
        _print_memory_sites(r)
    for r in results:
        caches = r["compile_cache"]
        if caches["folder"]:
            print(
                f"compile caches of {r['mode']} (rank 0, {caches['folder']}): AOTAutograd "
                f"{caches['aot_autograd_hits']} hits, {caches['aot_autograd_misses']} misses; "
                f"FX graphs {caches['fx_graph_hits']} hits, {caches['fx_graph_misses']} misses"
            )
    for mode, reason in document["skipped"].items():
        print(f"skipped {mode}: {reason}")
    print(json.dumps(document), flush=True)


def attention_summary(r: dict) -> str:
    """The SDPA backends one mode's profiled step ran: its kernels on CUDA, the ops it
    dispatched elsewhere (a replayed CUDA graph dispatches none); "none seen" when neither
    shows one (the math backend, compiled, is matmuls and a softmax)."""
    kernels = r.get("profiled_kernels")
    if kernels:
        seen = [f"{backend} {n} kernels ({ms:.1f} ms)" for backend, (ms, n) in kernels["attention"].items()]
    else:
        seen = [f"{op} {n}" for op, n in r["attention_ops"].items()]
    return ", ".join(seen) or "none seen"


def _print_memory_sites(r: dict) -> None:
    sites = r.get("memory_sites")
    if not sites:
        return
    dropped = ", the oldest events dropped: sites undercounted" if sites["oldest_dropped"] else ""
    print(f"memory of {r['mode']} by allocation site ({sites['events']} allocator events{dropped}):")
    for label, key in (("live after the last timed step", "after_steps"), ("live at the peak (warm-up and capture included)", "at_peak")):
        print(f"  {label}: {sites[key + '_mib']:.1f} MiB")
        for site in sites[key]:
            print(f"    {site['mib']:10.1f} MiB {site['blocks']:6d} blocks  {site['site']}")


def write_json(document: dict, path: str) -> None:
    """Written whole or not at all: the file is rewritten after each mode, and a run killed
    while writing it must leave the last complete version for whoever reads it next."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(f"{path}.partial")
    partial.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(partial, path)
