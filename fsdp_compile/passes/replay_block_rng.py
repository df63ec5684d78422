"""Pass (partitioned graphs): a block call recomputed in the backward replays its forward's random state."""

from __future__ import annotations

from torch import fx

from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import is_block_forward
from fsdp_compile.plan import Plan


def _recomputes(node: fx.Node) -> bool:
    """A block call whose random state the graph receives rather than reads: the partitioner
    saved the state for it, so it is the backward's recompute of a forward call."""
    state = node.kwargs.get("rng_state") if is_block_forward(node) else None
    return isinstance(state, fx.Node) and state.op == "placeholder"


def replay_block_rng(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards exactly the block calls that get their ``rng_state`` from the forward (a
    recompute, see ``save_block_rng``) ``replay`` it: they draw the forward's random numbers and
    leave the generators as they found them, as ``torch.utils.checkpoint`` does. The forward's
    calls draw from the generators as they are, so a state read early could not repeat one
    layer's numbers in another.
    """
    for node in gm.graph.nodes:
        if _recomputes(node):
            node.kwargs = {**node.kwargs, "replay": True}
    return finish(gm)


def check_replay_block_rng(gm: fx.GraphModule, plan: Plan) -> None:
    for node in gm.graph.nodes:
        if is_block_forward(node):
            assert node.kwargs.get("replay", False) == _recomputes(node), f"{node.name} replays wrongly"
