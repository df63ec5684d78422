"""``torch.utils.checkpoint`` per block composes with sharding: no gathered parameter is kept
from forward to backward across a checkpointed block. Parity, compiled and uncompiled, with
dropout, is the matrix's ``activation_checkpointing`` cell on every layout (tests/test_matrix.py)."""

from __future__ import annotations

import pytest

from fsdp_compile import fully_shard
from fsdp_compile.testing.models import TransformerConfig
from fsdp_compile.passes import saved_gathered_params
from fsdp_compile.patterns import count_collectives
from harness import build_model, compile_one_step, fake_process_group

CHECKPOINTED = TransformerConfig(checkpoint_blocks=True)


@pytest.mark.structure
@pytest.mark.parametrize("world", [8, 64])
def test_no_gathered_parameter_is_saved_across_a_checkpointed_block(world):
    """ZeRO-3 with checkpointed blocks: the forward returns no gathered block parameter (nor a
    view of one) for backward, the backward gathers what it recomputes, and only the shards,
    the block inputs and the root's kept parameters (NOTE: the reshard default) cross from
    forward to backward."""
    with fake_process_group(world):
        graph = compile_one_step(fully_shard(build_model(CHECKPOINTED)), CHECKPOINTED)
    kept = {p.param_id for p in graph.plan.params if not p.sharding.reshard_after_forward}
    assert {graph.plan.param(i).fqn for i in kept} == {"embed.weight", "pos", "norm.weight"}
    assert set(saved_gathered_params(graph.forward)) <= kept
    # Each recomputed block gathers its bucket again.
    assert count_collectives(graph.backward.graph)["all_gather"] >= CHECKPOINTED.n_layers
