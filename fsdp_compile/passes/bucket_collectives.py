"""Pass (partitioned graphs): one all-gather and one reduce-scatter per bucket of the plan.

Runs on each partitioned graph, after the min-cut partitioner, so the forward's gathers, the
backward's re-gathers (``reshard_after_forward``) and the backward's reduce-scatters are each
merged in the graph that runs them, and ``reshard``'s per-parameter recompute tags stay as they
are. A backward bucket holds the members the backward actually re-gathers or reduces (a bias
whose gradient needs no weight is not re-gathered): never more than the plan's bucket.

The merges are torch's own (``torch._inductor.fx_passes.bucketing``): see NOTE: bucket layout.

NOTE: bucket layout
    all-gather: each member's padded shard is copied once, in bucket order, into this rank's
    slot of the gathered buffer (``_pre_bucket_all_gather``, one ``_foreach_copy_``, casts
    folded in), then one ``all_gather_into_tensor_out`` fills the buffer in place. The buffer
    is rank-major, ``[rank 0: p0 p1 ... | rank 1: p0 p1 ... | ...]``, so a member's full
    tensor is its column block of ``buffer.view(world, -1)``: rows of every rank's segment.
    That is a strided view, not a contiguous one; reshaping it to the parameter's shape copies
    once per member (FSDP2's ``split_with_sizes_copy`` does the same). Cost per bucket: one
    copy in (1/world of the bucket), one copy out (the bucket), against per-parameter
    gathers' pad copies only; the buffer is freed once every member is copied out.
    reduce-scatter: each member's full gradient is viewed ``(world, -1)`` and one ``cat`` along
    dim 1 lays them out rank-major (the single copy in); one ``reduce_scatter_tensor`` returns
    this rank's row, and members are views of it. SUM then divide by world, per member, exactly
    as unbucketed: bucketing changes no arithmetic, only where bytes sit.
"""

from __future__ import annotations

from collections import defaultdict

from torch import fx
from torch._inductor.fx_passes.bucketing import merge_all_gather_bucket, merge_reduce_scatter_bucket
from torch._inductor.pattern_matcher import stable_topological_sort

from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import (
    bucket_index,
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
        param_id = node.meta.get("mfsdp_param_id")
        if is_param_collective(node) and bucket_index(node) is None:
            kind = "all_gather" if is_all_gather(node) else "reduce_scatter"
            members[kind, plan.bucket_of(param_id).index].append(node)
    return members


def _hoist_inputs(gm: fx.GraphModule, gathers: list[fx.Node]) -> None:
    """Move what later members' inputs need (views and casts of shards) before the first
    member, keeping their order, so the merged gather can stand where the first one stood."""
    first = gathers[0]
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    needed, frontier = set(), [g.args[0] for g in gathers[1:]]
    while frontier:
        node = frontier.pop()
        if isinstance(node, fx.Node) and node.op == "call_function" and position[node] > position[first]:
            if node not in needed:
                needed.add(node)
                frontier.extend(node.all_input_nodes)
    for node in sorted(needed, key=position.__getitem__):
        first.prepend(node)


def _tag(nodes: list[fx.Node], outputs: dict[fx.Node, fx.Node], index: int, param_ids: dict) -> None:
    for node in nodes:
        node.meta["mfsdp_bucket"] = index
        if is_collective(node):
            node.meta["mfsdp_members"] = tuple(param_ids.values())
    for old_wait, new_output in outputs.items():
        new_output.meta["mfsdp_unpacked"] = param_ids[old_wait]


def bucket_collectives(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards every parameter all-gather and reduce-scatter carries ``meta["mfsdp_bucket"]``
    (its plan bucket) and ``meta["mfsdp_members"]`` (the ``param_id``s it moves, in buffer
    order), and each bucket has at most one of each kind per graph; members' outputs are
    marked ``meta["mfsdp_unpacked"] = param_id``. Collectives that lower_collectives did not
    make (a user's, an all-reduce) are left alone. The graph stays topologically sorted; the
    placement of collectives and waits is ``schedule_collectives``'s job.
    """
    for (kind, index), nodes in _members(gm, plan).items():
        if len(nodes) == 1:
            (collective,) = nodes
            (wait,) = collective.users
            collective.meta["mfsdp_bucket"] = wait.meta["mfsdp_bucket"] = index
            collective.meta["mfsdp_members"] = (collective.meta["mfsdp_param_id"],)
            continue
        param_ids = {next(iter(n.users)): n.meta["mfsdp_param_id"] for n in nodes}
        if kind == "all_gather":
            _hoist_inputs(gm, nodes)
            new_nodes, outputs = merge_all_gather_bucket(
                gm.graph, nodes, mode="custom_ops", insert_before=nodes[0]
            )
        else:
            new_nodes, outputs = merge_reduce_scatter_bucket(gm.graph, nodes, mode="default")
        _tag(new_nodes, outputs, index, param_ids)
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
