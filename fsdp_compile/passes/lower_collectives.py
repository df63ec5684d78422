"""Pass (joint graph): markers become functional collectives on the plan's process groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from fsdp_compile.node_meta import AMAX, CARRIES, FLOAT8_SCALE, PARAM_ID, UNPACKED
from fsdp_compile import float8
from fsdp_compile.fx_utils import call, finish, inline_traced, inserting
from fsdp_compile.markers import first_rows, gathered, pad_rows, reduced
from fsdp_compile.patterns import (
    ALL_GATHER,
    ALL_REDUCE,
    WAIT,
    is_all_reduce,
    is_float8_cast,
    is_marker,
    is_pack_for_reduce_scatter,
    is_reduce_grad,
    is_reduce_scatter,
    is_split_gathered,
    is_unshard,
    is_view,
    marker_param_id,
)
from fsdp_compile.plan import ParamPlan, Plan

aten = torch.ops.aten


@dataclass(frozen=True)
class _IntoGraph:
    """Inserts each op of the marker arithmetic at the graph's insert point (NOTE: one marker
    arithmetic, in fsdp_compile/markers.py)."""

    graph: fx.Graph

    def __call__(self, op, *args) -> fx.Node:
        return call(self.graph, op, *args)

    def val(self, node: fx.Node) -> torch.Tensor:
        return node.meta["val"]


def _lower_unshard(graph: fx.Graph, marker: fx.Node, param: ParamPlan) -> fx.Node:
    sharding = param.sharding
    return gathered(
        _IntoGraph(graph), marker.args[0], param_dtype=sharding.param_dtype, gathers=param.gathers,
        world=sharding.world, global_rows=sharding.global_shape[0], group_name=sharding.group_name,
    )  # fmt: skip


def _lower_float8_unshard(graph: fx.Graph, marker: fx.Node, param: ParamPlan) -> None:
    """The marker and the float8 casts reading it become one float8 gather of the shard, cast
    with the whole weight's scale (see NOTE: float8 gathers, in fsdp_compile/float8.py)."""
    casts = list(marker.users)
    assert casts and all(is_float8_cast(c) for c in casts), f"float8 weight {param.fqn} read uncast"
    _, dtype, round_scales, tensor_parallel_group = casts[0].args
    # Padding rows are zeros: they leave the max alone, and give an empty shard a max.
    into = _IntoGraph(graph)
    padded = pad_rows(into, marker.args[0], param.padded_rows)

    def reduce_amax(local: fx.Node, group_name: str) -> fx.Node:
        reduction = call(graph, ALL_REDUCE, local, "max", group_name)
        reduction.meta[AMAX] = True  # bucket_collectives merges a bucket's, group by group
        return call(graph, WAIT, reduction)

    # torchao's own amax, scale and cast, traced: the compiled cast is the eager one's. A
    # tensor-parallel piece's max is then taken over the other pieces too: the whole weight's.
    with inserting(graph, before=marker) as scale_chain:
        weight_amax = reduce_amax(inline_traced(graph, float8.amax, padded), param.sharding.group_name)
        if tensor_parallel_group:
            weight_amax = reduce_amax(weight_amax, tensor_parallel_group)
        scale = inline_traced(graph, lambda a: float8.scale(a, dtype, round_scales), weight_amax)
    for node in scale_chain:
        # The scale's chain (its all-reduce included) is issued with the gather it feeds.
        node.meta[FLOAT8_SCALE] = True
    data = inline_traced(graph, lambda t, s: float8.cast(t, s, dtype), padded, scale)
    # gloo and NCCL move no float8 type: the bytes travel as uint8.
    gather = call(graph, ALL_GATHER, call(graph, aten.view.dtype, data, torch.uint8), param.sharding.world, param.sharding.group_name)
    gather.meta[CARRIES] = dtype
    rows = first_rows(into, call(graph, WAIT, gather), param.sharding.global_shape[0])
    full = call(graph, aten.view.dtype, rows, dtype)
    for cast in casts:
        for item in list(cast.users):
            item.replace_all_uses_with((full, scale)[item.args[1]])
            graph.erase_node(item)
        graph.erase_node(cast)


