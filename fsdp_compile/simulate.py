"""``simulate``: step time, exposed communication and peak memory of a compiled step, at scale.

Plays a compiled graph's forward and backward with the two-stream cost model of
``fsdp_compile.cost_model`` (FLOP-counted compute, ring alpha-beta collectives) for a
``Hardware``, and compares three schedules of the same bucketed graphs:

- ``no_overlap``: every collective waited on right where it is issued, each gather issued at its
  bucket's first use (prefetch 0): communication never hides behind compute;
- ``fsdp2``: FSDP2's rules on the same buckets (one per ``fully_shard`` unit when the model is
  wrapped per block): a unit's pre-forward (pre-backward) hook waits for its own gather and
  issues the next unit's, so each gather is issued right before the previous unit's first
  read and the first unit's right before its own; each reduce-scatter waited after the next
  is issued (as ours);
- ``ours``: the graphs exactly as compiled (with the options they were compiled with). Ours
  issues earlier than FSDP2's hooks can: where the glue before the previous bucket starts,
  and the first gather of a graph at its start (in backward it then hides behind the loss
  gradient and the head; NOTE: the planned order, in ``passes/schedule_collectives.py``).

Tensor parallelism's collectives (DTensor's, traced into the graphs on the "tp" group) stay
where the graph has them in every schedule: the op after each waits for it, so each is
exposed whole unless the graph overlaps it, and ``exposed_tensor_parallel_seconds`` reports
that time apart. ``links`` gives a group a link of its own (tensor parallelism inside a node
on NVLink, data parallelism across nodes on InfiniBand).

Peak memory is a liveness count over the node order (``peak_memory``): inputs (shards,
activations saved for backward) stay resident, every other tensor lives from the node that
allocates it to its last reader, views and waits alias their input, and a collective's input
stays alive until its wait (the communication library holds it). A repeated block's call is
one node whose body keeps activations of its own for the backward: they count from the
block's forward call to its backward call (what autograd saves when the block runs on fake
tensors, block_call.py), and while it runs the call holds its flats' members copied out
(forward), or their gradients and its pack of them (backward; NOTE: a flat's copies in the
block call); the body's other temporaries inside one call are not counted. It covers
what the graphs allocate, not the optimizer step or allocator fragmentation.

``benchmarks/simulated_table.py`` runs it on Llama-style 1B and 8B shapes traced by ``trace_step``
and prints docs/performance.md's table.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx

from fsdp_compile.backend import CompiledGraph
from fsdp_compile.block_call import BLOCK_BACKWARD, BLOCK_FORWARD
from fsdp_compile.block_record import call_record
from fsdp_compile.passes.schedule_collectives import collective_groups, ranked_gathers, schedule_collectives
from fsdp_compile.patterns import is_collective, is_view, is_wait
from fsdp_compile.plan import Plan
from fsdp_compile.cost_model import NVLINK_GPU, Hardware, estimate_timeline

__all__ = ["simulate", "Simulation", "ScheduleEstimate", "peak_memory", "INFINIBAND_GPU"]

INFINIBAND_GPU = dataclasses.replace(NVLINK_GPU, name="H100-class GPU, InfiniBand", link=50e9, latency=5e-6)
"""An H100-class GPU whose collectives cross InfiniBand at ~50 GB/s per GPU."""

SCHEDULES = ("no_overlap", "fsdp2", "ours")


@dataclass(frozen=True, kw_only=True)
class ScheduleEstimate:
    step_seconds: float
    """Forward plus backward, both streams drained."""
    exposed_comm_seconds: float
    """Time the compute stream waited on a collective."""
    exposed_tensor_parallel_seconds: float
    """The part of ``exposed_comm_seconds`` spent waiting on tensor parallelism's collectives
    (DTensor's, on the groups the plans' parameters were placed on by ``parallelize_module``)."""
    peak_bytes: int
    """Most bytes the step's graphs hold at once (see ``peak_memory``)."""

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm_seconds / max(self.step_seconds, 1e-30)


