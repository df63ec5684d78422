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
"""

from __future__ import annotations

import operator

from torch import fx

from fsdp_compile.block_record import call_record
from fsdp_compile.fx_utils import finish
from fsdp_compile.node_meta import BUCKET, PARAM_ID
from fsdp_compile.patterns import SPLIT_GATHERED, is_block_call, is_block_forward
from fsdp_compile.plan import Plan

__all__ = ["copy_out_flats", "check_copy_out_flats"]


def _weights_at(call: fx.Node) -> int:
    return 0 if is_block_forward(call) else 1


def _copies(call: fx.Node) -> tuple:
    """How each gathered flat ``call`` reads, first among its weights, is copied out."""
    return call_record(call.args[-1]).flats


def _copied_out(graph: fx.Graph, flat: fx.Node, unpack: tuple) -> list[fx.Node]:
    """A ``split_gathered`` of ``flat`` and one getitem per member, with ``flat``'s parameter and
    bucket and their fake values."""
    split = graph.call_function(SPLIT_GATHERED, (flat, *unpack))
    value = flat.meta["val"]
    with value.fake_mode:
        split.meta["val"] = SPLIT_GATHERED(value, *unpack)
    members = [graph.call_function(operator.getitem, (split, i)) for i in range(len(split.meta["val"]))]
    for node in (split, *members):
        node.meta.update({key: flat.meta[key] for key in (PARAM_ID, BUCKET) if key in flat.meta})
    for member, value in zip(members, split.meta["val"]):
        member.meta["val"] = value
    return members


def copy_out_flats(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no block call reads a gathered flat: each takes the members a
    ``split_gathered`` right before it copied out (``copied_out``; NOTE: copied out before the
    block call)."""
    calls = [n for n in gm.graph.nodes if is_block_call(n) and _copies(n) and not n.kwargs.get("copied_out")]
    if not calls:
        return gm
    for call in calls:
        at, copies = _weights_at(call), _copies(call)
        weights = call.args[at]
        with gm.graph.inserting_before(call):
            members = [m for flat, copy in zip(weights, copies) for m in _copied_out(gm.graph, flat, copy.unpack)]
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
