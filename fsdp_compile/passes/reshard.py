"""Pass (joint graph): tell the partitioner which gathered parameters to save or regather."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import gathered_param_id, is_all_gather, is_view, is_wait
from fsdp_compile.plan import Plan

# The partitioner groups recompute decisions by activation-checkpoint region id; a large id
# keeps these tags apart from any torch.utils.checkpoint region in the user's model.
RESHARD_AC_GRAPH_ID = 100_000


@dataclass(frozen=True)
class GatherChain:
    """One forward gather of a parameter, as lowered."""

    param_id: int
    gather: tuple[fx.Node, ...]
    """[cast], [pad], all_gather, wait, [slice]: the last one is the gathered parameter."""
    views: tuple[fx.Node, ...]
    """Views of the gathered parameter (t, view, expand, ...): saving one saves its storage."""


def gather_chains(gm: fx.GraphModule) -> list[GatherChain]:
    """Every lowered parameter gather in ``gm`` (user collectives are not included)."""
    chains = []
    for node in gm.graph.nodes:
        param_id = node.meta.get("mfsdp_param_id")
        if not is_all_gather(node) or param_id is None:
            continue
        gather = [node]
        while gather[0].args[0].meta.get("mfsdp_param_id") == param_id:  # the cast and the pad
            gather.insert(0, gather[0].args[0])
        (wait,) = (u for u in node.users if is_wait(u))
        gather.append(wait)
        slices = [u for u in wait.users if u.meta.get("mfsdp_param_id") == param_id]
        gather.extend(slices)
        views, frontier = [], list(gather[-1].users)
        while frontier:
            current = frontier.pop()
            if is_view(current) and len(current.all_input_nodes) == 1:
                views.append(current)
                frontier.extend(current.users)
        chains.append(GatherChain(param_id, tuple(gather), tuple(views)))
    return chains


def reshard(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards every forward gather carries a recompute tag from the plan.

    ``reshard_after_forward=True``: the gather chain and its views are ``MUST_RECOMPUTE``, so the
    partitioned forward returns no gathered parameter and the backward gathers again.
    ``False``: the gathered parameter is ``MUST_SAVE``; the backward has no all-gather for it.
    """
    for chain in gather_chains(gm):
        if plan.param(chain.param_id).sharding.reshard_after_forward:
            tagged = {n: CheckpointPolicy.MUST_RECOMPUTE for n in chain.gather + chain.views}
        else:
            tagged = {chain.gather[-1]: CheckpointPolicy.MUST_SAVE}
        for node, policy in tagged.items():
            node.meta["recompute"] = policy
            node.meta["ac_graph_id"] = RESHARD_AC_GRAPH_ID
    return finish(gm)


def check_reshard(gm: fx.GraphModule, plan: Plan) -> None:
    for chain in gather_chains(gm):
        assert "recompute" in chain.gather[-1].meta, f"untagged gather of param {chain.param_id}"


def saved_gathered_params(forward: fx.GraphModule) -> list[int]:
    """``param_id`` of every gathered parameter the partitioned forward returns for backward.

    Empty for resharded parameters: that is what ``reshard_after_forward=True`` promises.
    Follows views back to the gather (or the bucket's copy-out), since a saved view keeps the
    whole gathered storage.
    """
    (output,) = (n for n in forward.graph.nodes if n.op == "output")
    saved = set()
    for node in output.all_input_nodes:
        while gathered_param_id(node) is None and is_view(node):
            node = node.all_input_nodes[0]
        if gathered_param_id(node) is not None:
            saved.add(gathered_param_id(node))
    return sorted(saved)
