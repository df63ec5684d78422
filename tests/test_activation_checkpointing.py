"""``torch.utils.checkpoint`` per block composes with sharding: no gathered parameter is kept
from forward to backward across a checkpointed block, nor any activation inside one. Parity, compiled and uncompiled, with
dropout, is the matrix's ``activation_checkpointing`` cell on every layout (tests/test_matrix.py)."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.block_call import BLOCK_FORWARD
from fsdp_compile.testing.models import TransformerConfig, loss_fn, make_batch
from fsdp_compile.passes import saved_gathered_params
from fsdp_compile.patterns import count_collectives
from harness import (
    TOLERANCE, GatedStack, assert_gradients_match, build_model, compile_one_step, counting_aot_eager,
    fake_process_group, full_parameters, give_up_after_a_failing_forward, max_param_error, one_rank_group,
    shard_and_compile_each_block, sync_off_then_on, tiny_hf_llama, train_accumulating,
)

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


def _saved_after_forward(cfg: TransformerConfig) -> tuple[int, int, MfsdpBackend]:
    """Bytes autograd saved in one compiled forward still alive when it returns, the body
    calls' graphs waiting for a backward then, and the backend after the backward ran."""
    saved = []

    def pack(tensor):
        saved.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
        return tensor

    model = fully_shard(build_model(cfg))
    backend = MfsdpBackend(compiler="eager")
    tokens, targets = make_batch(cfg, 2, 32, 0, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_fn(torch.compile(model, backend=backend)(tokens), targets)
    gc.collect()
    alive, waiting = sum(size for ref, size in saved if ref() is not None), len(backend.pending)
    loss.backward()
    return alive, waiting, backend


@pytest.mark.structure
def test_a_checkpointed_block_keeps_no_activation_from_forward_to_backward():
    """A block call the backward recomputes keeps none of its body's autograd graph past the
    forward (its ``differentiated=False``); it held every activation inside the blocks until
    a later sweep, so checkpointing saved no memory. The recompute in the backward keeps
    its graph for its backward call, which takes it."""
    with one_rank_group():
        checkpointed, waiting, backend = _saved_after_forward(CHECKPOINTED)
        plain, plain_waiting, _ = _saved_after_forward(TransformerConfig())
    (graph,) = backend.graphs
    calls = {gm: [n.kwargs.get("differentiated", True) for n in gm.graph.nodes if n.target is BLOCK_FORWARD] for gm in (graph.forward, graph.backward)}
    assert calls[graph.forward] == [False] * CHECKPOINTED.n_layers and calls[graph.backward] == [True] * CHECKPOINTED.n_layers, calls
    assert waiting == 0 and len(backend.pending) == 0 and plain_waiting == CHECKPOINTED.n_layers
    # Saved and alive without checkpointing: the blocks' activations, the shards, the inputs.
    assert checkpointed < plain / 2, (checkpointed, plain)


@pytest.mark.structure
@pytest.mark.parametrize("one_of_a_kind", [False, True], ids=["repeated", "one_of_a_kind"])
@pytest.mark.parametrize("compiled", ["each_block", "users_function"])
def test_blocks_compiled_by_another_backend_inside_a_checkpoint_accumulate_as_eagerly(compiled, one_of_a_kind):
    """FSDP2's habits: each block compiled on its own (``layer.compile()``), or a function of
    the user's around the model compiled, with blocks called through ``torch.utils.checkpoint``
    (non-reentrant), sync off for the first micro-batch. The recompute of a block's frame
    traced a graph that saved other tensors ("A different number of tensors was saved"):
    the forward's read had taken the accumulated sum and the recompute's found none. No read
    traced for another backend takes one now; sync on reduces the sums at once (repeated
    blocks' and a block of its own kind's). A sequence whose last forward raises is given up
    by ``reset_iter_state()`` (every ``.grad`` None again); the restarted one's gradients
    equal the unsharded model's (one gloo rank)."""
    torch.manual_seed(0)
    reference = GatedStack(checkpointed=True, one_of_a_kind=one_of_a_kind)
    model = copy.deepcopy(reference)
    micros = torch.randn(2, 2, 8, 16, generator=torch.Generator().manual_seed(1))
    with one_rank_group(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-weight gathers are said
        shard_and_compile_each_block(model, compile_blocks=compiled == "each_block")
        forward = model if compiled == "each_block" else torch.compile(lambda h: model(h), backend="aot_eager")
        give_up_after_a_failing_forward(model, forward, micros[0], micros[1])
        grads = sync_off_then_on(model, reference, micros, forward=forward)
    assert_gradients_match(grads, reference)


@pytest.mark.structure
def test_blocks_compiled_one_by_one_under_hf_gradient_checkpointing_train_as_eagerly():
    """HF's ``gradient_checkpointing_enable()`` with each Llama layer compiled on its own, as
    FSDP2 users run it. The checkpointed layer recomputes SDPA, a random op on the CPU, so its
    graph saves the RNG state beside the mesh its parameters' ``to_local`` saves; torch 2.13's
    partitioner put the state where the runtime takes the mesh, and the first forward failed
    ("expected all tensors_saved_with_vc_check to be Tensors"; compat.py). Two steps of two
    micro-batches match the unsharded model, one compile serving every layer (one gloo rank)."""
    pytest.importorskip("transformers")
    reference = tiny_hf_llama(3)
    model = copy.deepcopy(reference)
    compiled = []
    counting = counting_aot_eager(compiled)  # one compiler object: Dynamo keys its cache on it
    batches = torch.randint(0, 64, (2, 2, 2, 12), generator=torch.Generator().manual_seed(1))
    with one_rank_group(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-weight gathers are said
        fully_shard(model)
        for net in (model, reference):
            net.gradient_checkpointing_enable()
        for layer in model.model.layers:
            layer.compile(backend=counting)
        for net in (model, reference):
            train_accumulating(net, batches, sharded=net is model)
        expected = {n: p.detach() for n, p in reference.named_parameters()}
        error, name = max_param_error(full_parameters(model), expected)
    assert len(compiled) == 2, len(compiled)  # without sync, with it
    assert error < TOLERANCE, (error, name)

