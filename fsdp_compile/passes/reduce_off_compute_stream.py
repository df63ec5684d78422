"""Pass (partitioned graphs): on CUDA, each gradient pack and its reduce-scatter run off the
compute stream.

Afterwards, in a graph whose gradients are on CUDA, no ``pack_for_reduce_scatter`` feeds a
``reduce_scatter_tensor``: each such pair (the pack read by nothing else, through at most one
view) is one ``pack_and_reduce_scatter`` at the pack's place, and the reduce-scatter's
``wait_tensor`` is a ``wait_reduce_scatter`` at the place schedule_collectives gave it, taking
the packed buffer and the gradients (alive until then), its result viewed in the
reduce-scatter's shape. The values are the pair's; only the stream they are computed on moves
(NOTE: the reduce-scatter off the compute stream, in fsdp_compile/reduce_stream.py). Off CUDA
the graph is left as it is.
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp_compile.fx_utils import call, finish, inserting
from fsdp_compile.patterns import (
    PACK_AND_REDUCE_SCATTER,
    REDUCE_SCATTER,
    WAIT_REDUCE_SCATTER,
    is_pack_for_reduce_scatter,
    is_view,
    is_wait,
)
from fsdp_compile.plan import Plan

aten = torch.ops.aten


def _on_cuda(node: fx.Node) -> bool:
    return node.meta["val"].device.type == "cuda"


def _pack_of(reduce_scatter: fx.Node) -> fx.Node | None:
    """The pack ``reduce_scatter`` reduces, directly or through one view, when nothing else
    reads it."""
    source = reduce_scatter.args[0]
    pack = source.args[0] if is_view(source) and len(source.users) == 1 else source
    if is_pack_for_reduce_scatter(pack) and len(pack.users) == 1:
        return pack
    return None


def reduce_off_compute_stream(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """See the module docstring."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not REDUCE_SCATTER or not _on_cuda(node):
            continue
        pack = _pack_of(node)
        (wait,) = node.users
        if pack is None or not is_wait(wait):
            continue
        grads, world, *dtype = pack.args
        _, reduce_op, group_size, group_name = node.args
        assert world == group_size, f"{pack.name} packs for {world} ranks, {node.name} reduces over {group_size}"
        with inserting(graph, before=pack):
            fused = call(graph, PACK_AND_REDUCE_SCATTER, grads, reduce_op, group_size, group_name, *dtype)
        with inserting(graph, before=wait):
            waited = call(graph, WAIT_REDUCE_SCATTER, fused, grads, group_size)
            shaped = call(graph, aten.view.default, waited, list(node.meta["val"].shape))
        for old, new in ((node, fused), (wait, waited), (wait, shaped)):
            new.meta.update({k: v for k, v in old.meta.items() if k not in ("val", "eager_input_vals")})
        wait.replace_all_uses_with(shaped)
        for dead in (wait, node, *([node.args[0]] if node.args[0] is not pack else []), pack):
            graph.erase_node(dead)
    return finish(gm)


def check_reduce_off_compute_stream(gm: fx.GraphModule, plan: Plan) -> None:
    for node in gm.graph.nodes:
        if node.target is REDUCE_SCATTER and _on_cuda(node):
            assert _pack_of(node) is None, f"{node.name} still reduces a pack on the compute stream"
        if node.target is PACK_AND_REDUCE_SCATTER:
            (wait,) = node.users
            assert wait.target is WAIT_REDUCE_SCATTER, f"{node.name} is read by {wait.name}, not its wait"
            assert wait.args[1] == node.args[0], f"{wait.name} does not hold {node.name}'s gradients"