def _lower_reduce_grad(graph: fx.Graph, marker: fx.Node, param: ParamPlan) -> fx.Node:
    sharding = param.sharding
    return reduced(
        _IntoGraph(graph), marker.args[0], marker.args[1], strategy=sharding.strategy,
        reduce_dtype=sharding.reduce_dtype, shard_dtype=param.dtype, op=param.reduce_op, world=sharding.world,
        rank=param.rank, shard_rows=param.shard_rows, grad_divisor=sharding.grad_divisor,
        group_name=sharding.group_name, replicate_group_name=sharding.replicate_group_name,
    )  # fmt: skip


def _flat_copies(marker: fx.Node) -> list[fx.Node]:
    """A flat parameter's copies around its marker (NOTE: flat parameters, in
    fsdp_compile/flat_params.py): after an ``unshard``, the copy-out, its per-member reads and
    their trims; before a ``reduce_grad``, the gradients' packing and its view (which
    Inductor's joint-graph passes remove where it keeps the shape)."""
    if is_unshard(marker):
        copies = [u for u in marker.users if is_split_gathered(u)]
        frontier = [u for c in copies for u in c.users]
        while frontier:  # getitems, then the slices trimming each member's padding rows
            node = frontier.pop()
            copies.append(node)
            frontier.extend(u for u in node.users if is_view(u) and u.target is aten.slice.Tensor)
        return copies
    grad = marker.args[0]
    if is_view(grad) and is_pack_for_reduce_scatter(grad.args[0]):
        return [grad.args[0], grad]
    return [grad] if is_pack_for_reduce_scatter(grad) else []


def _members(copies: list[fx.Node]) -> list[fx.Node]:
    """The gathered members among a flat's copies: what the block's body reads."""
    return [n for n in copies if not is_split_gathered(n) and not any(u in copies for u in n.users)]


def lower_collectives(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no marker is left: each ``unshard`` is a cast/pad/all_gather/wait/slice chain
    (only the cast for ``no_shard``) and each ``reduce_grad`` a reduce-scatter (ZeRO-2/3) or
    all-reduce (``optim``, ``no_shard``) chain, then the HSDP all-reduce across replicas, on the
    parameter's groups, sizes, world, dtypes and reduce op taken from the plan (the chains are
    drawn in fsdp_compile/patterns.py): with "sum" a division by ``grad_divisor`` follows, with
    "avg" none. Numerics match the eager markers.
    """
    for marker in list(gm.graph.nodes):
        if not is_marker(marker):
            continue
        param = plan.param(marker_param_id(marker))
        copies = _flat_copies(marker)
        with inserting(gm.graph, before=marker) as chain:
            if is_unshard(marker) and param.sharding.float8 is not None:
                _lower_float8_unshard(gm.graph, marker, param)
                lowered = None
            elif is_unshard(marker):
                lowered = _lower_unshard(gm.graph, marker, param)
            else:
                assert is_reduce_grad(marker)
                lowered = _lower_reduce_grad(gm.graph, marker, param)
        # The chain inherits the marker's provenance (stack trace, module path, forward or
        # backward tag), which the partitioner and the dumps read.
        inherited = {k: v for k, v in marker.meta.items() if k != "val"}
        inherited[PARAM_ID] = param.param_id
        for node in chain:
            node.meta.update(inherited)
        for node in copies:  # they move with the collective (schedule_collectives)
            node.meta[PARAM_ID] = param.param_id
        for member in _members(copies) if is_unshard(marker) else ():
            member.meta[UNPACKED] = param.param_id
        if lowered is not None:
            marker.replace_all_uses_with(lowered)
        gm.graph.erase_node(marker)
    return finish(gm)


def check_lower_collectives(gm: fx.GraphModule, plan: Plan) -> None:
    left = [n.format_node() for n in gm.graph.nodes if is_marker(n) or is_float8_cast(n)]
    assert not left, f"markers left after lowering: {left}"
    for node in gm.graph.nodes:
        param_id = node.meta.get(PARAM_ID)
        reduces = is_reduce_scatter(node) or (is_all_reduce(node) and not node.meta.get(AMAX))
        if param_id is not None and reduces:
            planned = plan.param(param_id).reduce_op
            assert node.args[1] == planned, f"{node.name} reduces with {node.args[1]!r}, the plan says {planned!r}"
