"""Peak memory of a mode: CUDA allocator statistics, or the process's resident set.

CUDA: ``torch.cuda.max_memory_allocated`` from before the model is built to the last timed
step. Warm-up is included because a captured CUDA graph allocates its memory pool during
capture; counting only the replays would leave that pool out.

CPU: no allocator keeps a peak, and ``MemTracker`` cannot stand in: its module hooks register a
gradient hook on every parameter, which fails on the model's frozen positional table, and it
does not see allocations inside compiled code or custom ops. The resident set sees everything
the process touches, so the peak is Linux's ``VmHWM`` over the timed steps (reset to the
current resident set through ``/proc/self/clear_refs`` after warm-up, which leaves out the
compiler's own Python objects) minus the resident set before the model was built.
"""

from __future__ import annotations

import ctypes
import gc
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
            self.measure = "torch.cuda.max_memory_allocated from model build to the last step"
            torch.cuda.reset_peak_memory_stats(device)
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
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if not self.supported:
            return None
        return (_status_kib("VmHWM") - self.baseline_kib) / 2**10
