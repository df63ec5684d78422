"""Inductor for the repeated blocks' bodies only; the graph around them runs as its own Python.

NOTE: what Inductor compiles
    With ``regional=True`` (the default) and ``compile_outside_blocks=False`` a graph
    holding repeated blocks is compiled as torch's regional compilation intends: Inductor
    compiles each block's body once, and what lies outside the blocks (the embedding, the
    final norm, the head, the loss, and every collective with its bucket copies) runs as the
    partitioned graph's own Python code, ATen call by ATen call, as FSDP2 runs the root of a
    model whose blocks are compiled. The schedule our passes planned is then the order
    things run in.

    Why not hand the outer graph to Inductor as well (``compile_outside_blocks=True``, the
    default until a GPU measures this path's step time, does): Inductor costs time per node,
    and the outer graph holds every layer's collectives, copies, body calls and their
    outputs, so its lowering and code generation grow with depth while the bodies' do not.
    What the outer graph loses is the fusion of the code outside the blocks, and the
    AOTAutograd cache, which stores only graphs Inductor compiled whole: a restart traces
    again and loads the bodies from Inductor's cache.

    A body is compiled the way torch's own regional path compiles one
    (``torch._higher_order_ops.invoke_subgraph.invoke_subgraph_inductor_compile``): under a
    tracing context of its own, so the output strides it records do not land in the outer
    graph's, with every output kept at its traced layout (the forward body's saved values
    enter the backward body, which was traced with those layouts). Unlike that function,
    the backward body is compiled as a backward (``is_backward``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch._functorch.aot_autograd import make_boxed_func

from fsdp_compile.patterns import is_body_call

__all__ = ["compile_bodies", "holds_bodies"]


def holds_bodies(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls a repeated block's body (see NOTE: one body per repeated block, in
    fsdp_compile/regions.py)."""
    return any(is_body_call(node) for node in gm.graph.nodes)


def _value(arg: Any) -> Any:
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


def _compile_body(body: fx.GraphModule, call: fx.Node, **kwargs: Any) -> Callable[..., Any]:
    """``body`` compiled by Inductor for the operands of ``call``, as a function of them."""
    from torch._inductor.compile_fx import compile_fx_inner

    output = body.graph.output_node()
    output.meta["user_visible_output_idxs"] = [
        i for i, value in enumerate(output.args[0]) if isinstance(value, fx.Node)
    ]
    outer = torch._guards.TracingContext.get()
    with torch._guards.tracing(torch._guards.TracingContext(outer.fake_mode)):
        compiled = compile_fx_inner(body, [_value(a) for a in call.args[2:]], **kwargs)

    def run(*operands: Any) -> Any:
        return compiled(list(operands))  # Inductor's calling convention: one list

    run.__name__ = f"compiled_{call.args[0].target}"
    return run


def compile_bodies(gm: fx.GraphModule, example_inputs: Sequence[object], **kwargs: Any) -> Callable[..., Any]:
    """A partitioned graph made runnable: each repeated block's body compiled by Inductor once
    for all its calls, everything else run as the graph's Python (see NOTE: what Inductor
    compiles). ``gm`` itself is left as it is, body calls included, for inspection; what runs
    is a copy. ``kwargs`` are Inductor's (``is_backward``, ``is_inference``...); a graph that
    holds no body call after all (AOTAutograd inlined them) is compiled whole."""
    if not holds_bodies(gm):
        from torch._inductor.compile_fx import compile_fx_inner

        return compile_fx_inner(gm, example_inputs, **kwargs)
    graph = fx.Graph()
    graph.set_codegen(gm.graph._codegen)
    graph.output(graph.graph_copy(gm.graph, {}))
    calls: dict[str, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if is_body_call(node):
            calls[node.args[0].target].append(node)
    flags = {k: bool(kwargs.get(k)) for k in ("is_backward", "is_inference")}
    for name, nodes in calls.items():
        compiled = _compile_body(getattr(gm, name), nodes[0], **flags)
        for node in nodes:
            body = node.args[0]
            node.target, node.args = compiled, node.args[2:]
            if not body.users:
                graph.erase_node(body)
    return make_boxed_func(fx.GraphModule(gm, graph).forward)
