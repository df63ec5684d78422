"""Pass (joint graph): tell the partitioner which gathered parameters to save or regather."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile.node_meta import PARAM_ID
from fsdp_compile.fx_utils import finish
from fsdp_compile.patterns import gathered_param_id, is_all_gather, is_split_gathered, is_view, is_wait
from fsdp_compile.plan import Plan

# The partitioner groups recompute decisions by activation-checkpoint region id; a large id
# keeps these tags apart from any torch.utils.checkpoint region in the user's model.
RESHARD_AC_GRAPH_ID = 100_000


@dataclass(frozen=True)
class GatherChain:
    """One forward gather of a parameter, as lowered."""

    param_id: int
    gather: tuple[fx.Node, ...]
    """[cast], [pad], all_gather, wait, [slice]."""
    unpack: tuple[fx.Node, ...]
    """A flat parameter's copy-out (its ``split_gathered``, the per-member reads and trims);
    empty for any other parameter."""
    gathered: tuple[fx.Node, ...]
    """The gathered parameter (the gather's last node), or a flat's gathered members."""
    views: tuple[fx.Node, ...]
    """Views of what was gathered (t, view, expand, ...): saving one saves its storage."""


def gather_chains(gm: fx.GraphModule) -> list[GatherChain]:
    """Every lowered parameter gather in ``gm`` (user collectives are not included)."""
    chains = []
    for node in gm.graph.nodes:
        param_id = node.meta.get(PARAM_ID)
        if not is_all_gather(node) or param_id is None:
            continue
        gather = [node]
        while gather[0].args[0].meta.get(PARAM_ID) == param_id:  # the cast and the pad
            gather.insert(0, gather[0].args[0])
        (wait,) = (u for u in node.users if is_wait(u))
        gather.append(wait)
        # The slice of the padding rows, which lower_collectives tags.
        gather.extend(u for u in wait.users if u.meta.get(PARAM_ID) == param_id and not is_split_gathered(u))
        unpack, gathered = _copies_of(gather[-1])
        chains.append(GatherChain(param_id, tuple(gather), tuple(unpack), tuple(gathered), _views_of(gathered)))
    return chains


def _copies_of(value: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """A gathered flat's copy-out (``split_gathered``, its per-member reads, their trims) and
    the members it yields; ([], [value]) for a value no copy-out reads."""
    unpack, members = [], []
    for split in (u for u in value.users if is_split_gathered(u)):
        unpack.append(split)
        for read in split.users:
            unpack.append(read)
            trims = [u for u in read.users if is_view(u) and len(read.users) == 1]
            unpack.extend(trims)
            members.append(trims[0] if trims else read)
    return (unpack, members) if unpack else ([], [value])


def _views_of(values: list[fx.Node]) -> tuple[fx.Node, ...]:
    """Every chain of single-input views hanging off ``values``."""
    views, frontier = [], [u for n in values for u in n.users]
    while frontier:
        current = frontier.pop()
        if is_view(current) and len(current.all_input_nodes) == 1:
            views.append(current)
            frontier.extend(current.users)
    return tuple(views)


def input_chains(gm: fx.GraphModule, plan: Plan) -> list[GatherChain]:
    """A repeated block's body: one chain per gathered weight it takes as an input (the plan's
    ``gathered_inputs``), with its copy-out and views."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    chains = []
    for index in plan.gathered_inputs:
        unpack, members = _copies_of(placeholders[index])
        chains.append(GatherChain(-1, (), tuple(unpack), tuple(members), _views_of(members)))
    return chains


def reshard(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards every forward gather carries a recompute tag from the plan.

    ``reshard_after_forward=True``: the gather chain (a flat parameter's copy-out included) and
    its views are ``MUST_RECOMPUTE``, so the partitioned forward returns no gathered parameter
    and the backward gathers again. ``False``: the gathered parameter (a flat's members) is
    ``MUST_SAVE``; the backward has no all-gather for it. In a repeated block's body every copy
    and view of a gathered weight input is ``MUST_RECOMPUTE``: the body saves the weight only
    as that input.
    """
    for chain in gather_chains(gm):
        if plan.param(chain.param_id).sharding.reshard_after_forward:
            tagged = {n: CheckpointPolicy.MUST_RECOMPUTE for n in chain.gather + chain.unpack + chain.views}
        else:
            tagged = {n: CheckpointPolicy.MUST_SAVE for n in chain.gathered}
        _tag(tagged)
    for chain in input_chains(gm, plan):
        # A body's weight is saved as the input it is (the slot its call hands back the
        # weights to, NOTE: one op per block call), never as a copy or a view of it.
        _tag({n: CheckpointPolicy.MUST_RECOMPUTE for n in chain.unpack + chain.views if n.op != "placeholder"})
    return finish(gm)


def _tag(tagged: dict) -> None:
    for node, policy in tagged.items():
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = RESHARD_AC_GRAPH_ID


def check_reshard(gm: fx.GraphModule, plan: Plan) -> None:
    for chain in gather_chains(gm):
        for node in chain.gathered:
            assert "recompute" in node.meta, f"untagged gather of param {chain.param_id}"


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
