"""Pass (Dynamo graph): one ``unshard`` per parameter and grad mode."""

from __future__ import annotations

from typing import Iterator

from torch import fx

from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import grad_mode_set, is_unshard, marker_param_id
from fsdp_compile.plan import Plan


def dedupe_unshards(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards each ``param_id`` has one ``unshard`` node per grad mode it is read in: at
    most one read with grad enabled, whose gradient flows, and one without.

    A tied parameter (an embedding reused as the output head) or a module read twice is traced
    as one ``unshard`` per read. Keeping the first and rerouting the others means one gather in
    forward, and autograd sums the gradients of all reads before the single ``reduce_grad``:
    one reduce-scatter instead of one per read. A read under ``torch.no_grad()`` (a target
    computed by the model itself, an EMA) may take any earlier gather, but a read with grad
    enabled only one made with grad enabled: rerouted to a gather made under ``no_grad``, it
    would get a weight autograd does not track, and the parameter no gradient from it. The
    graph's mode before its first switch is taken as enabled, which never reroutes wrongly.
    """
    gathered: dict[bool, dict[int, fx.Node]] = {True: {}, False: {}}
    for node, grad_enabled in list(_unshards(gm)):
        param_id = marker_param_id(node)
        earlier = gathered[True].get(param_id) or (None if grad_enabled else gathered[False].get(param_id))
        if earlier is not None:
            node.replace_all_uses_with(earlier)
            gm.graph.erase_node(node)
        else:
            gathered[grad_enabled][param_id] = node
    return finish(gm)


def check_dedupe_unshards(gm: fx.GraphModule, plan: Plan) -> None:
    reads = [(marker_param_id(node), grad_enabled) for node, grad_enabled in _unshards(gm)]
    duplicated = {read for read in reads if reads.count(read) > 1}
    assert not duplicated, f"parameters gathered more than once in one grad mode: {sorted(duplicated)}"


def _unshards(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, bool]]:
    """Each ``unshard`` node with the grad mode it runs in (enabled before the first switch)."""
    grad_enabled = True
    for node in gm.graph.nodes:
        switched = grad_mode_set(node)
        if switched is not None:
            grad_enabled = switched
        elif is_unshard(node):
            yield node, grad_enabled
