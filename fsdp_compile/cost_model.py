"""What a compiled graph does, in order: its collectives and an estimated timeline.

``collective_schedule(gm, plan)`` lists every collective of a partitioned graph with its bytes,
where it is issued, where it is waited on and the compute in between. ``estimate_timeline``
plays the graph on a compute stream and a communication stream per link with a simple
cost model:

- compute node: FLOPs counted by ``torch.utils.flop_counter`` on the node's fake tensors,
  divided by ``Hardware.flops``; nodes without FLOPs cost the bytes they write at
  ``Hardware.memory_bandwidth`` (a memory-bound roofline; a view writes none);
- collective: ring alpha-beta, ``latency * (world - 1) + bytes * (world - 1) / world / link``,
  where ``bytes`` is the full-size tensor (``fsdp_compile.patterns.CollectiveFacts``); an
  all-reduce is a reduce-scatter then an all-gather, twice that;
- a collective starts when it is issued and its link's communication stream is free (one
  stream per link: see ``estimate_timeline``); a wait blocks the compute stream until its
  collective ends, so one waited on right where it is issued (tensor parallelism's, as
  DTensor traces them) is exposed whole;
- a repeated block's call: its body's ops (counted when the step was traced), then the
  collectives its compiled body holds (``body_of``: tensor parallelism's, an expert
  all-to-all), each exposed whole.

The numbers are estimates for the named hardware, not measurements (see docs/debugging.md).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import fx
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from fsdp_compile.node_meta import MEMBERS, PARAM_ID
from fsdp_compile.patterns import (
    CollectiveFacts,
    bucket_index,
    collective_facts,
    is_block_call,
    is_collective,
    is_view,
    is_wait,
)
from fsdp_compile.block_call import BLOCK_BACKWARD
from fsdp_compile.block_record import call_record
from fsdp_compile.plan import Plan

__all__ = [
    "Hardware", "NVLINK_GPU", "Collective", "body_of", "collective_schedule", "collective_seconds", "compute_seconds",
    "estimate_timeline", "Timeline", "with_bodies",
]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The machine a timeline is estimated for."""

    name: str = "H100-class GPU, NVLink"
    flops: float = 400e12
    """Sustained dense FLOP/s of the compute stream."""
    memory_bandwidth: float = 2.5e12
    """Bytes/s for memory-bound ops."""
    link: float = 450e9
    """Per-GPU collective bandwidth, bytes/s (NVLink-class ~450e9, InfiniBand-class ~50e9)."""
    latency: float = 2e-6
    """Seconds per ring step (NVLink-class; a few microseconds more across InfiniBand)."""


NVLINK_GPU = Hardware()
"""The default estimate target: an H100-class GPU on NVLink."""


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective of a partitioned graph."""

    kind: str
    """"all_gather", "reduce_scatter", "all_reduce" or "all_to_all"."""
    graph: str
    """"forward" or "backward"."""
    param: str
    """The parameters it moves (their fqns, comma-separated, in bucket-buffer order);
    "(user collective)" for collectives not ours."""
    bucket: str
    """The plan bucket's name (``layers.3``); "(user collective)" for collectives not ours."""
    bytes: int
    """The full-size tensor: gathered output, reduced or sent input (``CollectiveFacts``)."""
    group: str
    world: int
    issue_position: int
    """Index of the collective's node in the graph."""
    wait_position: int
    """Index of its wait_tensor node."""
    overlapped_compute: list[str] = field(default_factory=list)
    """Compute nodes between issue and wait: what can hide this collective."""
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    """``bytes`` by what they are (``CollectiveFacts.bytes_by_dtype``): a float8 gather says
    ``float8_e4m3fn`` though its bytes travel as uint8."""


def _nbytes(val: object) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and not is_collective(node) and not is_wait(node)


def _moves(node: fx.Node, plan: Plan) -> tuple[str, str]:
    """(fqns, bucket name) of the parameters a collective moves: a bucket's members, the one
    parameter of an unbucketed reduction (an all-reduce), or none for a user's collective."""
    index = bucket_index(node)
    if index is not None:
        return ", ".join(plan.param(i).fqn for i in node.meta[MEMBERS]), plan.buckets[index].name
    param_id = node.meta.get(PARAM_ID)
    if param_id is not None:
        return plan.param(param_id).fqn, plan.bucket_of(param_id).name
    return "(user collective)", "(user collective)"


