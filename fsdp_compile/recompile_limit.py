"""The compile that reaches Dynamo's recompile limit says so, with what the frame's compiles
were for and the fixes."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx

from fsdp_compile.patterns import is_block_call, is_unshard

__all__ = ["Recompile", "note_compile"]


# NOTE: the recompile limit is said
#     Dynamo compiles one frame at most ``torch._dynamo.config.recompile_limit`` times (8) in a
#     process, then runs it in Python, saying so only in its log. One model's step compiles
#     again for each shape, grad mode and training flag it meets: HF batches padded to their
#     longest sequence, and an evaluation under torch.no_grad() between steps, reach 8 graphs
#     with padding or not (2 x 2 x static and symbolic: the first length compiles static, the
#     first change once more with symbolic sizes, later lengths reuse that). A step's graph
#     also names its own model's parameters (their ids, its blocks' calls), so each model
#     sharded and compiled in one process compiles the same forward again, as does each turn
#     of gradient sync: the ninth model of one class (a notebook cell run again, a sweep in
#     one process) would run uncompiled, gathering each parameter at each read. The compile
#     that reaches the limit
#     says so, with what this torch.compile call's compiles of the frame were for (grad mode,
#     shapes or inputs, other guards by Dynamo's reasons, other torch.compile calls) and the
#     fix for each kind; it happens once per frame until torch.compiler.reset(). Dynamo's own
#     reason is no guide alone: it names the first guard failed against the newest graph,
#     which is the grad mode at every turn between a step and an evaluation.


@dataclass(frozen=True)
class Recompile:
    """What one compile of a frame was for."""

    grad: bool
    """Gradients on (a training step) or off (an evaluation under ``torch.no_grad()``)."""
    symbolic: bool
    """Sizes symbolic (Dynamo's automatic dynamic shapes after a size changed): the graph
    takes them as inputs of their own."""
    shapes: str
    """The tensor inputs' shapes, as this call's tensors have them."""
    reason: str
    """Dynamo's reason, its first failed guard as its ``recompiles`` log prints it ("" for a
    first compile, or where the release keeps none)."""


def _recompile(example_inputs: list) -> Recompile:
    metrics = torch._dynamo.utils.get_metrics_context()
    reason = getattr(metrics, "_metrics", {}).get("recompile_reason") or ""
    shapes = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)]
    symbolic = any(isinstance(value, torch.SymInt) for value in example_inputs)
    # The guard and its source line; Dynamo's user stack trace after them says no more.
    reason = reason.split("User stack trace")[0].rstrip(" -\n")
    return Recompile(torch.is_grad_enabled(), symbolic, repr(shapes), " ".join(reason.split()))


def _what_compiles_were_for(compiles: list[Recompile], limit: int) -> str:
    """The kinds of guard the frame's compiles in this torch.compile call met, as a sentence."""
    kinds = []
    if len({c.grad for c in compiles}) > 1:
        kinds.append("with gradients and without (an evaluation under torch.no_grad())")
    if len({(c.symbolic, c.shapes) for c in compiles}) > 1:
        kinds.append("for new shapes or inputs (a changed size compiles once more with symbolic sizes)")
    if len({(c.grad, c.symbolic, c.shapes) for c in compiles}) < len(compiles):
        reasons = dict.fromkeys(c.reason.split(": ", 1)[-1] for c in compiles if c.reason)
        named = f"Dynamo's first failed guards: {'; '.join(reasons)}; " if reasons else ""
        kinds.append(f"for other guards ({named}TORCH_LOGS=recompiles names each)")
    said = f" This torch.compile call compiled it {len(compiles)} time{'s' if len(compiles) > 1 else ''}"
    said += f": {', '.join(kinds)}." if kinds else "."
    others = limit - len(compiles)
    if others:
        said += (
            f" The other {others} {'were' if others > 1 else 'was'} other torch.compile calls': "
            "each model sharded and compiled in one process compiles its step anew."
        )
    return said


def note_compile(
    recompiles: dict[str, dict[int, Recompile]], body_suffix: str, gm: fx.GraphModule, example_inputs: list
) -> int:
    """Keep what the compile under way (of ``gm``) is for in ``recompiles`` (a backend's, by
    frame and Dynamo's count of that frame's compiles); warn when Dynamo compiles its frame
    for the last time (NOTE: the recompile limit is said). ``body_suffix`` ends the code names of that
    backend's repeated blocks' bodies (``MfsdpBackend.frame``). Returns whether this is the
    backend's first compile of the frame in its grad mode (True outside a Dynamo compile):
    every rank makes such a compile at the same call (NOTE: the rank check runs where the
    ranks compile together, in check_rank_agreement.py)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None:
        return True
    tx = InstructionTranslator.current_tx() if torch._guards.TracingContext.try_get() else None
    code = getattr(tx, "f_code", None)
    frame = f"{code.co_name} ({code.co_filename}, line {code.co_firstlineno})" if code else "a frame"
    body, of_backend, rest = frame.partition(f"{body_suffix} ")
    if of_backend:
        frame = f"the repeated blocks' body {body} {rest}"
    compiles = recompiles[frame]
    if any(count > compile_id.frame_compile_id for count in compiles):
        compiles.clear()  # the frame was reset (torch.compiler.reset()) since those compiles
    this = compiles[compile_id.frame_compile_id] = _recompile(example_inputs)
    first_of_its_mode = all(c.grad != this.grad for c in compiles.values() if c is not this)
    limit = torch._dynamo.config.recompile_limit
    at_limit = compile_id.frame_compile_id == limit - 1
    if at_limit and not of_backend and not any(is_unshard(n) or is_block_call(n) for n in gm.graph.nodes):
        # A frame that gathers nothing (an optimizer's step in a train step compiled whole)
        # runs uncompiled as it would eagerly; the guard that changes is most often a float.
        warnings.warn(
            f"mfsdp: Dynamo compiles {frame} for the last time in this process, compile {limit} of "
            f"its limit (torch._dynamo.config.recompile_limit = {limit}), and runs it uncompiled from "
            "the next time on. It gathers no parameter, so it runs as it would eagerly, only slower."
            f"{_what_compiles_were_for(list(compiles.values()), limit)} A float that changes at each "
            "call is a guard: an LR scheduler's learning rate recompiles an optimizer's step each "
            "step unless the optimizer holds it as a tensor (torch.optim.AdamW(params, "
            "lr=torch.tensor(1e-3))).",
            stacklevel=3,
        )
    elif at_limit:
        why = _what_compiles_were_for(list(compiles.values()), limit)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Each rank compiles for its own batches' shapes, so ranks reach the limit apart.
            why += (
                " On several ranks it is worse than slow: a rank that runs the step uncompiled "
                "while the others run it compiled issues other collectives, and the job fails or "
                "hangs there; ranks whose batches differ in shape reach the limit at different steps."
            )
        warnings.warn(
            f"mfsdp: Dynamo compiles {frame} for the last time in this process, compile {limit} of "
            f"its limit (torch._dynamo.config.recompile_limit = {limit}), and runs it uncompiled from "
            f"the next time on, gathering each parameter at each read.{why} Fixes: for shapes that change from batch "
            "to batch, pad batches to a few fixed lengths or compile with dynamic=True; for an "
            "evaluation between steps, turns of set_requires_gradient_sync and a layer's flag "
            "changed between steps (each of its values compiles the step once), raise "
            "torch._dynamo.config.recompile_limit; for another model, call torch.compiler.reset() "
            "before building it.",
            stacklevel=3,
        )
    return first_of_its_mode
