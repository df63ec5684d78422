"""Pass (Dynamo graph, only with ``options={"regional": False}``): one whole graph again."""

from __future__ import annotations

from torch import fx

from fsdp_compile.compat import inline_invoke_subgraph
from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import is_body_call
from fsdp_compile.plan import Plan


def inline_regions(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no ``invoke_subgraph`` is left: each repeated block's body is copied into the
    graph at each of its calls (torch's own inlining), so the compiler sees the whole model as
    one graph and may fuse across blocks, at the price of compiling every layer (see NOTE: one
    body per repeated block, in fsdp_compile/regions.py)."""
    return finish(inline_invoke_subgraph(gm))


def check_inline_regions(gm: fx.GraphModule, plan: Plan) -> None:
    left = [n.name for n in gm.graph.nodes if is_body_call(n)]
    assert not left, f"repeated-block bodies still called: {left}"
