"""Pass (Dynamo graph): the fake-run probes of blocks traced inline, and of block calls given
float8 weights, leave no node behind."""

from __future__ import annotations

from torch import fx

from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import is_block_probe
from fsdp_compile.plan import Plan


def drop_block_probes(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no ``block_graded`` node is left. Each did its work while Dynamo traced it
    (its fake kernel's run of the block, see NOTE: parameters without a gradient, in
    fsdp_compile/block_fakes.py, and NOTE: float8 weights in a block call, in
    fsdp_compile/block_call.py); its token is read by nobody, and Dynamo keeps custom-op
    calls whatever reads them."""
    probes = [n for n in gm.graph.nodes if is_block_probe(n)]
    if not probes:
        return gm
    for node in probes:
        assert not node.users, f"{node.name}'s token is read"
        gm.graph.erase_node(node)
    return finish(gm)


def check_drop_block_probes(gm: fx.GraphModule, plan: Plan) -> None:
    left = [n.name for n in gm.graph.nodes if is_block_probe(n)]
    assert not left, f"block probes left: {left}"