@dataclass(frozen=True, kw_only=True)
class Simulation:
    hardware: Hardware
    world: int
    schedules: dict[str, ScheduleEstimate]
    """"no_overlap", "fsdp2", "ours" -> the estimate for that schedule of the same graphs."""


def _storage(node: fx.Node) -> fx.Node:
    """The node whose allocation ``node``'s result lives in (itself unless it aliases)."""
    while node.op == "call_function" and (is_view(node) or is_wait(node) or node.target is operator.getitem):
        source = node.args[0]
        if node.target is operator.getitem and not is_view(source):
            break  # an element of a tuple of fresh tensors (not of a split): its own allocation
        node = source
    if "out" in node.kwargs:  # all_gather_into_tensor_out fills a buffer made before it
        return _storage(node.kwargs["out"])
    return node


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) and not val.is_sparse else 0


def peak_memory(gm: fx.GraphModule) -> int:
    """Most bytes alive at once while ``gm`` runs in its node order (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    last: dict[fx.Node, int] = {}
    for node in nodes:
        readers = [position[u] if u.op != "output" else end for u in node.users]
        if is_collective(node):  # its input is held until the wait
            readers += [position[u] for u in node.users if is_wait(u)]
            for arg in node.all_input_nodes:
                root = _storage(arg)
                last[root] = max(last.get(root, 0), *readers)
        root = _storage(node)
        last[root] = max([last.get(root, position[node]), position[node], *readers])
    resident = sum(_nbytes(n) for n in nodes if n.op == "placeholder")
    frees: dict[int, int] = {}
    for root, when in last.items():
        if root.op != "placeholder":
            frees[when] = frees.get(when, 0) + _nbytes(root)
    # What a block's body keeps for its backward, which no node of the step holds: taken at
    # its forward call (as a saved output, kept to the graph's end) unless nothing will
    # differentiate it (a call activation checkpointing recomputes), held by the backward
    # graph from its start, or from its recompute there, and let go after its backward call.
    for i, node in enumerate(nodes):
        if node.target == BLOCK_BACKWARD:
            kept = _saved_by_body(node)
            if not _recomputed_here(node):
                resident += kept
            frees[i] = frees.get(i, 0) + kept
    alive = peak = resident
    for i, node in enumerate(nodes):
        if node.op == "call_function" and _storage(node) is node:
            alive += _nbytes(node)
        if node.target == BLOCK_FORWARD and node.kwargs.get("differentiated", True):
            alive += _saved_by_body(node)
        peak = max(peak, alive + _held_by_call(node))
        alive -= frees.get(i, 0)
    return peak


def _held_by_call(node: fx.Node) -> int:
    """Bytes a block call holds while it runs that no node of the step does (0 for any other
    node): its flats' members copied out, in the forward and again in the backward
    (``block_fakes.held_bytes``), unless the step's graph copied them out (pass
    copy_out_flats)."""
    if node.target not in (BLOCK_FORWARD, BLOCK_BACKWARD) or node.kwargs.get("copied_out", False):
        return 0
    held = call_record(node.args[-1]).traced.get("held_bytes", {})
    return int(held.get("forward" if node.target == BLOCK_FORWARD else "backward", 0))


def _recomputed_here(backward: fx.Node) -> bool:
    """Whether a block call's backward takes its token from a call in its own graph (the
    recompute of a checkpointed call) rather than from the forward graph."""
    token = backward.args[0]
    return token.target is operator.getitem and token.args[0].target == BLOCK_FORWARD


def _saved_by_body(node: fx.Node) -> int:
    """Bytes a block call's body saves for its backward (0 for a graph traced elsewhere)."""
    return int(call_record(node.args[-1]).traced.get("saved_bytes", 0))


def _rescheduled(gm: fx.GraphModule, plan: Plan, prefetch: int) -> fx.GraphModule:
    copied = copy.deepcopy(gm)
    options = dataclasses.replace(plan.options, prefetch=prefetch, max_inflight_bytes=None)
    return schedule_collectives(copied, dataclasses.replace(plan, options=options))


