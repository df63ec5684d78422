"""Pass (partitioned graphs): one all-gather and one reduce-scatter per bucket of the plan.

Runs on each partitioned graph, after the min-cut partitioner, so the forward's gathers, the
backward's re-gathers (``reshard_after_forward``) and the backward's reduce-scatters are each
merged in the graph that runs them, and ``reshard``'s per-parameter recompute tags stay as they
are. A backward bucket holds the members the backward actually re-gathers or reduces (a bias
whose gradient needs no weight is not re-gathered): never more than the plan's bucket.

The merges insert their nodes directly (the gather's copy-in is torch's own packing op, from
``torch._inductor.fx_passes.bucketing``) rather than tracing a merge function as torch's
bucketing does: that costs a ``make_fx`` run per bucket, which at 32 layers was 40% of the
backend's time. See NOTE: bucket layout.

NOTE: bucket layout
    all-gather: each member's padded shard is copied once, in bucket order, into this rank's
    slot of the gathered buffer (``_pre_bucket_all_gather``, one ``_foreach_copy_``, casts
    folded in), then one ``all_gather_into_tensor_out`` fills the buffer in place. The buffer
    is rank-major, ``[rank 0: p0 p1 ... | rank 1: p0 p1 ... | ...]``, so a member's full
    tensor is its column block of ``buffer.view(world, -1)``: rows of every rank's segment.
    That is a strided view, not a contiguous one, so each member is copied out once, all of
    them by one ``split_gathered`` (FSDP2's ``split_with_sizes_copy``). Cost per bucket: one
    copy in (1/world of the bucket), one copy out (the bucket), against per-parameter
    gathers' pad copies only; the buffer is freed once the copy-out has read it.
    reduce-scatter: one ``pack_for_reduce_scatter`` (FSDP2's ``_chunk_cat``) lays the members'
    full gradients out rank-major (the single copy in, which casts them to the reduce dtype
    as it copies where each member's cast widens: NOTE: gradients packed once, in
    passes/pack_in_reduce_dtype.py); one ``reduce_scatter_tensor`` returns
    this rank's row, and members are views of it. It reduces with the members' op (one per
    bucket: NOTE: bucket rules) and, under "sum", each member divides its rows as unbucketed:
    bucketing changes no arithmetic, only where bytes sit. Both copies are one op each,
    opaque to the compiler: fsdp_compile/bucket_copies.py says why.
"""

from __future__ import annotations

import operator
from collections import defaultdict

from torch import fx
import torch
from torch._inductor.fx_passes.bucketing import _ALL_DTYPES, _compute_foreach_groups, pick_bucket_dtype
from torch._inductor.pattern_matcher import stable_topological_sort

from fsdp_compile.node_meta import AMAX, BUCKET, BYTES_BY_DTYPE, CARRIES, FLOAT8_SCALE, MEMBERS, PARAM_ID, UNPACKED
from fsdp_compile.bucket_copies import widens
from fsdp_compile.compat import pre_bucket_all_gather_args
from fsdp_compile.fx_utils import call, finish, inserting
from fsdp_compile.patterns import (
    ALL_GATHER_OUT,
    ALL_REDUCE,
    PACK_FOR_REDUCE_SCATTER,
    REDUCE_SCATTER,
    SPLIT_GATHERED,
    WAIT,
    bucket_index,
    cast_dtype,
    collective_facts,
    is_all_gather,
    is_collective,
    is_param_collective,
    is_reduce_scatter,
    is_wait,
)
from fsdp_compile.plan import Plan


def _members(gm: fx.GraphModule, plan: Plan) -> dict[tuple[str, int], list[fx.Node]]:
    """Unbucketed parameter collectives by (kind, bucket index), in graph order."""
    members: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        param_id = node.meta.get(PARAM_ID)
        if is_param_collective(node) and bucket_index(node) is None:
            kind = "all_gather" if is_all_gather(node) else "reduce_scatter"
            members[kind, plan.bucket_of(param_id).index].append(node)
    return members


def _hoist_inputs(gm: fx.GraphModule, gathers: list[fx.Node]) -> None:
    """Move what later members' inputs need (views and casts of shards) before the first
    member, keeping their order, so the merged gather can stand where the first one stood.
    (Nodes compare by their place in the graph, kept by FX as nodes move.)"""
    first = gathers[0]
    needed, frontier = set(), [g.args[0] for g in gathers[1:]]
    while frontier:
        node = frontier.pop()
        if isinstance(node, fx.Node) and node.op == "call_function" and node > first:
            if node not in needed:
                needed.add(node)
                frontier.extend(node.all_input_nodes)
    for node in sorted(needed):
        first.prepend(node)


aten = torch.ops.aten
CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)


def _folded_cast(gather: fx.Node) -> fx.Node | None:
    """The cast feeding only this gather: the bucket's copy-in converts instead."""
    source = gather.args[0]
    return source if source.op == "call_function" and source.target in CASTS and len(source.users) == 1 else None


