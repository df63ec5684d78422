"""Pass (Dynamo graph, only with ``options={"cuda_graph": True}``): the step is one graph.
Without ``cuda_graph``, the backend says a break once (``graph_break`` names it; NOTE: a graph
break is said, in fsdp_compile/backend.py).

NOTE: graph breaks under cuda_graph=True
    ``check_cuda_graph`` reads the graphs the backend compiles. Code that Dynamo leaves to
    Python (at a graph break, or in a frame it gave up on, as for a break inside a loop) runs
    between those graphs and is read by no check: a host sync there (``.item()``,
    ``.tolist()``, ``if tensor:``) passes compilation and fails later, inside CUDA graph
    capture, far from its cause. So with ``cuda_graph=True`` a graph break is refused when
    compiling, naming the user's line. Two ways a break reaches the backend:

    - Dynamo compiles the graph *before* a break with ``gm.compile_subgraph_reason``, whose
      ``graph_break`` flag, reason and user stack say where and why;
    - the graph *after* a break (a resume function), or a frame called from a frame Dynamo
      skipped, is compiled while the user's frame runs in Python: between Dynamo's frame
      conversion and torch.compile's entry (``torch/_dynamo/eval_frame.py``) the Python stack
      holds a frame of the user's code. A step compiled whole has only torch's module-call
      frames there (and this package's parameter getters, when an eager frame reads one).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType

import torch
from torch import fx

from fsdp_compile.errors import CompileUsageError
from fsdp_compile.plan import Plan

# Frames of torch and of this package (the parameter getters) are machinery, not the user's.
_MACHINERY = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
_CONVERT_FRAME = str(Path(torch._dynamo.convert_frame.__file__))
_EVAL_FRAME = str(Path(torch._dynamo.eval_frame.__file__))
_HF_PRELUDE = (str(Path(__file__).parents[1] / "hf.py"), "_prelude")
_FIX = (
    "Fix: keep the step in one graph: keep values on the device (torch.where or masks "
    "instead of .item(), .tolist() or a Python `if` on a tensor), or compile with "
    "cuda_graph=False. See docs/cuda_graphs.md, \"Graph breaks\"."
)


class GraphBreakUnderCudaGraph(CompileUsageError):
    """``cuda_graph=True`` and the step does not compile into one graph."""


def _python_frames_between() -> list[FrameType]:
    """The frames running in Python between torch.compile's entry and the frame Dynamo is
    converting now, innermost first; none when the stack does not look like a conversion."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    converting = [i for i, f in enumerate(frames) if f.f_code.co_filename == _CONVERT_FRAME]
    entry = [i for i, f in enumerate(frames) if f.f_code.co_filename == _EVAL_FRAME]
    if not converting or not entry or entry[0] < converting[-1]:
        return []
    return frames[converting[-1] + 1 : entry[0]]


def _is_hf_prelude(frame: FrameType) -> bool:
    # Named, not imported: fsdp_compile.hf asks the backend, which runs this pass.
    return (frame.f_code.co_filename, frame.f_code.co_name) == _HF_PRELUDE


def graph_break(gm: fx.GraphModule) -> tuple[tuple[str, str], str] | None:
    """Where the step breaks around ``gm`` (see NOTE: graph breaks under cuda_graph=True): the
    frame that runs in Python (its file and function, the same for the graph before a break
    and the one resuming after it), and a sentence saying where and why; None for a step
    compiled whole."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and reason.graph_break:
        where = reason.user_stack[-1] if reason.user_stack else None
        caller = next((f for f in reversed(reason.user_stack or []) if not f.filename.startswith(_MACHINERY)), None)
        if where is not None and where.filename == _HF_PRELUDE[0] and caller is not None:
            code = f"{caller.name} ({caller.filename})"
            return (caller.filename, caller.name), _calls_hf_model(f"{code} breaks its graph", caller.lineno, "an HF model")
        line = f"{where.filename}, line {where.lineno}: {where.line}" if where else "an unknown line"
        why = reason.reason.strip().splitlines()[0]
        if why.startswith("generic_jump"):  # Dynamo's name for a jump on a traced value
            why = "a Python branch on a tensor's value"
        frame = (where.filename, where.name) if where else ("", "")
        return frame, f"Dynamo breaks the graph at {line} ({why}); the code after the break runs in Python."
    between = _python_frames_between()
    users = [i for i, f in enumerate(between) if not f.f_code.co_filename.startswith(_MACHINERY)]
    if not users:
        return None
    frame = between[users[0]]
    code = frame.f_code
    where = f"{code.co_name} ({code.co_filename}, line {code.co_firstlineno}) runs in Python around the compiled graphs"
    prelude = next((f for f in between[: users[0]] if _is_hf_prelude(f)), None)
    if prelude is not None:
        model = f"the HF model {type(prelude.f_locals.get('self')).__name__}"
        return (code.co_filename, code.co_name), _calls_hf_model(where, frame.f_lineno, model)
    return (code.co_filename, code.co_name), (
        f"{where}, now at line {frame.f_lineno}: Dynamo broke its graph or gave up on the frame (a "
        "graph break inside a loop makes it run the whole frame eagerly; TORCH_LOGS=graph_breaks "
        "shows why)."
    )


def _calls_hf_model(where: str, line: int, model: str) -> str:
    """The break at an HF model's prelude (NOTE: an HF model inside a module of yours, in
    fsdp_compile/hf.py), said of the graph before it and of the HF model's own alike."""
    return (
        f"{where}: at line {line} it calls {model}, whose forward mfsdp compiles as a graph of "
        "its own, so that HF decides its attention mask from the inputs' values as it does "
        "eagerly (FlashAttention and grouped-query attention on a GPU; fsdp_compile/hf.py)."
    )


def check_graph_breaks(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards (when it returns) the Dynamo graph was not cut short by a graph break and is
    not compiled from code running in Python around it (see NOTE: graph breaks under
    cuda_graph=True); otherwise raises ``GraphBreakUnderCudaGraph`` naming the user's line."""
    found = graph_break(gm)
    if found is not None:
        raise GraphBreakUnderCudaGraph(
            f"cuda_graph=True: {found[1]} There no compile-time check sees a host sync, which "
            f"would fail only during capture. {_FIX}"
        )
    return gm
