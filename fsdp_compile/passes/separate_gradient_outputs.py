"""Pass (partitioned backward): no two gradients the backward returns share their elements."""

from __future__ import annotations

import torch
from torch import fx

from fsdp_compile.fx_utils import call, finish
from fsdp_compile.patterns import is_view
from fsdp_compile.plan import Plan


def _is_backward(gm: fx.GraphModule) -> bool:
    # AOTAutograd names the backward's gradient inputs so; a forward or inference graph has none.
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)


def _root(node: fx.Node) -> fx.Node:
    """The node whose elements ``node`` is: itself, or what the view ops it is made by read."""
    while is_view(node):
        node = node.args[0]
    return node


def _shared_outputs(gm: fx.GraphModule) -> list[tuple[int, fx.Node]]:
    """Each tensor output (position, node) made of the same elements as an earlier one."""
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    seen: set[fx.Node] = set()
    shared = []
    for at, arg in enumerate(output.args[0]):
        if not isinstance(arg, fx.Node) or not isinstance(arg.meta.get("val"), torch.Tensor):
            continue
        root = _root(arg)
        if root in seen:
            shared.append((at, arg))
        seen.add(root)
    return shared


def separate_gradient_outputs(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no two tensor outputs of a backward graph are the same elements (one node,
    or views of one node): each parameter's gradient is a tensor of its own.

    The partitioner's common-subexpression elimination merges two parameters' gradients that
    are computed alike (a Linear's bias and a second bias added to its output), and the
    reductions lowered from their markers with them, so both outputs were views of one
    reduced shard. Each becomes its parameter's DTensor gradient, and autograd keeps a
    gradient no other tensor references as ``.grad`` without a copy: the two ``.grad`` were
    one tensor, so ``clip_grad_norm_`` scaled it twice and a second backward added to both.
    The later output is cloned (one shard-sized copy, only where gradients were merged).
    Forward and inference graphs are left as they are: their aliased outputs are the user's,
    which AOTAutograd replays.
    """
    shared = _shared_outputs(gm) if _is_backward(gm) else []
    if not shared:
        return gm
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    with gm.graph.inserting_before(output):
        for at, node in shared:
            outputs[at] = call(gm.graph, torch.ops.aten.clone.default, node)
    output.args = (tuple(outputs), *output.args[1:])
    return finish(gm)


def check_separate_gradient_outputs(gm: fx.GraphModule, plan: Plan) -> None:
    if _is_backward(gm):
        assert not _shared_outputs(gm), f"gradient outputs share elements: {_shared_outputs(gm)}"
