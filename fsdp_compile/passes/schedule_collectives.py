"""Pass (partitioned graphs): where each bucket's collective is issued and where it is waited on.

NOTE: the planned order
    All-gathers: the graph's gathers are ranked by the first use of their bucket in this
    graph (the forward's order in forward, roughly its reverse in backward). With prefetch
    distance ``d`` (``options["prefetch"]``), the gather ranked ``j`` is issued where the compute
    leading to the bucket ranked ``j - d`` starts: right after the last node before that
    bucket's first use that reads an earlier gathered bucket (the first gather: at the start of
    the graph, where a backward has the loss's gradient to compute before any bucket is read;
    the next ``d``: at the first bucket's use, so the loss's gradient runs with one gather in
    flight, as under FSDP2), so it runs on the communication stream while buckets
    ``j - d .. j - 1`` compute. The glue between two buckets (a residual add, the part of a norm
    before its weight) comes after the issue because Inductor fuses it with the next bucket's
    first use, and a fused kernel needs the wait before it: issued after the glue, the gather
    would be pushed behind the previous wait. Its wait, with the bucket's copy-out, sits right
    before the bucket's first use. The bytes alive do not grow: the buckets read before the
    issue point are dead there. Where only the getitems of a call's results lie between a
    gather's issue and the next reduce-scatter's copy-in or gather's wait and copy-out, the
    issue goes after those, as FSDP2 packs a layer's gradients and copies the next layer out
    before it issues another all-gather: what they free (a gradient bucket's members, a
    gathered flat, NOTE: copied out before the block call) is freed before another bucket is
    gathered, and the gather still runs while that layer computes. Gathers are issued in rank
    order (a gather whose shards are ready earlier still waits for the one ranked above it), and
    ties anywhere are broken by bucket index: graphs of different ranks differ in detail (a rank
    left with an empty shard copies in differently, so its inputs sit elsewhere), yet every rank
    of a process group must issue that group's collectives in the same order, or gloo and NCCL
    mismatch. With
    ``options["max_inflight_bytes"]`` a gather's distance shrinks (down to 0) where issuing it
    earlier would push gathered bytes alive above the bound; see ``gather_lifetimes`` for how
    alive bytes are counted.
    Reduce-scatters: issued, with their copy-in (the pack of a flat's or a bucket's
    gradients), as soon as the bucket's last gradient exists; each is waited right before the
    next one's copy-in (the last one right before the graph returns), so it overlaps the next
    bucket's backward compute, and its packed input is dead before the next one is packed:
    one packed gradient bucket is alive at a time, as FSDP2 waits for the last
    reduce-scatter before packing the next one. Everything else keeps the partitioner's
    order.

The graph's node order is the execution order of the eager FX runner; Inductor schedules
its own kernels from it (see docs/design.md, "The order under Inductor").
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from fsdp_compile.node_meta import BUCKET, FLOAT8_SCALE, PARAM_ID, PREFETCH
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import collective_facts, is_all_gather, is_param_collective, is_view
from fsdp_compile.plan import Plan

__all__ = [
    "schedule_collectives",
    "check_schedule_collectives",
    "gather_lifetimes",
    "GatherLifetime",
    "ranked_gathers",
    "peak_inflight_bytes",
    "collective_groups",
    "CollectiveGroup",
]


@dataclass(frozen=True)
class CollectiveGroup:
    """One parameter collective: what moves with its issue, and with its wait."""

    collective: fx.Node
    issue: tuple[fx.Node, ...]
    """Copy-in (casts, pads, the bucket's packing) and the collective, in graph order."""
    wait: tuple[fx.Node, ...]
    """The wait and what only unpacks its result (copy-out, slices, the gradient's division)."""

    @property
    def nbytes(self) -> int:
        return collective_facts(self.collective).nbytes


def _bucket(node: fx.Node, plan: Plan) -> int | None:
    if node.meta.get(BUCKET) is not None:
        return node.meta[BUCKET]
    param_id = node.meta.get(PARAM_ID)
    return None if param_id is None else plan.bucket_of(param_id).index


def _views_placeholder(node: fx.Node) -> bool:
    while is_view(node) and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return node.op == "placeholder"


def _group(collective: fx.Node, plan: Plan, claimed: set[fx.Node]) -> tuple[set, set]:
    """The nodes that move with ``collective``'s issue, and with its wait."""
    bucket = _bucket(collective, plan)

    def mine(node: fx.Node) -> bool:
        return node.op == "call_function" and _bucket(node, plan) == bucket

    def feeds(node: fx.Node) -> bool:
        # Its tagged copy-in, and views (of shards, or of a gradient) the partitioner created
        # untagged. Compute never moves with a collective.
        return mine(node) or is_view(node)

    issue, candidates = {collective}, [n for n in collective.all_input_nodes if feeds(n)]
    while candidates:
        node = candidates.pop()
        if node in claimed or node in issue:
            continue
        # A view of a shard may also be saved for backward: it moves anyway, being free; a
        # float8 scale also feeds the matmul, yet its chain must precede the cast it scales.
        moves = _views_placeholder(node) or node.meta.get(FLOAT8_SCALE, False)
        if all(u in issue for u in node.users) or moves:
            issue.add(node)
            candidates.extend(n for n in node.all_input_nodes if feeds(n))
    (wait,) = collective.users
    unpack, frontier = {wait}, list(wait.users)
    while frontier:  # views of the result move with it: they cost nothing
        node = frontier.pop()
        if (mine(node) or (is_view(node) and len(node.all_input_nodes) == 1)) and node not in unpack:
            unpack.add(node)
            frontier.extend(node.users)
    return issue, unpack


def collective_groups(gm: fx.GraphModule, plan: Plan) -> list[CollectiveGroup]:
    """Every parameter collective of ``gm`` with the nodes that move with its issue and wait."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    groups, claimed = [], set()
    for collective in gm.graph.nodes:
        if not is_param_collective(collective):
            continue
        issue, unpack = _group(collective, plan, claimed)
        claimed |= issue | unpack
        groups.append(
            CollectiveGroup(
                collective,
                tuple(sorted(issue, key=position.__getitem__)),
                tuple(sorted(unpack, key=position.__getitem__)),
            )
        )
    return groups


def _first_use(group: CollectiveGroup, index: dict[fx.Node, int], end: int) -> int:
    users = [u for n in group.wait for u in n.users if u not in group.wait]
    return min((index[u] for u in users), default=end)


def _glue_start(use: int, reads: list[int]) -> int:
    """Slot right after the last read of an earlier gathered bucket before slot ``use``."""
    return max((r + 1 for r in reads if r < use), default=use)


def _reads(group: CollectiveGroup, index: dict[fx.Node, int]) -> list[int]:
    """Positions of the nodes that read the gathered bucket or a view of it."""
    reads, frontier, seen = [], list(group.wait), set(group.wait)
    while frontier:
        for user in frontier.pop().users:
            if user in seen or user not in index:
                continue
            seen.add(user)
            reads.append(index[user])
            if is_view(user):
                frontier.append(user)
    return reads


def _last_use(group: CollectiveGroup, index: dict[fx.Node, int]) -> int:
    """Last position where a gathered member, or a view of one, is read (the output's when
    returned; -1: never read)."""
    return max(_reads(group, index), default=-1)


def _earliest(nodes: tuple[fx.Node, ...], index: dict[fx.Node, int]) -> int:
    """First slot after every input the group takes from the unmoved nodes."""
    inputs = [i for n in nodes for i in n.all_input_nodes if i not in nodes and i in index]
    return max((index[i] + 1 for i in inputs), default=0)


def _ranked(groups: list[CollectiveGroup], index: dict[fx.Node, int], end: int, plan: Plan) -> list:
    """The all-gathers among ``groups`` by the first use of their bucket, ties by bucket index:
    the rank every rank agrees on (see NOTE: the planned order)."""
    gathers = [g for g in groups if is_all_gather(g.collective)]
    return sorted(gathers, key=lambda g: (_first_use(g, index, end), _bucket(g.collective, plan)))


def ranked_gathers(gm: fx.GraphModule, plan: Plan) -> list[tuple[CollectiveGroup, fx.Node]]:
    """Every parameter all-gather of ``gm`` by rank, with the first node reading its bucket (the
    output node when the bucket is only returned)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    end = len(nodes) - 1
    return [(g, nodes[_first_use(g, index, end)]) for g in _ranked(collective_groups(gm, plan), index, end, plan)]


def _place_gathers(gathers, rest_index, end, plan: Plan) -> tuple[dict, dict, dict]:
    """Issue and wait slots (slot s = right before the s-th unmoved node) and prefetch
    distances of ``gathers``, given in rank order."""
    uses = [_first_use(g, rest_index, end) for g in gathers]
    # starts[r]: where the compute leading to the bucket ranked r begins (NOTE: the planned order)
    reads = [_reads(g, rest_index) for g in gathers]
    starts = [0] * bool(gathers) + [
        _glue_start(uses[r], [p for earlier in reads[:r] for p in earlier]) for r in range(1, len(gathers))
    ]
    # Prefetched while the first bucket computes, from its use on: what comes before it (a
    # backward's loss gradient) runs with the first gather alone in flight, as under FSDP2,
    # whose backward prefetch starts at the first layer's pre-backward hook.
    ahead_of = uses[:1] + starts[1:]
    bound = plan.options.max_inflight_bytes
    issue_slot, wait_slot, distance = {}, {}, {}
    alive: list[tuple[int, int, int]] = []  # (from slot, to slot, bytes) of placed gathers
    previous = 0
    for rank, group in enumerate(gathers):
        last = max(max(reads[rank], default=-1), uses[rank])
        wait_slot[group] = uses[rank]
        for k in range(min(plan.options.prefetch, rank), -1, -1):
            # Never before the gather ranked above: every rank issues them in rank order, even
            # where its graph's input positions differ (see NOTE: the planned order).
            start = max(ahead_of[rank - k] if k else starts[rank], _earliest(group.issue, rest_index), previous)
            peak = max(
                sum(b for lo, hi, b in alive if lo <= s <= hi) + group.nbytes for s in range(start, last + 1)
            ) if bound is not None else 0
            if bound is None or peak <= bound:
                break
        else:
            raise CompileUsageError(
                f"options['max_inflight_bytes']={bound} is below what graph {plan.graph_name} "
                f"needs without any prefetch ({peak} bytes of gathered parameters alive while "
                f"bucket {plan.buckets[group.collective.meta[BUCKET]].name} is in use): "
                "raise it, or set a smaller options['bucket_mb']."
            )
        issue_slot[group] = previous = start
        distance[group] = sum(1 for use in uses[:rank] if use >= start)  # less than k if inputs came late
        alive.append((start, last, group.nbytes))
    return issue_slot, wait_slot, distance


def _behind_frees(gathers: list, issue_slot: dict, wait_slot: dict, frees: set[int], rest: list[fx.Node]) -> None:
    """Each gather's issue moved down to the last slot in ``frees`` (a reduce-scatter's copy-in,
    a gather's wait and copy-out) that only the getitems of a call's results separate it from,
    never past its own wait, keeping the gathers in rank order: what those free is freed
    before another bucket is gathered, and the gather waits for no compute it did not wait
    for before (NOTE: the planned order)."""
    previous = 0
    for group in gathers:
        slot = max(issue_slot[group], previous)
        at, last = slot, len(rest) - 1
        while at < min(wait_slot[group], last) and rest[at].target is operator.getitem:
            at += 1
        issue_slot[group] = previous = max((s for s in frees if slot <= s <= at), default=slot)


def schedule_collectives(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards collectives stand where NOTE: the planned order puts them: each all-gather
    issued ``prefetch`` buckets ahead (less only where ``max_inflight_bytes`` or its inputs
    forbid), each all-gather wait right before its bucket's first use, each reduce-scatter
    issued once its gradients exist and waited right before the next one's copy-in. The prefetch
    distance each bucket got is recorded in ``gm.meta[PREFETCH]`` (bucket -> distance).
    """
    groups = collective_groups(gm, plan)
    if not groups:
        return gm
    moved = {n for g in groups for n in g.issue + g.wait}
    rest = [n for n in gm.graph.nodes if n not in moved]
    rest_index = {n: i for i, n in enumerate(rest)}
    end = len(rest) - 1  # the output node's slot
    # Ties are broken by bucket index, never by graph order: ranks whose graphs differ in detail
    # (a rank left with an empty shard) must still issue each group's collectives in one order.
    gathers = _ranked(groups, rest_index, end, plan)
    issue_slot, wait_slot, distance = _place_gathers(gathers, rest_index, end, plan)
    scatters = sorted(
        (g for g in groups if not is_all_gather(g.collective)),
        key=lambda g: (_earliest(g.issue, rest_index), _bucket(g.collective, plan)),
    )
    for group in scatters:
        issue_slot[group] = _earliest(group.issue, rest_index)
    frees = {issue_slot[g] for g in scatters} | {wait_slot[g] for g in gathers}
    _behind_frees(gathers, issue_slot, wait_slot, frees, rest)
    for i, group in enumerate(scatters):
        after_next = issue_slot[scatters[i + 1]] if i + 1 < len(scatters) else end
        # Never after a node that reads the reduced gradient and stays put (a view that also
        # reads symbolic sizes, under dynamic shapes, does not move with the wait).
        wait_slot[group] = min(after_next, _first_use(group, rest_index, end))

    before: list[list[fx.Node]] = [[] for _ in rest]
    waited_first = set()
    for previous, group in zip([None, *scatters], scatters):
        # The previous reduce-scatter's wait, where it falls here, before this one's copy-in.
        if previous is not None and wait_slot[previous] == issue_slot[group]:
            before[issue_slot[group]].extend(previous.wait)
            waited_first.add(previous)
        before[issue_slot[group]].extend(group.issue)
    # Where a gather is issued, a reduce-scatter's copy-in and a gather's wait and copy-out
    # fall first: gradients packed and a flat copied out are freed before another bucket is
    # gathered (NOTE: the planned order).
    for group in sorted(gathers, key=wait_slot.get):
        if issue_slot[group] < wait_slot[group]:
            before[wait_slot[group]].extend(group.wait)
    for group in sorted(gathers, key=issue_slot.get):
        before[issue_slot[group]].extend(group.issue)
    for group in scatters:
        if group not in waited_first:
            before[wait_slot[group]].extend(group.wait)
    for group in sorted(gathers, key=wait_slot.get):
        if issue_slot[group] == wait_slot[group]:
            before[wait_slot[group]].extend(group.wait)
    output = rest[-1]
    for slot, node in enumerate(rest[:-1]):
        for placed in before[slot] + [node]:
            output.prepend(placed)
    for placed in before[end]:
        output.prepend(placed)
    gm.meta[PREFETCH] = {g.collective.meta[BUCKET]: k for g, k in distance.items()}
    return finish(gm)


@dataclass(frozen=True, kw_only=True)
class GatherLifetime:
    """One parameter all-gather of a graph, by positions in the graph's node order."""

    bucket: int
    rank: int
    """Its rank among the graph's gathers by first use."""
    issue: int
    wait: int
    first_use: int
    """First node reading the gathered bucket (the graph's length when only returned)."""
    last_use: int
    """Last node reading a member or a view of one; the graph's length when returned."""
    nbytes: int
    """Gathered bytes, alive from ``issue`` to ``last_use``: the transient copy-out (bucket
    and member copies both alive) is not counted."""


def gather_lifetimes(gm: fx.GraphModule, plan: Plan) -> list[GatherLifetime]:
    """Every parameter all-gather of ``gm``, by rank: what the checks and the tests hold."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [
        GatherLifetime(
            bucket=_bucket(g.collective, plan),
            rank=rank,
            issue=index[g.collective],
            wait=index[g.wait[0]],
            first_use=index[first_read],
            last_use=_last_use(g, index),
            nbytes=g.nbytes,
        )
        for rank, (g, first_read) in enumerate(ranked_gathers(gm, plan))
    ]


def peak_inflight_bytes(lifetimes: list[GatherLifetime]) -> int:
    """Most gathered bytes alive at one node, counting each gather from issue to last use."""
    events = sorted([(t.issue, t.nbytes) for t in lifetimes] + [(t.last_use + 1, -t.nbytes) for t in lifetimes])
    peak = alive = 0
    for _, change in events:
        alive += change
        peak = max(peak, alive)
    return peak


def check_schedule_collectives(gm: fx.GraphModule, plan: Plan) -> None:
    nodes = list(gm.graph.nodes)
    moved = {n for g in collective_groups(gm, plan) for n in g.issue + g.wait}
    lifetimes = gather_lifetimes(gm, plan)
    uses = [t.first_use for t in lifetimes]
    prefetch = gm.meta.get(PREFETCH, {})
    for t in lifetimes:
        between = nodes[t.wait + 1 : t.first_use]
        assert all(n in moved for n in between), (
            f"bucket {t.bucket}: compute between its wait and its first use: {[n.name for n in between]}"
        )
        expected = prefetch.get(t.bucket, min(plan.options.prefetch, t.rank))
        ahead = sum(1 for use in uses[: t.rank] if use > t.issue)
        assert ahead >= expected, f"bucket {t.bucket} issued {ahead} bucket(s) ahead, planned {expected}"
    bound = plan.options.max_inflight_bytes
    if bound is not None:
        peak = peak_inflight_bytes(lifetimes)
        assert peak <= bound, f"{peak} gathered bytes alive at once, above max_inflight_bytes={bound}"