def _reshape(graph: fx.Graph, node: fx.Node, shape: list[int]) -> fx.Node:
    """``reshape`` as tracing records it: a view where the layout allows one, else a copy
    (``clone``, then ``_unsafe_view``), so the passes that follow views see which it is."""
    if node.meta["val"].is_contiguous():
        return call(graph, aten.view.default, node, shape)
    copied = call(graph, aten.clone.default, node, memory_format=torch.contiguous_format)
    return call(graph, aten._unsafe_view.default, copied, shape)


def _merge_gathers(graph: fx.Graph, gathers: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """One ``all_gather_into_tensor_out`` for ``gathers`` (see NOTE: bucket layout), inserted
    before the first; returns the new nodes and each member's unpacked full tensor."""
    _, world, group_name = gathers[0].args
    ins = [g.args[0].args[0] if _folded_cast(g) else g.args[0] for g in gathers]
    out_dtypes = [g.meta["val"].dtype for g in gathers]
    dtype = pick_bucket_dtype(out_dtypes)
    vals = [n.meta["val"] for n in ins]
    sizes = [v.numel() * d.itemsize // dtype.itemsize for v, d in zip(vals, out_dtypes)]
    rank = torch.distributed.get_rank(torch.distributed.distributed_c10d._resolve_process_group(group_name))
    with inserting(graph, before=gathers[0]) as new_nodes:
        buffer = call(
            graph, torch.ops.bucketing._pre_bucket_all_gather.default,
            *pre_bucket_all_gather_args(
                ins, world, group_name, dtype, [_ALL_DTYPES.index(d) for d in out_dtypes], rank,
                _compute_foreach_groups(vals, out_dtypes),
            ),
        )
        mine = call(graph, aten.narrow.default, buffer, 0, sum(sizes) * rank, sum(sizes))
        gathered = call(graph, ALL_GATHER_OUT, mine, world, group_name, out=buffer)
        waited = call(graph, WAIT, gathered)
        shapes = [[v.shape[0] * world, *v.shape[1:]] for v in vals]
        members = call(
            graph, SPLIT_GATHERED, waited, world, sizes, [_ALL_DTYPES.index(d) for d in out_dtypes],
            [d for shape in shapes for d in shape], [len(shape) for shape in shapes],
        )
        outputs = [call(graph, operator.getitem, members, i) for i in range(len(vals))]
    return new_nodes, outputs


def _copied_in(scatters: list[fx.Node]) -> tuple[list[fx.Node], tuple]:
    """What a bucket's copy-in reads, and its dtype argument: the members' inputs, or where
    each is a widening cast from one dtype that nothing else reads, what they cast: the
    copy-in casts as it copies (NOTE: bucket layout)."""
    inputs = [n.args[0] for n in scatters]
    if not all(cast_dtype(c) is not None and len(c.users) == 1 for c in inputs):
        return inputs, ()
    sources = {c.args[0].meta["val"].dtype for c in inputs}
    dtype = inputs[0].meta["val"].dtype
    if len(sources) != 1 or not widens(sources.pop(), dtype):
        return inputs, ()
    return [c.args[0] for c in inputs], (dtype,)


def _merge_scatters(graph: fx.Graph, scatters: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """One ``reduce_scatter_tensor`` for ``scatters`` (see NOTE: bucket layout), inserted after
    the last; returns the new nodes and each member's reduced rows."""
    _, op, world, group_name = scatters[0].args
    vals = [n.args[0].meta["val"] for n in scatters]
    with inserting(graph, after=scatters[-1]) as new_nodes:
        grads, dtype = _copied_in(scatters)
        flat = call(graph, PACK_FOR_REDUCE_SCATTER, grads, world, *dtype)
        reduced = call(graph, WAIT, call(graph, REDUCE_SCATTER, flat, op, world, group_name))
        pieces = call(graph, aten.split_with_sizes.default, reduced, [v.numel() // world for v in vals])
        outputs = [
            _reshape(graph, call(graph, operator.getitem, pieces, i), [v.shape[0] // world, *v.shape[1:]])
            for i, v in enumerate(vals)
        ]
    return new_nodes, outputs


def _merge_amax_reductions(gm: fx.GraphModule, reductions: list[fx.Node]) -> list[fx.Node]:
    """One all-reduce (MAX) of the stacked amaxes of a bucket's float8 members in place of
    one each (see NOTE: float8 gathers, in fsdp_compile/float8.py); returns the new nodes."""
    _hoist_inputs(gm, reductions)
    graph = gm.graph
    _, op, group_name = reductions[0].args
    with inserting(graph, before=reductions[0]) as new_nodes:
        # cat of views, not stack: the graph is past AOTAutograd's decompositions.
        stacked = call(graph, aten.cat.default, [call(graph, aten.view.default, r.args[0], [1]) for r in reductions])
        reduced = call(graph, WAIT, call(graph, ALL_REDUCE, stacked, op, group_name))
        amaxes = [call(graph, aten.select.int, reduced, 0, i) for i in range(len(reductions))]
    for reduction, amax in zip(reductions, amaxes):
        (wait,) = reduction.users
        wait.replace_all_uses_with(amax)
        graph.erase_node(wait)
        graph.erase_node(reduction)
    for node in new_nodes:
        node.meta[FLOAT8_SCALE] = True
    return new_nodes


def _replace(graph: fx.Graph, members: list[fx.Node], outputs: list[fx.Node]) -> None:
    """Members' results now come from the bucket: drop each member, its wait and its folded
    cast (nodes this backend made)."""
    for member, output in zip(members, outputs):
        (wait,) = member.users
        wait.replace_all_uses_with(output)
        cast = _folded_cast(member)
        graph.erase_node(wait)
        graph.erase_node(member)
        if cast is not None and not cast.users:
            graph.erase_node(cast)


def _bytes_by_dtype(gathers: list[fx.Node]) -> dict[torch.dtype, int]:
    """What the members of a merged gather move, by dtype (float8 members by their float8
    dtype, not the uint8 they travel as)."""
    by_dtype: dict[torch.dtype, int] = defaultdict(int)
    for gather in gathers:
        facts = collective_facts(gather)
        by_dtype[facts.dtype] += facts.nbytes
    return dict(by_dtype)


def _tag(nodes: list[fx.Node], outputs: list[fx.Node], index: int, param_ids: list[int]) -> None:
    for node in nodes:
        node.meta[BUCKET] = index
        if is_collective(node):
            node.meta[MEMBERS] = tuple(param_ids)
    for output, param_id in zip(outputs, param_ids):
        output.meta[UNPACKED] = param_id


def bucket_collectives(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards every parameter all-gather and reduce-scatter carries ``meta[BUCKET]``
    (its plan bucket) and ``meta[MEMBERS]`` (the ``param_id``s it moves, in buffer
    order), and each bucket has at most one of each kind per graph; members' outputs are
    marked ``meta[UNPACKED] = param_id``. Collectives that lower_collectives did not
    make (a user's, an all-reduce) are left alone. The graph stays topologically sorted; the
    placement of collectives and waits is ``schedule_collectives``'s job.
    """
    # Per bucket and group: a tensor-parallel weight's max over "tp" follows its max over the
    # data-parallel group, and the two never merge.
    amax_reductions: dict[tuple[int, str], list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.meta.get(AMAX):
            amax_reductions[plan.bucket_of(node.meta[PARAM_ID]).index, node.args[2]].append(node)
    for (index, _), reductions in amax_reductions.items():
        param_ids = tuple(r.meta[PARAM_ID] for r in reductions)
        merged = _merge_amax_reductions(gm, reductions) if len(reductions) > 1 else reductions
        for node in merged:
            node.meta[BUCKET] = index
            if is_collective(node):
                node.meta[MEMBERS] = param_ids
    for (kind, index), nodes in _members(gm, plan).items():
        if len(nodes) == 1:
            (collective,) = nodes
            (wait,) = collective.users
            collective.meta[BUCKET] = wait.meta[BUCKET] = index
            collective.meta[MEMBERS] = (collective.meta[PARAM_ID],)
            continue
        param_ids = [n.meta[PARAM_ID] for n in nodes]
        if kind == "all_gather":
            _hoist_inputs(gm, nodes)
            new_nodes, outputs = _merge_gathers(gm.graph, nodes)
        else:
            new_nodes, outputs = _merge_scatters(gm.graph, nodes)
        by_dtype = _bytes_by_dtype(nodes)
        _replace(gm.graph, nodes, outputs)
        _tag(new_nodes, outputs, index, param_ids)
        if kind == "all_gather":
            (collective,) = (n for n in new_nodes if is_collective(n))
            collective.meta[BYTES_BY_DTYPE] = by_dtype
            if len(by_dtype) == 1:  # one dtype: float8 bytes moved as uint8 say so
                collective.meta[CARRIES] = next(iter(by_dtype))
    # A merged reduce-scatter stands after its last member: earlier members' tails move after it.
    stable_topological_sort(gm.graph)
    return finish(gm)


def check_bucket_collectives(gm: fx.GraphModule, plan: Plan) -> None:
    seen: dict[tuple[str, int], fx.Node] = {}
    for node in gm.graph.nodes:
        if not is_param_collective(node):
            continue
        index = bucket_index(node)
        assert index is not None, f"parameter collective {node.name} is in no bucket"
        kind = "all_gather" if is_all_gather(node) else "reduce_scatter"
        assert kind == "all_gather" or is_reduce_scatter(node)
        assert (kind, index) not in seen, f"bucket {index} has two {kind}s: {seen[kind, index].name}, {node.name}"
        seen[kind, index] = node
        assert collective_facts(node).group_name == plan.buckets[index].group_name, f"{node.name} on the wrong group"
        assert [is_wait(u) for u in node.users] == [True], f"{node.name} needs exactly one wait"
