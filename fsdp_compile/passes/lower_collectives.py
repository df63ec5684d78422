"""Pass (joint graph): markers become functional collectives on the plan's process groups."""

from __future__ import annotations

import torch
from torch import fx

from fsdp_compile.node_meta import AMAX, CARRIES, FLOAT8_SCALE, PARAM_ID, UNPACKED
from fsdp_compile import float8
from fsdp_compile.fx_utils import call, finish, inline_traced, inserting
from fsdp_compile.patterns import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
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


def _pad_rows(graph: fx.Graph, node: fx.Node, rows: int) -> fx.Node:
    missing = rows - node.meta["val"].shape[0]
    if missing == 0:
        return node
    ndim = node.meta["val"].ndim
    # constant_pad_nd lists (before, after) pairs from the last dim back to dim 0.
    return call(graph, aten.constant_pad_nd.default, node, [0, 0] * (ndim - 1) + [0, missing])


def _first_rows(graph: fx.Graph, node: fx.Node, rows: int) -> fx.Node:
    if node.meta["val"].shape[0] == rows:
        return node
    return call(graph, aten.slice.Tensor, node, 0, 0, rows)


def _cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    if node.meta["val"].dtype == dtype:
        return node
    return call(graph, torch.ops.prims.convert_element_type.default, node, dtype)


def _lower_unshard(graph: fx.Graph, marker: fx.Node, param: ParamPlan) -> fx.Node:
    # Cast before padding and gathering: the wire carries param_dtype.
    shard = _cast(graph, marker.args[0], param.sharding.param_dtype)
    if not param.gathers:
        return shard
    padded = _pad_rows(graph, shard, param.padded_rows)
    gathered = call(graph, ALL_GATHER, padded, param.sharding.world, param.sharding.group_name)
    waited = call(graph, WAIT, gathered)
    return _first_rows(graph, waited, param.sharding.global_shape[0])


def _lower_float8_unshard(graph: fx.Graph, marker: fx.Node, param: ParamPlan) -> None:
    """The marker and the float8 casts reading it become one float8 gather of the shard, cast
    with the whole weight's scale (see NOTE: float8 gathers, in fsdp_compile/float8.py)."""
    casts = list(marker.users)
    assert casts and all(is_float8_cast(c) for c in casts), f"float8 weight {param.fqn} read uncast"
    _, dtype, round_scales = casts[0].args
    # Padding rows are zeros: they leave the max alone, and give an empty shard a max.
    padded = _pad_rows(graph, marker.args[0], param.padded_rows)

    def reduce_amax(local: fx.Node) -> fx.Node:
        reduction = call(graph, ALL_REDUCE, local, "max", param.sharding.group_name)
        reduction.meta[AMAX] = True  # bucket_collectives merges a bucket's
        return call(graph, WAIT, reduction)

    # torchao's own amax, scale and cast, traced: the compiled cast is the eager one's.
    with inserting(graph, before=marker) as scale_chain:
        local = inline_traced(graph, float8.amax, padded)
        scale = inline_traced(graph, lambda a: float8.scale(a, dtype, round_scales), reduce_amax(local))
    for node in scale_chain:
        # The scale's chain (its all-reduce included) is issued with the gather it feeds.
        node.meta[FLOAT8_SCALE] = True
    data = inline_traced(graph, lambda t, s: float8.cast(t, s, dtype), padded, scale)
    # gloo and NCCL move no float8 type: the bytes travel as uint8.
    gathered = call(graph, ALL_GATHER, call(graph, aten.view.dtype, data, torch.uint8), param.sharding.world, param.sharding.group_name)
    gathered.meta[CARRIES] = dtype
    rows = _first_rows(graph, call(graph, WAIT, gathered), param.sharding.global_shape[0])
    full = call(graph, aten.view.dtype, rows, dtype)
    for cast in casts:
        for item in list(cast.users):
            item.replace_all_uses_with((full, scale)[item.args[1]])
            graph.erase_node(item)
        graph.erase_node(cast)


def _lower_reduce_grad(graph: fx.Graph, marker: fx.Node, param: ParamPlan) -> fx.Node:
    grad, pending = marker.args[0], marker.args[1]
    dtype = param.sharding.reduce_dtype
    if pending is not None:  # the micro-batches accumulated without sync
        grad = call(graph, aten.add.Tensor, _cast(graph, grad, dtype), pending)
    # The collectives average, or sum and a division follows, as the plan says and the eager
    # marker does (NOTE: averaging in the collective, in fsdp_compile/ops.py).
    op, group_name = param.reduce_op, param.sharding.group_name
    if param.scatters:
        # Cast last, as the collective's input: a pack (pack_in_reduce_dtype) or a bucket's
        # copy-in (bucket_collectives) takes it over and casts as it copies.
        padded = _cast(graph, _pad_rows(graph, grad, param.padded_rows * param.sharding.world), dtype)
        reduced = call(graph, REDUCE_SCATTER, padded, op, param.sharding.world, group_name)
    else:
        reduced = call(graph, ALL_REDUCE, _cast(graph, grad, dtype), op, group_name)
    reduced = call(graph, WAIT, reduced)
    if param.sharding.replicate_group_name:
        reduced = call(graph, WAIT, call(graph, ALL_REDUCE, reduced, op, param.sharding.replicate_group_name))
    if param.sharding.strategy == "optim":
        # Average the whole gradient, then view this rank's rows: every rank keeps the whole
        # averaged gradient (ZeRO-1), as the eager marker does.
        averaged = _averaged(graph, reduced, param)
        first = param.padded_rows * param.rank
        mine = call(graph, aten.slice.Tensor, averaged, 0, first, first + param.shard_rows)
    else:
        mine = _averaged(graph, _first_rows(graph, reduced, param.shard_rows), param)
    return _cast(graph, mine, param.dtype)


def _averaged(graph: fx.Graph, reduced: fx.Node, param: ParamPlan) -> fx.Node:
    if param.reduce_op == "avg":
        return reduced
    return call(graph, aten.div.Tensor, reduced, param.sharding.grad_divisor)


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