def collective_schedule(gm: fx.GraphModule, plan: Plan, graph: str) -> list[Collective]:
    """Every collective in ``gm`` (a partitioned ``graph``: "forward" or "backward")."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    schedule = []
    for node in nodes:
        if not is_collective(node):
            continue
        wait = next(u for u in node.users if is_wait(u))
        facts = collective_facts(node)
        fqns, bucket = _moves(node, plan)
        between = nodes[position[node] + 1 : position[wait]]
        schedule.append(
            Collective(
                kind=facts.kind,
                graph=graph,
                param=fqns,
                bucket=bucket,
                bytes=facts.nbytes,
                group=facts.group_name,
                world=facts.world,
                issue_position=position[node],
                wait_position=position[wait],
                overlapped_compute=[n.name for n in between if _is_compute(n)],
                bytes_by_dtype={str(d).removeprefix("torch."): b for d, b in facts.bytes_by_dtype.items()},
            )
        )
    return schedule


def _signature(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.stride())
    return value


_FLOPS: weakref.WeakKeyDictionary[fx.Graph, dict[str, int]] = weakref.WeakKeyDictionary()
"""Per graph, the FLOPs counted by op and argument shapes (a transformer's graph repeats a few
dozen signatures): the graph owns them, and they go with it. Not in ``GraphModule.meta``,
which the compile caches hash."""


def _node_flops(node: fx.Node) -> int:
    """FLOPs of one node, counted on its fake tensors (0 when it cannot be counted)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return 0
    args, kwargs = tree_map(
        lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, (node.args, node.kwargs)
    )
    key = repr((node.target, tree_map(_signature, (args, kwargs))))
    counted = _FLOPS.setdefault(node.graph, {})
    if key not in counted:
        counted[key] = _count_flops(node.target, args, kwargs)
    return counted[key]


def _count_flops(target, args, kwargs) -> int:
    fake_mode = torch._guards.detect_fake_mode(args)
    if fake_mode is None:
        return 0
    counter = FlopCounterMode(display=False)
    try:
        with fake_mode, counter:
            target(*args, **kwargs)
    except Exception:  # ops the fake mode cannot rerun standalone (RNG state, in-place views)
        return 0
    return counter.get_total_flops()


def _block_seconds(node: fx.Node, hw: Hardware) -> float:
    """A repeated block's call: its body's forward or backward ops, counted when the step was
    traced (block_call.py)."""
    cost = call_record(node.args[-1]).traced.get("cost")
    if cost is None:  # a graph not traced in this process
        return 0.0
    flops, nbytes = cost["backward" if node.target == BLOCK_BACKWARD else "forward"]
    return flops / hw.flops + nbytes / hw.memory_bandwidth


def compute_seconds(node: fx.Node, hw: Hardware) -> float:
    """Roofline time of one compute node; a repeated block's call costs its body's ops, since
    the call is one node no counter sees into. A view, or a piece of a split, moves no bytes
    and costs nothing: members read as views of a gathered flat (``gather_whole_members``)
    cost what they do on a device."""
    if is_block_call(node):
        return _block_seconds(node, hw)
    if is_view(node) or (node.target is operator.getitem and is_view(node.args[0])):
        return 0.0
    flops = _node_flops(node)
    return flops / hw.flops if flops else _nbytes(node.meta.get("val")) / hw.memory_bandwidth


def body_of(node: fx.Node) -> fx.GraphModule | None:
    """The compiled graph a repeated block's call runs: its body's forward, or its backward for
    a ``block_backward``; None for any other node, and for a body not compiled in this process
    (its frame compiles at its first call). A collective the block runs itself (tensor
    parallelism's, an expert all-to-all) lies there, once per call (NOTE: one op per block
    call, in block_call.py)."""
    if not is_block_call(node):
        return None
    record = call_record(node.args[-1])
    backend = record.backend()
    bodies = backend.bodies.get(record.name) if backend is not None else None
    role = "backward" if node.target == BLOCK_BACKWARD else "forward"
    # The first compile that has the role (a no-grad call of the same structure compiles an
    # inference graph only).
    return next((body.compiled[role] for body in bodies or () if role in body.compiled), None)


