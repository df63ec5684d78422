"""Pass (joint graph): a block call the backward recomputes keeps the random state it drew from."""

from __future__ import annotations

from torch import fx
from torch._functorch.partitioners import must_recompute
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile.block_call import RNG_STATE
from fsdp_compile.block_record import call_record
from fsdp_compile.fx_utils import call, finish, inserting
from fsdp_compile.patterns import is_block_forward, is_rng_state
from fsdp_compile.plan import Plan


def _draws_random(node: fx.Node) -> bool:
    """A block call that activation checkpointing may recompute, whose body draws random
    numbers (dropout): recomputed as it is, it would draw others than its forward did."""
    return is_block_forward(node) and must_recompute(node) and call_record(node.args[2]).traced.get("random", False)


def save_block_rng(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards every block call that the partitioner may recompute and whose body draws
    random numbers reads, as its ``rng_state``, the generators' state taken just before it
    (``fsdp_compile::rng_state``, tagged to be saved, never recomputed): the backward's
    recompute gets the state its forward started from (see ``replay_block_rng``).

    Whole-graph steps need nothing of ours here: AOTAutograd's partitioner replays the random
    ops it sees (``functionalize_rng_ops``). A block call is one opaque op to it, which it
    would rerun from whatever state the generators are in by then: other dropout masks in the
    backward than in the forward, so wrong gradients with the loss unchanged.
    """
    for node in [n for n in gm.graph.nodes if _draws_random(n)]:
        weights, tensors = node.args[0], node.args[1]
        with inserting(gm.graph, before=node):
            # The call's first input orders the read after whatever produced it.
            state = call(gm.graph, RNG_STATE, (*tensors, *weights)[0])
        state.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        state.meta["ac_graph_id"] = node.meta.get("ac_graph_id")
        node.kwargs = {**node.kwargs, "rng_state": state}
    return finish(gm)


def check_save_block_rng(gm: fx.GraphModule, plan: Plan) -> None:
    for node in gm.graph.nodes:
        if _draws_random(node):
            state = node.kwargs.get("rng_state")
            assert state is not None and is_rng_state(state), f"{node.name} recomputes without its forward's random state"
            assert state.meta.get("recompute") is CheckpointPolicy.MUST_SAVE, f"{state.name} is not saved"
