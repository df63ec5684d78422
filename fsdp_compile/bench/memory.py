"""Peak memory of a mode and what it holds between steps: CUDA allocator statistics, or the
process's resident set; on CUDA, on request, where the memory goes (``AllocationSites``).

CUDA: ``torch.cuda.max_memory_allocated`` from before the model is built to the last timed
step, less what was allocated before (a mode's own, whatever earlier modes of the process
left). Warm-up is included because a captured CUDA graph allocates its memory pool during
capture; counting only the replays would leave that pool out.

CPU: no allocator keeps a peak (the profiled step's allocator peak is ``step_peak_bytes``, from
the profiler's memory events), and ``MemTracker`` cannot stand in: its module hooks register a
gradient hook on every parameter, which fails on the model's frozen positional table, and it
does not see allocations inside compiled code or custom ops. The resident set sees everything
the process touches, so the peak is Linux's ``VmHWM`` over the timed steps (reset to the
current resident set through ``/proc/self/clear_refs`` after warm-up, which leaves out the
compiler's own Python objects) minus the resident set before the model was built.

Held between steps (after the last timed step, less what was held before the model was built):
the weights, gradients and optimizer state a step leaves for the next, and anything kept by
mistake. On CUDA, what the allocator has handed out, and what it keeps reserved once its
cache is emptied: a captured graph's private pool stays reserved for its replays, so only the
reserved figure shows what capture holds. On CPU, the resident set.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import linecache
import os
import sysconfig
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"  # see proc(5), /proc/pid/clear_refs


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def _release_freed_heap() -> None:
    """Return memory freed by an earlier mode to the OS, so it is not reused unseen."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed heap may hide some growth
        pass


class PeakMemory:
    """Make one before building the model, call ``warmup_done()``, then ``peak_mib()``."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.device = device
        if self.on_cuda:
            self.measure = "torch.cuda.max_memory_allocated from model build to the last step, less what was allocated before"
            torch.cuda.reset_peak_memory_stats(device)
            self.allocated_before = torch.cuda.memory_allocated(device)
            self.reserved_before = torch.cuda.memory_reserved(device)
            return
        self.supported = _CLEAR_REFS.exists() and _STATUS.exists()
        self.measure = (
            "process peak RSS (VmHWM) over the timed steps minus RSS before the model was built"
            if self.supported
            else "not measured (needs Linux /proc/self/clear_refs)"
        )
        if self.supported:
            _release_freed_heap()
            self.baseline_kib = _status_kib("VmRSS")

    def warmup_done(self) -> None:
        """Warm-up is over: on CPU, start the peak here."""
        if not self.on_cuda and self.supported:
            # Drop what warm-up freed (the unsharded model, compile-time buffers) first, so
            # the peak starts from memory in use rather than from heap kept for reuse.
            _release_freed_heap()
            _CLEAR_REFS.write_text(_RESET_PEAK_RSS)

    def peak_mib(self) -> float | None:
        if self.on_cuda:
            return (torch.cuda.max_memory_allocated(self.device) - self.allocated_before) / 2**20
        if not self.supported:
            return None
        return (_status_kib("VmHWM") - self.baseline_kib) / 2**10

    def held_mib(self) -> tuple[float | None, float | None]:
        """After the last step, MiB above the state before the build: (held, reserved). Held is
        CUDA's allocated memory or the CPU's resident set; reserved, CUDA only, is what the
        allocator keeps after ``empty_cache`` (None on CPU)."""
        if self.on_cuda:
            torch.cuda.empty_cache()
            return (
                (torch.cuda.memory_allocated(self.device) - self.allocated_before) / 2**20,
                (torch.cuda.memory_reserved(self.device) - self.reserved_before) / 2**20,
            )
        if not self.supported:
            return None, None
        _release_freed_heap()
        return (_status_kib("VmRSS") - self.baseline_kib) / 2**10, None


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Within: Python's cyclic collector off, after a collection. It frees cyclic garbage
    (autograd graphs, compiled frames' leftovers) whenever the process's history says, so a
    step measured with it on peaks by up to several MiB more or less from one run to the
    next; off, the peak is the step's own."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def step_peak_bytes(prof: torch.profiler.profile) -> int:
    """The most bytes the CPU allocator held at once during a region profiled with
    ``profile_memory=True``, above what it held as the region began: its memory events in
    time order, frees of what was allocated before counted too. They see every allocation, a
    compiled graph's and a custom op's included, at the allocator, where the resident set
    sees pages (freed heap kept for reuse, pages touched late)."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_HISTORY_ENTRIES = 4_000_000