def with_bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm``, then the compiled body each of its block calls runs (``body_of``), once per
    call: every graph one run of ``gm`` runs."""
    return [gm, *(body for body in map(body_of, gm.graph.nodes) if body is not None)]


def collective_seconds(facts: CollectiveFacts, hw: Hardware) -> float:
    """Ring alpha-beta time of one collective (an all-reduce is a reduce-scatter and an
    all-gather; an all-to-all sends all but its own piece once)."""
    if facts.world <= 1:
        return 0.0
    passes = 2 if facts.kind == "all_reduce" else 1
    return passes * (hw.latency * (facts.world - 1) + facts.nbytes * (facts.world - 1) / facts.world / hw.link)


@dataclass(frozen=True, kw_only=True)
class Span:
    lane: str
    """"compute" or "comm"."""
    name: str
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class Timeline:
    graph: str
    hardware: Hardware
    spans: tuple[Span, ...]
    step_seconds: float
    exposed_comm_seconds: float
    """Time the compute stream sat idle waiting for a collective."""
    exposed_by_group: dict[str, float] = field(default_factory=dict)
    """``exposed_comm_seconds`` by the group of the collective waited on."""

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_timeline(
    gm: fx.GraphModule, graph: str, hw: Hardware = NVLINK_GPU, links: Mapping[str, Hardware] | None = None
) -> Timeline:
    """Play ``gm`` on a compute stream and a communication stream per link with the cost
    model above. ``links``: group name -> the link its collectives cross (``hw``'s when not
    named), e.g. a tensor-parallel group inside a node on NVLink and the data-parallel group
    across nodes on InfiniBand. Collectives crossing one link take turns on it (they share
    its bandwidth); those crossing different links run side by side."""
    links = links or {}
    compute_clock = 0.0
    comm_clock: dict[Hardware, float] = {}
    done: dict[fx.Node, tuple[float, str]] = {}
    exposed: dict[str, float] = {}
    spans = []
    for node in gm.graph.nodes:
        if is_collective(node):
            facts = collective_facts(node)
            link = links.get(facts.group_name, hw)
            start = max(compute_clock, comm_clock.get(link, 0.0))
            comm_clock[link] = start + collective_seconds(facts, link)
            done[node] = comm_clock[link], facts.group_name
            spans.append(Span(lane="comm", name=node.name, start=start, end=comm_clock[link]))
        elif is_wait(node) and node.args[0] in done:
            ready, group = done[node.args[0]]
            exposed[group] = exposed.get(group, 0.0) + max(0.0, ready - compute_clock)
            compute_clock = max(compute_clock, ready)
        elif _is_compute(node):
            cost = compute_seconds(node, hw)
            if cost > 0:
                spans.append(Span(lane="compute", name=node.name, start=compute_clock, end=compute_clock + cost))
                compute_clock += cost
            body = body_of(node)
            # A block's own collectives, after its compute: in its body each is waited on where
            # it is issued (DTensor's), so exposed whole, once the link is free.
            for inner in (n for n in body.graph.nodes if is_collective(n)) if body is not None else ():
                facts = collective_facts(inner)
                link = links.get(facts.group_name, hw)
                start = max(compute_clock, comm_clock.get(link, 0.0))
                comm_clock[link] = start + collective_seconds(facts, link)
                spans.append(Span(lane="comm", name=f"{node.name}.{inner.name}", start=start, end=comm_clock[link]))
                exposed[facts.group_name] = exposed.get(facts.group_name, 0.0) + comm_clock[link] - compute_clock
                compute_clock = comm_clock[link]
    return Timeline(
        graph=graph,
        hardware=hw,
        spans=tuple(spans),
        step_seconds=max([compute_clock, *comm_clock.values()]),
        exposed_comm_seconds=sum(exposed.values()),
        exposed_by_group=exposed,
    )
