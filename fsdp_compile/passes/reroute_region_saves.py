"""Pass (joint graph): a block body never saves a gathered parameter for backward.

Within a repeated block's body (NOTE: one body per repeated block, in fsdp_compile/regions.py)
AOTAutograd's partitioner saves the body's inputs that its backward reads, the gathered
weights among them: they come back out of the forward call as extra outputs and go into the
backward call. In the outer graph those outputs look like ordinary saved activations, so the
gathered weights would stay alive from forward to backward whatever ``reshard`` tags.
"""

from __future__ import annotations

import operator

from torch import fx

from fsdp_compile.fx_utils import call, finish
from fsdp_compile.patterns import is_body_call, is_view
from fsdp_compile.plan import Plan


def _forward_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_body_call(n) and str(n.args[1]).startswith("partitioned_fw")]


def _input_view(output: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """The body placeholder ``output`` is, or is a chain of single-input views of, and that
    chain (innermost first); (None, []) for anything the body computed."""
    chain = []
    while is_view(output) and len(output.all_input_nodes) == 1:
        chain.insert(0, output)
        output = output.all_input_nodes[0]
    return (output, chain) if output.op == "placeholder" else (None, [])


def reroute_region_saves(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no output of a body's forward call that merely returns one of its inputs (or
    a view of one) is read: each reader takes the outer value that went in, with the views
    replayed in the outer graph. The value is the same tensor, so nothing changes numerically,
    and ``reshard`` can now tag a gathered weight's whole chain for recomputation: the
    backward gathers it again instead of keeping it."""
    for forward in _forward_calls(gm):
        body = getattr(gm, forward.args[0].target)
        placeholders = list(body.graph.find_nodes(op="placeholder"))
        (body_output,) = body.graph.find_nodes(op="output")
        for getitem in [u for u in forward.users if u.target is operator.getitem]:
            source, chain = _input_view(body_output.args[0][getitem.args[1]])
            if source is None:
                continue
            value = forward.args[2 + placeholders.index(source)]
            with gm.graph.inserting_before(getitem):
                for view in chain:
                    value = call(gm.graph, view.target, value, *view.args[1:])
            getitem.replace_all_uses_with(value)
            gm.graph.erase_node(getitem)  # a tuple read: pure
    return finish(gm)


def check_reroute_region_saves(gm: fx.GraphModule, plan: Plan) -> None:
    for forward in _forward_calls(gm):
        body = getattr(gm, forward.args[0].target)
        (body_output,) = body.graph.find_nodes(op="output")
        read = [u.args[1] for u in forward.users if u.target is operator.getitem]
        passed = [i for i in read if _input_view(body_output.args[0][i])[0] is not None]
        assert not passed, f"{forward.name}: outputs {passed} only return a body input and are still read"
