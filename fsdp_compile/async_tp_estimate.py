"""What async tensor parallelism would save: the simulator's estimate for compiled graphs.

Async TP (not built here; docs/design.md, "Async tensor parallelism: the next step") cuts a
sequence-parallel all-gather and the matmuls that read its result, or a matmul and the
reduce-scatter of its output, into one chunk per tensor-parallel rank, and computes one
chunk while the next travels. It takes the two shapes Inductor's ``micro_pipeline_tp`` pass
takes::

    all_gather ─ wait ─[split ─ getitem* ─ cat]─[slice]─ view* ─ mm (as its left operand), one or more
    mm ─ view* ─[split ─ getitem* ─ cat]─ reduce_scatter
    ([split ... cat]: a gather or scatter along the sequence, moved to dim 0; [slice]: DTensor's
    unpadding of an even shard, a no-op)

NOTE: the async TP estimate
    A collective of ``t`` seconds (``cost_model.collective_seconds``) next to matmuls of ``m``
    seconds, both cut into ``tp`` chunks: each piece travels while the matmuls compute on
    other chunks. All of ``t`` hides when the matmuls take longer; otherwise all of the
    matmuls but one chunk (the one computed with nothing in flight) run under it. So it
    saves ``min(t, m * (tp - 1) / tp)``, summed over the decomposable collectives and capped
    by the time the step (as compiled, ``ours``) waits on tensor-parallel collectives. It
    leaves out what chunking costs: smaller matmuls run less efficiently, and each chunk's
    copy takes its own latency.

``benchmarks/async_tp_estimate.py`` runs it on HF Llama-3 8B and 70B.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx

from fsdp_compile.backend import CompiledGraph
from fsdp_compile.patterns import collective_facts, is_all_gather, is_collective, is_reduce_scatter, is_wait
from fsdp_compile.cost_model import (
    NVLINK_GPU,
    Hardware,
    collective_seconds,
    compute_seconds,
    estimate_timeline,
    with_bodies,
)

__all__ = ["AsyncTensorParallelEstimate", "estimate_async_tp"]

aten = torch.ops.aten
MM = aten.mm.default
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SHUFFLES = (*_RESHAPES, aten.split.Tensor, aten.cat.default, operator.getitem)


def _passes_on(node: fx.Node) -> bool:
    """``node`` carries a gathered activation to its matmul, or a matmul's output to its
    reduce-scatter, unchanged: a reshape, the split and cat that move a sequence-dim
    gather's or scatter's pieces to dim 0, or a slice keeping everything (DTensor's unpadding
    of an even shard, which Inductor drops as a no-op)."""
    if node.target is aten.slice.Tensor:
        return node.meta["val"].shape == node.args[0].meta["val"].shape
    return node.target in _SHUFFLES


@dataclass(frozen=True, kw_only=True)
class AsyncTensorParallelEstimate:
    """One training step as compiled (the simulator's ``ours``) and what async TP would save."""

    step_seconds: float
    exposed_comm_seconds: float
    exposed_tensor_parallel_seconds: float
    """The part of ``exposed_comm_seconds`` spent waiting on tensor-parallel collectives."""
    collectives: int
    """Tensor-parallel collectives in the step."""
    collective_seconds: float
    """Their alpha-beta time, summed: ``exposed_tensor_parallel_seconds`` less this is time
    they queued behind other collectives on their link."""
    decomposable: int
    """Those async TP would cut into chunks (the shapes in the module docstring)."""
    decomposable_seconds: float
    """Their alpha-beta time, summed."""
    saved_seconds: float
    """NOTE: the async TP estimate."""


def _matmuls_reading(wait: fx.Node) -> list[fx.Node]:
    """The matmuls that read an all-gather's result (its ``wait``) as their left operand."""
    reached, frontier, matmuls = {wait}, [wait], []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.target == MM and user.args[0] is node:
                matmuls.append(user)
            # A cat joins when the last of its pieces is reached.
            elif _passes_on(user) and user not in reached and set(user.all_input_nodes) <= reached:
                reached.add(user)
                frontier.append(user)
    return matmuls


def _matmul_producing(node: fx.Node) -> fx.Node | None:
    """The one matmul whose output ``node`` (a reduce-scatter's input) is, reshaped; else None."""
    while node.target != MM:
        if not _passes_on(node):
            return None
        sources = {a.args[0] if a.target is operator.getitem else a for a in node.all_input_nodes}
        if len(sources) != 1:
            return None
        (node,) = sources
    return node


def _hideable_seconds(collective: fx.Node, hw: Hardware) -> float:
    """Seconds of matmul a decomposed ``collective`` could run under (0: not decomposable)."""
    if is_all_gather(collective):
        wait = next(u for u in collective.users if is_wait(u))
        matmuls = _matmuls_reading(wait)
    elif is_reduce_scatter(collective):
        matmuls = [m] if (m := _matmul_producing(collective.args[0])) is not None else []
    else:  # an all-reduce: async TP needs sequence parallelism's all-gather / reduce-scatter
        matmuls = []
    world = collective_facts(collective).world
    return sum(compute_seconds(m, hw) for m in matmuls) * (world - 1) / world


def estimate_async_tp(
    graphs: list[CompiledGraph], hardware: Hardware = NVLINK_GPU, links: Mapping[str, Hardware] | None = None
) -> AsyncTensorParallelEstimate:
    """The step of ``graphs`` as compiled, and what async TP would save of it (NOTE: the async
    TP estimate), with ``simulate``'s cost model and arguments."""
    links = links or {}
    totals = dict.fromkeys(("step", "exposed", "exposed_tp", "collective_seconds", "decomposable_seconds", "saved"), 0.0)
    collectives = decomposable = 0
    for graph in graphs:
        tp_groups = graph.plan.tensor_parallel_groups
        for role, gm in (("forward", graph.forward), ("backward", graph.backward)):
            timeline = estimate_timeline(gm, role, hardware, links)
            exposed_tp = sum(timeline.exposed_by_group.get(g, 0.0) for g in tp_groups)
            saved = 0.0
            # A block's collectives are its compiled body's, once per call (``with_bodies``).
            for node in (n for g in with_bodies(gm) for n in g.graph.nodes):
                if not is_collective(node) or (facts := collective_facts(node)).group_name not in tp_groups:
                    continue
                collectives += 1
                seconds = collective_seconds(facts, links.get(facts.group_name, hardware))
                totals["collective_seconds"] += seconds
                if hideable := _hideable_seconds(node, hardware):
                    decomposable += 1
                    totals["decomposable_seconds"] += seconds
                    saved += min(seconds, hideable)
            totals["step"] += timeline.step_seconds
            totals["exposed"] += timeline.exposed_comm_seconds
            totals["exposed_tp"] += exposed_tp
            totals["saved"] += min(saved, exposed_tp)
    return AsyncTensorParallelEstimate(
        step_seconds=totals["step"],
        exposed_comm_seconds=totals["exposed"],
        exposed_tensor_parallel_seconds=totals["exposed_tp"],
        collectives=collectives,
        collective_seconds=totals["collective_seconds"],
        decomposable=decomposable,
        decomposable_seconds=totals["decomposable_seconds"],
        saved_seconds=totals["saved"],
    )