def _fsdp2_rules(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Each gather's issue moved down to where FSDP2's hooks issue it: right before the first
    read of the bucket used before it (the first bucket: right before its own wait)."""
    gm = _rescheduled(gm, plan, prefetch=1)
    ranked = ranked_gathers(gm, plan)
    for rank, (group, _) in enumerate(ranked):
        anchor = ranked[rank - 1][1] if rank else group.wait[0]
        for node in group.issue:
            anchor.prepend(node)
    gm.graph.lint()
    return gm


def _waited_at_issue(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Each collective's wait (and what unpacks it) moved right after the collective."""
    for group in collective_groups(gm, plan):
        anchor = group.collective
        for node in group.wait:
            anchor.append(node)
            anchor = node
    gm.graph.lint()
    return gm


def _graphs(graph: CompiledGraph, schedule: str) -> list[tuple[str, fx.GraphModule]]:
    pairs = [("forward", graph.forward), ("backward", graph.backward)]
    if schedule == "ours":
        return pairs
    if schedule == "fsdp2":
        return [(role, _fsdp2_rules(gm, graph.plan)) for role, gm in pairs]
    return [(role, _waited_at_issue(_rescheduled(gm, graph.plan, prefetch=0), graph.plan)) for role, gm in pairs]


def simulate(
    graphs: list[CompiledGraph], hardware: Hardware = NVLINK_GPU, links: Mapping[str, Hardware] | None = None
) -> Simulation:
    """Estimate one training step of ``graphs`` (a backend's ``.graphs``: each compiled with
    its backward, at the world size it was traced at) on ``hardware``, for each schedule.
    ``links``: group name -> the link that group's collectives cross, where it is not
    ``hardware``'s (``estimate_timeline``). An all-reduce's group size is looked up by the
    group's name (``collective_facts``): simulate before that process group is destroyed."""
    estimates = {}
    for schedule in SCHEDULES:
        step = exposed = exposed_tp = 0.0
        peak = 0
        for graph in graphs:
            for role, gm in _graphs(graph, schedule):
                timeline = estimate_timeline(gm, role, hardware, links)
                step += timeline.step_seconds
                exposed += timeline.exposed_comm_seconds
                exposed_tp += sum(timeline.exposed_by_group.get(g, 0.0) for g in graph.plan.tensor_parallel_groups)
                peak = max(peak, peak_memory(gm))
        estimates[schedule] = ScheduleEstimate(
            step_seconds=step, exposed_comm_seconds=exposed, exposed_tensor_parallel_seconds=exposed_tp, peak_bytes=peak
        )
    world = max(p.sharding.world for g in graphs for p in g.plan.params)
    return Simulation(hardware=hardware, world=world, schedules=estimates)


LOCAL_BATCH, SEQ = 2, 4096


def trace_step(
    shape: dict, world: int, *, batch: int = LOCAL_BATCH, seq: int = SEQ, **options
) -> list[CompiledGraph]:
    """Compile one training step of a ``Transformer(shape)`` on ``batch`` x ``seq`` tokens per
    rank at ``world`` ranks, on the fake process group and the meta device: the graphs the
    backend would compile, without weights. ``options`` go to the backend."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compile import MfsdpBackend, MixedPrecision, fully_shard
    from fsdp_compile.testing.models import Transformer, TransformerConfig

    cfg = TransformerConfig(**shape)
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with torch.device("meta"):
            model = Transformer(cfg)
        for block in model.layers:
            fully_shard(block, mp_policy=bf16)
        fully_shard(model, mp_policy=bf16)
        backend = MfsdpBackend(compiler="eager", **options)
        tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        torch._dynamo.reset()
        # Compile the backward with the forward: no backward needs to run.
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            torch.compile(model, backend=backend)(tokens)
        return backend.graphs
    finally:
        dist.destroy_process_group()