"""Allocator events kept per mode, a generous bound; past it the allocator drops the oldest
and the report says so (its sites then miss what those events allocated)."""


def allocation_site(frames: list[dict]) -> str:
    """Where an allocation comes from, for a reader: its innermost Python frame outside torch's
    own code and the standard library, so generated code (FX's ``<eval_with_key>``, Inductor's
    output modules), fsdp_compile, the model and torch's optimizers (the user's state) each
    name their line; with the line's source when Python can find it."""
    for frame in frames:
        name = frame["filename"]
        if (name.startswith(_TORCH_DIR) and not name.startswith(_OPTIM_DIR)) or name.startswith(_STDLIB_DIR):
            continue
        source = linecache.getline(name, frame["line"]).strip()
        where = f"{name.split('site-packages' + os.sep)[-1]}:{frame['line']} {frame['name']}"
        return f"{where} | {source[:100]}" if source else where
    return "no Python frame outside torch" if frames else "no Python stack recorded"


def _by_site(blocks: Iterable[dict], top: int) -> list[dict]:
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for block in blocks:
        site = sites[allocation_site(block.get("frames", []))]
        site[0] += block["size"]
        site[1] += 1
    ranked = sorted(sites.items(), key=lambda item: -item[1][0])[:top]
    return [{"site": site, "mib": size / 2**20, "blocks": count} for site, (size, count) in ranked]


def _replay(events: list[dict]) -> Iterator[tuple[int, dict[int, dict], int]]:
    """After each event (``alloc`` and ``free_completed``, oldest first): its index, the blocks
    live then by address (one dict, updated in place), and their total bytes. A free of a block
    allocated before recording began is ignored."""
    live: dict[int, dict] = {}
    total = 0
    for at, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        yield at, live, total


def memory_by_site(events: list[dict], timed_from: int, top: int, dropped: bool = False) -> dict:
    """The ``top`` sites holding the most memory after the last event, and at the largest total
    from event ``timed_from`` on. Only what was allocated while recording is seen, so recording
    starts before the model is built."""
    peak, peak_at, after, after_total = 0, None, {}, 0
    for at, live, total in _replay(events):
        if at >= timed_from and total > peak:
            peak, peak_at = total, at
        after, after_total = live, total
    at_peak = next((dict(live) for at, live, _ in _replay(events) if at == peak_at), {})
    return {
        "after_steps_mib": after_total / 2**20,
        "after_steps": _by_site(after.values(), top),
        "at_peak_mib": peak / 2**20,
        "at_peak": _by_site(at_peak.values(), top),
        "events": len(events),
        "oldest_dropped": dropped,
    }


class AllocationSites:
    """``--memory-sites N`` on CUDA: the caching allocator records every allocation with its
    Python stack from before the model is built; at the end, what is live after the last timed
    step (what one step leaves for the next: weights, gradients, optimizer state, and anything
    held by mistake) and at the peak, by allocation site (``memory_by_site``). The peak spans
    what the peak column's does on CUDA, from the model's build to the last step: warm-up and
    a captured graph's capture included, where a captured step allocates all it uses.

    A debugging aid, not a measurement: recording stacks slows every allocation."""

    def __init__(self, device: torch.device, top: int) -> None:
        self.device, self.top = device, top
        torch.cuda.memory._record_memory_history(max_entries=_HISTORY_ENTRIES, stacks="python", device=device)

    def _events(self) -> list[dict]:
        return torch.cuda.memory._snapshot(self.device)["device_traces"][self.device.index or 0]

    def report(self) -> dict:
        events = self._events()
        torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        return memory_by_site(events, 0, self.top, dropped=len(events) >= _HISTORY_ENTRIES)
