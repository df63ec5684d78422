"""Pass (partitioned graphs): a block call whose backward nobody can run keeps no autograd graph."""

from __future__ import annotations

import operator

from torch import fx

from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import is_block_forward
from fsdp_compile.plan import Plan


def _token_read(node: fx.Node) -> bool:
    """Whether a node reads the call's token, its last output: the backward's call, or the
    forward graph's outputs (saved for the backward)."""
    token = len(node.meta["val"]) - 1
    return any(u.target is operator.getitem and u.args[1] == token and u.users for u in node.users)


def keep_only_differentiated_calls(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards exactly the block calls whose token no node reads are
    ``differentiated=False``: under activation checkpointing the forward's calls, which the
    partitioner recomputes in the backward. Each such call's body still records its autograd
    graph (the backward's recompute runs the same compiled frame, so it computes what the
    forward did, bit for bit), but lets it go with its outputs: kept, it would wait in
    ``PendingGraphs`` for a backward that never takes it, holding every activation the
    checkpoint was meant to drop until a later sweep.
    """
    changed = False
    for node in gm.graph.nodes:
        if is_block_forward(node) and not _token_read(node):
            node.kwargs = {**node.kwargs, "differentiated": False}
            if "eager_input_vals" in node.meta:  # the values Inductor constrains the call's inputs to
                args, kwargs = node.meta["eager_input_vals"]
                node.meta["eager_input_vals"] = (args, {**kwargs, "differentiated": False})
            changed = True
    return finish(gm) if changed else gm


def check_keep_only_differentiated_calls(gm: fx.GraphModule, plan: Plan) -> None:
    for node in gm.graph.nodes:
        if is_block_forward(node):
            assert node.kwargs.get("differentiated", True) == _token_read(node), f"{node.name} keeps the wrong graph"
