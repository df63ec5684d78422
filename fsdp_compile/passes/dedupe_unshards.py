"""Pass (Dynamo graph): one ``unshard`` per parameter."""

from __future__ import annotations

from torch import fx

from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import is_unshard, marker_param_id
from fsdp_compile.plan import Plan


def dedupe_unshards(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards each ``param_id`` has exactly one ``unshard`` node in the graph.

    A tied parameter (an embedding reused as the output head) or a module read twice is traced
    as one ``unshard`` per read. Keeping the first and rerouting the others means one gather in
    forward, and autograd sums the gradients of all reads before the single ``reduce_grad``:
    one reduce-scatter instead of one per read.
    """
    first: dict[int, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not is_unshard(node):
            continue
        param_id = marker_param_id(node)
        if param_id in first:
            node.replace_all_uses_with(first[param_id])
            gm.graph.erase_node(node)
        else:
            first[param_id] = node
    return finish(gm)


def check_dedupe_unshards(gm: fx.GraphModule, plan: Plan) -> None:
    ids = [marker_param_id(n) for n in gm.graph.nodes if is_unshard(n)]
    duplicated = {i for i in ids if ids.count(i) > 1}
    assert not duplicated, f"parameters gathered more than once: {sorted(duplicated)}"
