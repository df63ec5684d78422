"""Pass (partitioned graphs): the step's graph copies a block call's flats out before the call.

NOTE: copied out before the block call
    A repeated block's body takes each flat's members, copied out of the gathered flat (NOTE: a
    flat's copies in the block call, in fsdp_compile/block_call.py). Copied out by the call,
    the flat would stay alive while the body runs, the step's graph holding it as the call's
    argument until the call returns, and the next bucket's gather, issued before the call,
    would be alive with both: two layers' gathered weights beside the one in use, where FSDP2
    has one. Past autograd nothing differentiates the call any more, so the pass moves the
    copy-out into the step's graph: a ``split_gathered`` of each flat right before the call,
    which takes the members (``copied_out``). The copy-out carries the flat's parameter and
    bucket, so it moves with the gather's wait (``schedule_collectives``), and the graph frees
    the flat once it is copied out. The next gather is issued after that copy-out, as FSDP2
    issues its next all-gather after its copy-out (NOTE: the planned order).

    With ``gather_whole_members``, a flat that only block calls read is gathered member by
    member instead (NOTE: members gathered whole, in fsdp_compile/whole_gathers.py): its
    gather becomes ``gather_whole_members`` and the calls take views of the result, with no
    copy at all. A flat gathered in a merged bucket, or whose members are bytes of other
    dtypes (float8 beside its scales), keeps the copy-out.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._inductor.fx_passes.bucketing import _ALL_DTYPES

from fsdp_compile.block_record import call_record
from fsdp_compile.fx_utils import finish
from fsdp_compile.node_meta import BUCKET, PARAM_ID
from fsdp_compile.bucket_copies import member_shapes
from fsdp_compile.patterns import (
    GATHER_WHOLE_MEMBERS,
    SPLIT_GATHERED,
    is_block_call,
    is_block_forward,
    is_unbucketed_all_gather,
    is_wait,
)
from fsdp_compile.plan import Plan

__all__ = ["copy_out_flats", "check_copy_out_flats"]

aten = torch.ops.aten


def _weights_at(call: fx.Node) -> int:
    return 0 if is_block_forward(call) else 1


def _copies(call: fx.Node) -> tuple:
    """How each gathered flat ``call`` reads, first among its weights, is copied out."""
    return call_record(call.args[-1]).flats


def _tag_as(flat: fx.Node, nodes: tuple[fx.Node, ...]) -> None:
    """Give ``nodes`` ``flat``'s parameter and bucket, so they move with its gather's wait."""
    for node in nodes:
        node.meta.update({key: flat.meta[key] for key in (PARAM_ID, BUCKET) if key in flat.meta})


def _copied_out(graph: fx.Graph, flat: fx.Node, unpack: tuple) -> list[fx.Node]:
    """A ``split_gathered`` of ``flat`` and one getitem per member, with ``flat``'s parameter and
    bucket and their fake values."""
    split = graph.call_function(SPLIT_GATHERED, (flat, *unpack))
    value = flat.meta["val"]
    with value.fake_mode:
        split.meta["val"] = SPLIT_GATHERED(value, *unpack)
    members = [graph.call_function(operator.getitem, (split, i)) for i in range(len(split.meta["val"]))]
    _tag_as(flat, (split, *members))
    for member, value in zip(members, split.meta["val"]):
        member.meta["val"] = value
    return members


def _gathered_whole(graph: fx.Graph, flat: fx.Node, unpack: tuple) -> list[fx.Node]:
    """``flat``'s gather turned into ``gather_whole_members`` and one view per member of its
    result, with ``flat``'s parameter and bucket and their fake values."""
    world, sizes, _, dims, ranks = unpack
    gather = flat.args[0]
    source, group_size, group_name = gather.args
    gather.target, gather.args = GATHER_WHOLE_MEMBERS, (source, group_size, group_name, list(sizes))
    if "eager_input_vals" in gather.meta:  # the values Inductor constrains the op's inputs to
        (value, *_), _ = gather.meta["eager_input_vals"]
        gather.meta["eager_input_vals"] = ((value, group_size, group_name, list(sizes)), {})
    lengths = [world * size for size in sizes]
    split = graph.call_function(aten.split_with_sizes.default, (flat, lengths))
    pieces = [graph.call_function(operator.getitem, (split, i)) for i in range(len(sizes))]
    shapes = member_shapes(dims, ranks)
    members = [graph.call_function(aten.view.default, (piece, shape)) for piece, shape in zip(pieces, shapes)]
    value = flat.meta["val"]
    with value.fake_mode:
        split.meta["val"] = list(value.split_with_sizes(lengths))
        for piece, member, piece_value, shape in zip(pieces, members, split.meta["val"], shapes):
            piece.meta["val"], member.meta["val"] = piece_value, piece_value.view(shape)
    _tag_as(flat, (split, *pieces, *members))
    return members


def _gathers_whole(flat: fx.Node, unpack: tuple, calls: set[fx.Node]) -> bool:
    """Whether ``flat`` can be gathered member by member: its own unmerged gather of a 1-D
    shard, read by block calls only, its members all of its dtype."""
    gather = flat.args[0] if is_wait(flat) else None
    if gather is None or not is_unbucketed_all_gather(gather) or len(gather.args) != 3:
        return False
    dtype = flat.meta["val"].dtype
    one_dim = gather.args[0].meta["val"].dim() == 1
    return one_dim and all(u in calls for u in flat.users) and all(_ALL_DTYPES[d] == dtype for d in unpack[2])


def copy_out_flats(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no block call reads a gathered flat: each takes the members a
    ``split_gathered`` right before it copied out (``copied_out``; NOTE: copied out before the
    block call), or, under ``gather_whole_members``, views of its members gathered whole."""
    calls = [n for n in gm.graph.nodes if is_block_call(n) and _copies(n) and not n.kwargs.get("copied_out")]
    if not calls:
        return gm
    whole: dict[fx.Node, list[fx.Node]] = {}  # a flat gathered whole: its members' views
    readers = set(calls)
    for call in calls:
        at, copies = _weights_at(call), _copies(call)
        weights = call.args[at]
        members = []
        for flat, copy in zip(weights, copies):
            with gm.graph.inserting_before(call):
                if flat not in whole and plan.options.gather_whole_members and _gathers_whole(flat, copy.unpack, readers):
                    whole[flat] = _gathered_whole(gm.graph, flat, copy.unpack)
                members += whole[flat] if flat in whole else _copied_out(gm.graph, flat, copy.unpack)
        call.args = (*call.args[:at], [*members, *weights[len(copies) :]], *call.args[at + 1 :])
        call.kwargs = {**call.kwargs, "copied_out": True}
        if "eager_input_vals" in call.meta:  # the values Inductor constrains the call's inputs to
            args, kwargs = call.meta["eager_input_vals"]
            values = [m.meta["val"] for m in members] + list(args[at][len(copies) :])
            call.meta["eager_input_vals"] = ((*args[:at], values, *args[at + 1 :]), {**kwargs, "copied_out": True})
    return finish(gm)


def check_copy_out_flats(gm: fx.GraphModule, plan: Plan) -> None:
    for node in gm.graph.nodes:
        if is_block_call(node) and _copies(node):
            assert node.kwargs.get("copied_out", False), f"{node.name} copies its flats out itself"
