"""Debug dumps: what the backend did to each graph, as files a person reads.

Turn on with ``torch.compile(..., options={"debug_dir": PATH})`` or ``MFSDP_DEBUG_DIR=PATH``.
Layout (also written as README.md into every graph folder)::

    PATH/rank<R>/
      frames/<function>-<line>.py     depyf: the frame's user source, decompiled, and the
                                      transformed bytecode that calls the compiled graphs
      graph_<id>/                     one per graph Dynamo compiled (several with graph breaks,
                                      and one per repeated block's body: a frame of its own,
                                      compiled once for every layer; fsdp_compile/block_call.py)
        README.md
        passes/00_dynamo.py           Dynamo's graph; each node under a "# File: ..." comment
                                      naming the user source line it came from
        passes/NN_<pass>.py           the graph after each pass, stage inputs in between
        passes/NN_forward.py          the partitioned forward graph as compiled
        passes/NN_backward.py         the partitioned backward graph as compiled
        plan.json                     the Plan: every parameter, owner, group, dtypes, bytes
        schedule.json                 every collective: kind, bucket, bytes, issue and wait
                                      positions, the compute between them, and the estimated
                                      timeline with its hardware model
        timeline.png                  compute and communication lanes, estimated

Each rank writes only under its own ``rank<R>`` folder and every file is written to a temporary
name and renamed, so ranks dumping at once never interleave.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import sys
import tempfile
import types
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx

from fsdp_compile.errors import CompileUsageError
from fsdp_compile.plan import Plan
from fsdp_compile.cost_model import NVLINK_GPU, Hardware, collective_schedule, estimate_timeline

__all__ = ["GraphDumper", "debug_dir", "DEBUG_DIR_ENV"]

DEBUG_DIR_ENV = "MFSDP_DEBUG_DIR"


def debug_dir(option: str | None) -> Path | None:
    """The dump root: the ``debug_dir`` option, else ``$MFSDP_DEBUG_DIR``, else None. Asked
    for without the ``[debug]`` extra, a ``CompileUsageError`` before anything is traced."""
    root = option or os.environ.get(DEBUG_DIR_ENV)
    if not root:
        return None
    missing = [name for name in ("depyf", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:
        raise CompileUsageError(
            f"debug dumps (debug_dir={root!r}) need {' and '.join(missing)}: "
            f"pip install 'fsdp_compile[debug]', or drop debug_dir and ${DEBUG_DIR_ENV}."
        )
    return Path(root)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def write_atomic(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    with tempfile.NamedTemporaryFile(mode, dir=path.parent, delete=False, prefix=".tmp-") as f:
        f.write(data)
    os.replace(f.name, path)


def _readme() -> str:
    layout = __doc__.split("Layout (also written as README.md into every graph folder)::")[1]
    layout = layout.split("Each rank writes")[0]
    return "# mfsdp debug dump\n\nWhat each file is:\n\n```" + layout.rstrip() + "\n```\n"


class GraphDumper:
    """Writes the dump folder of one compiled graph as the backend reaches each stage."""

    def __init__(self, root: Path, plan: Plan, hardware: Hardware = NVLINK_GPU) -> None:
        name = re.sub(r"[^0-9A-Za-z]+", "_", plan.graph_name).strip("_") or "graph"
        self.folder = root / f"rank{_rank()}" / f"graph_{name}"
        self.plan = plan
        self.hardware = hardware
        self.count = 0
        self.partitioned: dict[str, fx.GraphModule] = {}
        write_atomic(self.folder / "README.md", _readme())
        write_atomic(self.folder / "plan.json", plan.to_json())

    def graph(self, name: str, gm: fx.GraphModule) -> None:
        """Dump ``gm`` as readable Python, numbered in the order stages and passes ran."""
        code = gm.print_readable(print_output=False, include_stride=False, include_device=True)
        write_atomic(self.folder / "passes" / f"{self.count:02d}_{name}.py", code)
        self.count += 1

    def compiled(self, role: str, gm: fx.GraphModule) -> None:
        """A partitioned graph reached its compiler: dump it and refresh schedule and timeline."""
        self.graph(role, gm)
        self.partitioned[role] = gm
        schedule, timelines = [], []
        for graph_role, graph in self.partitioned.items():
            schedule += [asdict(c) for c in collective_schedule(graph, self.plan, graph_role)]
            timelines.append(estimate_timeline(graph, graph_role, self.hardware))
        document = {
            "graph": self.plan.graph_name,
            "collectives": schedule,
            "timelines": [
                {
                    "graph": t.graph,
                    "step_seconds": t.step_seconds,
                    "exposed_comm_seconds": t.exposed_comm_seconds,
                }
                for t in timelines
            ],
            "hardware": asdict(self.hardware),
            "note": "times are estimates of fsdp_compile.cost_model, not measurements",
        }
        write_atomic(self.folder / "schedule.json", json.dumps(document, indent=2))
        write_atomic(self.folder / "timeline.png", draw_timeline(timelines))


def draw_timeline(timelines) -> bytes:
    """PNG bytes: per graph, a compute lane and a communication lane on a shared time axis."""
    import io

    # A Figure of its own, not pyplot: pyplot's global state (and the user's backend) stay
    # untouched, and nothing needs closing.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 1.8 * len(timelines) + 0.6))
    axes = fig.subplots(len(timelines), 1, squeeze=False)
    for ax, timeline in zip(axes[:, 0], timelines):
        lanes = {"compute": 1, "comm": 0}
        colors = {"compute": "#4c72b0", "comm": "#dd8452"}
        # One collection per lane: an artist per span made the drawing the slowest part of a
        # dumping compile (seconds for a small model, thousands of spans for a large one).
        for lane, row in lanes.items():
            bars = [(s.start * 1e6, (s.end - s.start) * 1e6) for s in timeline.spans if s.lane == lane]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[lane], edgecolor="white", linewidth=0.2)
        ax.set_yticks([0, 1], ["communication", "compute"])
        ax.set_xlim(0, max(timeline.step_seconds * 1e6, 1e-3))
        exposed = timeline.exposed_comm_seconds / max(timeline.step_seconds, 1e-12)
        ax.set_title(
            f"{timeline.graph}: {timeline.step_seconds * 1e6:.1f} us estimated, "
            f"exposed communication {timeline.exposed_comm_seconds * 1e6:.1f} us ({exposed:.0%})",
            fontsize=9,
        )
    axes[-1, 0].set_xlabel(f"microseconds (estimated for {timelines[0].hardware.name})")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def frame_dumper(root: Path) -> Callable[[Callable], Callable]:
    """Called while the backend compiles a frame's graph: a wrapper for the compiled graph
    that, at its first call, writes the frame into ``root/rank<R>/frames``, decompiled as the
    user wrote it and as Dynamo rewrote it. The rewritten code exists only once the compile
    is over, and at that first call it is the frame that calls the graph. Nothing process-wide
    is installed: two models compiled in one process with different ``debug_dir`` write
    their frames each into their own folder."""
    from torch._dynamo import symbolic_convert

    tracing = getattr(symbolic_convert.tls, "current_tx", None)
    if tracing is None:  # the backend called outside a Dynamo trace: no frame to dump
        return lambda compiled: compiled
    original = tracing.f_code

    def wrap(compiled: Callable) -> Callable:
        written = False

        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal written
            if not written:
                written = True
                try:
                    _write_frame(root, original, _rewritten_caller(original))
                except OSError as error:  # a dump must never stop the step it describes
                    warnings.warn(f"mfsdp could not write the frame dump under {root}: {error}", stacklevel=2)
            return compiled(*args, **kwargs)

        return functools.update_wrapper(run, compiled, assigned=(), updated=("__dict__",))

    return wrap


def _rewritten_caller(original: types.CodeType) -> types.CodeType | None:
    """The code Dynamo rewrote ``original`` into, found as a frame on the stack now (called
    from a compiled graph's first call); None if none is."""
    rewritten = {entry.code for entry in torch._dynamo.eval_frame._debug_get_cache_entry_list(original)}
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in rewritten:
        frame = frame.f_back
    return frame.f_code if frame is not None else None


def _write_frame(root: Path, original: types.CodeType, rewritten: types.CodeType | None) -> None:
    import depyf

    name = f"{original.co_name}-{original.co_firstlineno}.py".replace("<", "").replace(">", "")
    try:
        text = (
            f"# {original.co_filename}:{original.co_firstlineno}\n"
            f"# --- user source (decompiled) ---\n{depyf.decompile(original)}\n"
            f"# --- as Dynamo rewrote it: calls into the compiled graphs ---\n"
            f"{depyf.decompile(rewritten) if rewritten is not None else '(not found on the stack)'}\n"
        )
    except Exception as error:  # depyf covers most, not all, bytecode
        text = f"# depyf could not decompile {original.co_name}: {error}\n"
    write_atomic(root / f"rank{_rank()}" / "frames" / name, text)
