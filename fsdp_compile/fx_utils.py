"""Small FX helpers the passes share: inserting ops with fake values, walking chains."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import fx
from torch.utils._pytree import tree_leaves, tree_map

from fsdp_compile.patterns import is_ours


def _val(arg: Any) -> Any:
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


def call(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insert point, with ``meta["val"]``
    filled.

    Later stages (the min-cut partitioner, Inductor) read sizes and dtypes from
    ``meta["val"]``, so every node a pass adds carries one, computed under the fake mode of its
    inputs.
    """
    node = graph.call_function(target, args, kwargs)
    vals, kwvals = tree_map(_val, (args, kwargs))
    fake_mode = next(
        (v.fake_mode for v in tree_leaves(vals) if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode")),
        None,
    )
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*vals, **kwvals)
    return node


@contextlib.contextmanager
def inserting(graph: fx.Graph, *, before: fx.Node | None = None, after: fx.Node | None = None) -> Iterator[list[fx.Node]]:
    """``graph.inserting_before(before)`` or ``graph.inserting_after(after)``; the list it
    yields holds, once the block exits, every node inserted there.

    The new nodes are read off the insertion point's neighbours rather than by comparing the
    graph's node set before and after, which costs the whole graph per insertion: a pass that
    lowers every marker that way was quadratic in depth (1.0 s at 32 layers, 4.5 s at 96).
    """
    assert (before is None) != (after is None), "insert before a node or after one"
    start, stop = (before.prev, before) if before is not None else (after, after.next)
    inserted: list[fx.Node] = []
    with graph.inserting_before(before) if before is not None else graph.inserting_after(after):
        yield inserted
    node = start.next
    while node is not stop:
        inserted.append(node)
        node = node.next


def inline_traced(graph: fx.Graph, fn, *nodes: fx.Node) -> fx.Node:
    """``fn`` traced (``make_fx``, with Inductor's decompositions: the passes run after
    AOTAutograd's) on the nodes' fake values, its ops copied in at ``graph``'s insert point;
    the node of its single result. For arithmetic a library defines, rather than spelling
    its ops by hand."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    vals = [n.meta["val"] for n in nodes]
    with detect_fake_mode(vals):
        traced = make_fx(fn, decomposition_table=select_decomp_table())(*vals)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    return graph.graph_copy(traced.graph, dict(zip(placeholders, nodes)))


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """Every pass ends here: drop the dead nodes a pass made, check the graph, regenerate code.

    NOTE: nothing the user wrote is removed
        FX's ``eliminate_dead_code`` keeps only nodes it can prove impure, and it cannot for
        Dynamo's ``call_method`` nodes: ``h.mul_(0.5)`` or ``self.ema.mul_(0.9)`` with no
        user looks dead and was silently dropped (wrong numbers, no error). So a pass removes
        only what it created itself (nodes tagged as ours, fsdp_compile.patterns.is_ours) and
        only when their op is pure; the user's nodes, used or not, always stay. Later stages
        (AOTAutograd's functionalization, Inductor) see mutations explicitly and clean up
        what is truly dead themselves.

        Not FX's ``eliminate_dead_code`` with a predicate either: it runs itself again on every
        subgraph (an ``autograd.Function``'s forward and backward, a checkpointed region's
        body) without the predicate (torch 2.11 to 2.13), and dropped the user's in-place ops
        there: HF PhiMoE's router lost the ``scatter_add_`` of its custom backward, a
        checkpointed ``h.mul_(0.5)`` never ran. Passes insert nodes into the top graph only,
        so only it is swept.
    """
    graph = gm.graph
    graph.lint()
    for node in reversed(graph.nodes):
        if not node.users and is_ours(node) and not node.is_impure():
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
