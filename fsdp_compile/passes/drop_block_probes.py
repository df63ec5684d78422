"""Pass (Dynamo graph): the fake-run probes of blocks traced inline leave no node behind."""

from __future__ import annotations

from torch import fx

from fsdp_compile.patterns import is_block_probe
from fsdp_compile.plan import Plan


def drop_block_probes(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no ``block_graded`` node is left. Each did its work while Dynamo traced it
    (its fake kernel's run of the block, see NOTE: parameters without a gradient, in
    fsdp_compile/block_fakes.py); its token is read by nobody, and Dynamo keeps custom-op
    calls whatever reads them."""
    probes = [n for n in gm.graph.nodes if is_block_probe(n)]
    if not probes:
        return gm
    for node in probes:
        assert not node.users, f"{node.name}'s token is read"
        gm.graph.erase_node(node)
    # Not fx_utils.finish: its dead-code elimination, run this early (before
    # dedupe_unshards), broke float8 with gradient accumulation (parameters 19% off after one
    # step; found by bisection, test_float8.py). This pass removes its probes and nothing else.
    gm.graph.lint()
    gm.recompile()
    return gm


def check_drop_block_probes(gm: fx.GraphModule, plan: Plan) -> None:
    left = [n.name for n in gm.graph.nodes if is_block_probe(n)]
    assert not left, f"block probes left: {left}"
