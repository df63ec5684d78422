"""Nothing lost with torchtitan's habits: how FSDP2's own users write and feed their layers.

torchtitan keeps its layers in an ``nn.ModuleDict`` keyed "0", "1", ..., hands every layer a
complex rotary buffer with keyword arguments that are None, wraps each layer in torch's
``checkpoint_wrapper`` for activation checkpointing (whole, or selective by op), and builds
on the meta device, then ``to_empty`` and ``init_weights`` (``fsdp_compile.testing.titan``).
Before, only the layers of an ``nn.ModuleList`` or ``nn.Sequential`` were repeated blocks: a
ModuleDict's were traced inline in the step, every layer's ops compiled again, with nothing
said.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from dataclasses import replace

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.block_call import BLOCK_FORWARD
from fsdp_compile.testing.models import loss_fn
from fsdp_compile.testing.titan import TitanConfig, Transformer, checkpoint_layers
from harness import fake_process_group, one_rank_group

CFG = TitanConfig()
STEPS = 3


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The next token's cross-entropy (torchtitan's training loss)."""
    return loss_fn(logits, tokens.roll(-1, 1))


def _built(how: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The unsharded reference and the sharded model, with equal weights."""
    torch.manual_seed(0)
    reference = Transformer(CFG)
    if how == "meta_init":
        with torch.device("meta"):
            model = Transformer(CFG)
        fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        assert torch.equal(model.freqs_cis, reference.freqs_cis)
        # DTensors draw their own random streams: the reference takes the weights drawn.
        reference.load_state_dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
        return reference, model
    model = copy.deepcopy(reference)
    if how == "titan_units":  # torchtitan's apply_fsdp: the norm and the output one unit
        fully_shard(model.tok_embeddings)
        for layer in model.layers.values():
            fully_shard(layer)
        assert fully_shard(grouped := [model.norm, model.output], reshard_after_forward=False) is grouped
    elif how == "offload_wrapper":  # torch's activation offloading, the checkpoint wrapper's sibling
        for key, layer in model.layers.named_children():
            model.layers.register_module(key, offload_wrapper(layer))
    elif how not in ("plain", "titan_units"):
        for layers in (reference, model):
            checkpoint_layers(layers, selective=how == "selective_checkpoint")
    return reference, fully_shard(model)


def _train_at_eager_s_results(reference: torch.nn.Module, model: torch.nn.Module, step) -> None:
    """Three AdamW steps of ``step`` (the sharded ``model``, compiled or not) give the
    unsharded reference's losses and gradients bit for bit."""
    tokens = torch.randint(0, CFG.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    for _ in range(STEPS):
        expected, loss = _loss(reference(tokens), tokens), _loss(step(tokens), tokens)
        expected.backward()
        loss.backward()
        assert torch.equal(loss, expected)
        for (name, want), got in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(got.grad.full_tensor(), want.grad), name
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.structure
@pytest.mark.parametrize(
    "how", ["plain", "titan_units", "checkpoint_wrapper", "selective_checkpoint", "offload_wrapper", "meta_init"]
)
def test_layers_in_a_module_dict_are_one_body_called_per_layer_at_eager_s_results(how):
    """Each layer of the ModuleDict is one block call of one body compiled once (its SDPA in
    the body, none in the step), the step one graph with nothing said, and three AdamW steps
    give eager's losses and gradients bit for bit (one gloo rank). Before: no block call, the
    three layers' ops traced into the step. Sharded as torchtitan shards it, the norm and the
    output one unit (``fully_shard([model.norm, model.output], reshard_after_forward=False)``,
    refused before as not a module), their weights are one bucket, kept from the forward to
    the backward."""
    with one_rank_group(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        reference, model = _built(how)
        backend = MfsdpBackend(compiler="eager")
        step = torch.compile(model, backend=backend)
        _train_at_eager_s_results(reference, model, step)
    assert not [str(w.message) for w in said if any(word in str(w.message) for word in ("inline", "graph", "repeated"))]
    (graph,) = backend.graphs
    step_ops = [n.target for n in graph.forward.graph.nodes if n.op == "call_function"]
    assert step_ops.count(BLOCK_FORWARD) == CFG.n_layers
    assert not [t for t in step_ops if "scaled_dot_product" in str(t)]
    assert [len(bodies) for bodies in backend.bodies.values()] == [1]
    if how == "titan_units":
        names = {p.param_id: p.fqn for p in graph.plan.params}
        (bucket,) = [b for b in graph.plan.buckets if any(names[i] == "norm.weight" for i in b.param_ids)]
        assert sorted(names[i] for i in bucket.param_ids) == ["norm.weight", "output.weight"]
        assert not bucket.reshard_after_forward


@pytest.mark.structure
@pytest.mark.parametrize("how", ["checkpoint_wrapper", "selective_checkpoint"])
def test_checkpointed_layers_run_uncompiled_at_eager_s_results(how):
    """Uncompiled, each checkpointed layer gathers its weights inside the checkpoint, in the
    forward and again in the recompute: three AdamW steps give eager's losses and gradients
    bit for bit (one gloo rank). Before, the wrapper was the block and gathered before its
    checkpoint began, and the selective checkpoint's recompute met gathers the forward never
    ran: "unshard.default encountered during backward but not found in storage"."""
    with one_rank_group():
        reference, model = _built(how)
        _train_at_eager_s_results(reference, model, model)


def _saved_after_forward(wrapped: bool, compiled: bool) -> int:
    """Bytes of storage that what autograd saved in one forward holds when it returns (each
    storage once: a weight freed after its use keeps none), one rank of a fake world of 8."""
    saved = []

    def pack(tensor):
        saved.append(weakref.ref(tensor))
        return tensor

    torch.manual_seed(0)
    model = Transformer(replace(CFG, max_seq=128))
    if wrapped:
        checkpoint_layers(model)
    fully_shard(model)
    step = torch.compile(model, backend=MfsdpBackend(compiler="eager")) if compiled else model
    tokens = torch.randint(0, CFG.vocab, (4, 128), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = _loss(step(tokens), tokens)
    gc.collect()
    storages = {s.data_ptr(): s.nbytes() for s in (ref().untyped_storage() for ref in saved if ref() is not None)}
    loss.backward()
    return sum(storages.values())


@pytest.mark.structure
def test_checkpoint_wrapper_s_layers_keep_no_more_past_the_forward_than_eagerly():
    """The module torch's ``checkpoint_wrapper`` runs is the block: the checkpoint runs around
    its call in the step's graph and recomputes it in the backward, so the compiled forward
    keeps no more than the sharded model run eagerly (measured 0.41 MB against 0.76 MB;
    4.3 MB unwrapped)."""
    with fake_process_group(8):
        compiled, eager = _saved_after_forward(True, True), _saved_after_forward(True, False)
        unwrapped = _saved_after_forward(False, True)
    assert compiled <= eager and compiled < unwrapped / 4, (compiled, eager, unwrapped)


@pytest.mark.structure
@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "mfsdp"])
def test_gradient_sync_set_on_one_module_of_a_unit_sets_it_for_the_unit(compiled):
    """``fully_shard([model.norm, model.output])`` makes one unit, whose gradient-sync flag
    FSDP2 keeps for the group: sync turned off on the model, then on for ``norm`` alone,
    left ``output`` summing without sync for ever (its ``.grad`` None at every step: a helper
    found it never trained), and off for ``norm`` alone still reduced ``output``'s. Either
    call now sets it for the unit: both weights get the unsharded model's sum of the two
    micro-batches (one gloo rank), and neither gets a ``.grad`` while sync is off."""
    with one_rank_group():
        reference, model = _built("titan_units")
        step = torch.compile(model, backend=MfsdpBackend(compiler="eager")) if compiled else model
        tokens = torch.randint(0, CFG.vocab, (2, 2, 16), generator=torch.Generator().manual_seed(0))
        model.norm.set_requires_gradient_sync(False)
        _loss(step(tokens[0]), tokens[0]).backward()
        assert model.output.weight.grad is None and model.norm.weight.grad is None
        model.set_requires_gradient_sync(False)
        model.norm.set_requires_gradient_sync(True)
        _loss(step(tokens[1]), tokens[1]).backward()
        for micro in tokens:
            _loss(reference(micro), micro).backward()
        for name in ("norm.weight", "output.weight"):
            got = model.get_parameter(name).grad
            assert got is not None, name
            torch.testing.assert_close(got.full_tensor(), reference.get_parameter(name).grad, msg=name)
