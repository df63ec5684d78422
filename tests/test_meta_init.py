"""Meta-device init: build without memory, shard, materialise only this rank's rows. Training
to parity from a full state dict loaded into a model still on meta is the matrix's
``meta_init`` cell on every layout (tests/test_matrix.py); FSDP2's other loaders, which assign
sharded values, are here."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.testing.models import Transformer, TransformerConfig
from harness import (
    TOLERANCE,
    build_model,
    fake_process_group,
    full_parameters,
    max_param_error,
    mean_over_ranks,
    one_rank_group,
    rank_batches,
    reference,
    relative_error,
    spawn,
    train,
)


def _meta_model(cfg):
    with torch.device("meta"):
        return Transformer(cfg)


@pytest.mark.structure
@pytest.mark.skipif(
    torch.__version__ < "2.13",
    reason="torch < 2.13's MemTracker counts a DTensor at its global size (its wrapper's storage: "
    "a DTensor over 1 MB of rows of a 4 MB tensor counts 5 MB), so it cannot see a shard's peak",
)
def test_materialising_a_meta_model_allocates_about_one_shard():
    """to_empty + init on the sharded model peaks near this rank's shard, not the model."""
    cfg = TransformerConfig(vocab=1024, dim=256, hidden=704, n_heads=4)
    world = 4
    full_bytes = sum(p.numel() * p.element_size() for p in build_model(cfg).parameters())
    with fake_process_group(world):
        model = fully_shard(_meta_model(cfg))
        assert all(p.device.type == "meta" for p in model.parameters())
        tracker = MemTracker()
        with tracker:
            model.to_empty(device="cpu")
            with torch.no_grad():
                for param in model.parameters():
                    param.normal_(std=0.02)  # DTensor: each rank draws only its rows
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    shard_bytes = full_bytes / world
    # Observed 1.09x: one parameter's rows are briefly allocated twice while to_empty swaps it.
    assert peak < 1.2 * shard_bytes, (peak, shard_bytes, full_bytes)


def _init_weights(model: torch.nn.Module) -> None:
    """A model's own init, as torchtitan's and HF's are written: through each module's
    attributes (``nn.init.*_(module.weight)``, ``module.bias.data.zero_()``), after
    ``to_empty``; each weight a constant of its own, so every rank knows its rows."""
    with torch.no_grad():
        for index, module in enumerate(model.modules()):
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if name == "bias":
                    module.bias.data.zero_()
                else:
                    torch.nn.init.constant_(getattr(module, name), 0.01 * (index + 1))


@pytest.mark.structure
def test_a_model_s_own_init_after_to_empty_writes_the_shards():
    """Outside any module's call a sharded attribute reads the parameter itself, as under
    FSDP2 (NOTE: reads outside a forward): a model's init after ``to_empty`` writes every rank's rows, and
    ``module.weight.requires_grad = False`` freezes it. Both wrote a gathered copy before (the
    model kept ``to_empty``'s garbage; the flag was refused on a non-leaf). A forward still
    reads the gathered weights."""
    cfg = TransformerConfig()
    expected = build_model(cfg)
    _init_weights(expected)
    with fake_process_group(2):
        model = _meta_model(cfg)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        _init_weights(model)
        model.head.weight.requires_grad = False
        assert model.head.weight is model.head._parameters["weight"]
        for name, param in model.named_parameters():
            rows = expected.get_parameter(name).detach().chunk(2)[0]
            assert torch.equal(param.to_local()[: len(rows)], rows), name
        assert not model.get_parameter("head.weight").requires_grad
        gathered = {}
        hook = model.head.register_forward_pre_hook(lambda m, args: gathered.setdefault("head", m.weight))
        model(torch.zeros(2, 8, dtype=torch.long))
        hook.remove()
    assert type(gathered["head"]) is torch.Tensor and gathered["head"].shape == expected.head.weight.shape


def _llama_config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )


def _llama_sharded_on_meta(cfg):
    """HF Llama built on the meta device, its layers sharded, then the model."""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


@pytest.mark.structure
def test_an_hf_model_s_init_weights_after_to_empty_initialises_the_shards():
    """HF's meta-device flow: ``LlamaForCausalLM`` built on meta, sharded, ``to_empty``, then
    HF's own ``init_weights()`` (its ``_init_weights`` writes ``module.weight``): every rank's
    rows hold HF's init (norms 1, projections ~N(0, initializer_range)), none of to_empty's
    memory (NaN here) is left. Before, HF initialised gathered copies and the NaN stayed."""
    cfg = _llama_config()
    with fake_process_group(2):
        model = _llama_sharded_on_meta(cfg)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().fill_(float("nan"))
            model.init_weights()
        shards = {name: param.to_local() for name, param in model.named_parameters()}
    for name, shard in shards.items():
        if name.endswith("norm.weight"):
            assert torch.equal(shard, torch.ones_like(shard)), name
        else:
            assert abs(shard.std().item() - cfg.initializer_range) < 0.3 * cfg.initializer_range, (name, shard.std())


@pytest.mark.structure
def test_an_hf_model_loaded_after_init_weights_trains_as_unsharded():
    """HF's meta-device flow to the end: ``LlamaForCausalLM`` built on meta, sharded,
    ``to_empty``, ``init_weights()`` (HF's ``_init_weights`` also computes the rotary
    ``inv_freq``, which no state dict holds), the reference's weights loaded; the compiled steps
    then give the unsharded model's losses and weights. Without ``init_weights`` the first
    step is refused, naming the buffers and the fix: before, it trained on what to_empty's
    memory held (NOTE: non-persistent buffers after a meta init)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    transformers = pytest.importorskip("transformers")
    cfg = _llama_config()
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(cfg)
    weights = {name: value.clone() for name, value in reference.state_dict().items()}
    batches = [torch.randint(0, 128, (2, 16)) for _ in range(2)]

    def losses(model, forward):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        result = []
        for ids in batches:
            loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            result.append(loss.detach())
        return torch.stack(result)

    expected = losses(reference, reference)
    with one_rank_group():
        model = _llama_sharded_on_meta(cfg)
        model.to_empty(device="cpu")
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
        with pytest.raises(ValueError, match=r"model\.rotary_emb\.inv_freq, model\.rotary_emb\.original_inv_freq were materialised by to_empty.*model\.to_empty\(device=\.\.\.\), then model\.init_weights\(\).*then load"):
            forward(input_ids=batches[0], labels=batches[0])
        model.init_weights()
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
        actual = losses(model, forward)
        params = full_parameters(model)
    assert relative_error(actual, expected) < 1e-6, (actual, expected)
    assert max_param_error(params, dict(reference.named_parameters()))[0] < 1e-6


@pytest.mark.structure
def test_an_encoder_decoder_generates_from_a_sharded_model():
    """HF's ``generate`` calls an encoder-decoder's encoder on its own, outside the model's
    forward: a read in that call is a forward's and gathers (NOTE: reads outside a forward),
    so T5 generates from the sharded model what it generates unsharded."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    reference = transformers.T5ForConditionalGeneration(cfg).eval()
    inputs = torch.randint(1, 64, (2, 6))
    expected = reference.generate(inputs, max_new_tokens=4, do_sample=False)
    with one_rank_group():
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(cfg).eval()
        for stack in (model.encoder, model.decoder):
            for block in stack.block:
                fully_shard(block)
        fully_shard(model)
        assert torch.equal(model.generate(inputs, max_new_tokens=4, do_sample=False), expected)


def _sharded_on_meta(cfg: TransformerConfig) -> Transformer:
    model = _meta_model(cfg)
    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _placed_as_the_model(model: torch.nn.Module, full: dict, *, parameters: bool = False) -> dict:
    """``full`` distributed as ``model.state_dict()`` places each entry, as FSDP2's loaders do
    (Accelerate's plain DTensors; torchtune's ``nn.Parameter``s with ``parameters``)."""
    placed = {}
    for name, entry in model.state_dict().items():
        value = full[name]
        if isinstance(entry, DTensor):
            value = distribute_tensor(value, entry.device_mesh, entry.placements)
            value = torch.nn.Parameter(value) if parameters else value
        placed[name] = value
    return placed


def _assigning_loaders_run(rank, world, *, cfg):
    """Each loader into a model sharded on meta, then trained compiled: whether every
    parameter kept its object, and the errors against the unsharded model."""
    ref_losses, ref_params = reference(cfg, world)
    full = build_model(cfg).state_dict()
    results = {}
    for loader in ("accelerate", "torchtune_swap"):
        torch._dynamo.reset()
        model = _sharded_on_meta(cfg)
        before = [id(p) for p in model.parameters()]
        swap = loader == "torchtune_swap"
        torch.__future__.set_swap_module_params_on_conversion(swap)
        try:
            model.load_state_dict(_placed_as_the_model(model, full, parameters=swap), assign=True)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        kept = before == [id(p) for p in model.parameters()]
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
        losses = mean_over_ranks(train(model, forward, rank_batches(cfg, rank)))
        results[loader] = {
            "kept": kept,
            "loss_error": relative_error(losses, ref_losses),
            "param_error": max_param_error(full_parameters(model), ref_params),
        }
    return results


@pytest.mark.multirank
def test_loaders_that_assign_sharded_values_keep_every_parameter_and_train_as_unsharded():
    """``load_state_dict(sharded_sd, assign=True)`` into a model sharded on meta, as
    Accelerate's ``fsdp2_load_full_state_dict`` does and torchtune's loader under
    ``torch.__future__``'s swap: each parameter keeps its object (its sharding record, its
    slot in its block's flat) and takes the values (NOTE: loading with assign, in
    fsdp_compile/state_dicts.py), and the compiled step trains as the unsharded model on 2
    gloo ranks. Before, the first forward refused the replaced parameters."""
    cfg = TransformerConfig()
    for rank, results in enumerate(spawn(_assigning_loaders_run, 2, cfg=cfg)):
        for loader, result in results.items():
            assert result["kept"], (rank, loader)
            assert result["loss_error"] < TOLERANCE and result["param_error"][0] < TOLERANCE, (rank, loader, result)


@pytest.mark.structure
def test_a_load_that_assigns_what_a_shard_cannot_hold_is_refused_with_the_fix():
    """Full tensors assigned to sharded parameters, and a block on meta loaded in part, are
    refused with the fix; the model keeps its parameters."""
    cfg = TransformerConfig()
    full = build_model(cfg).state_dict()
    with fake_process_group(2):
        model = _sharded_on_meta(cfg)
        before = [id(p) for p in model.parameters()]
        with pytest.raises(ValueError, match=r"not a DTensor.*distribute_tensor.*set_model_state_dict"):
            model.load_state_dict(full, assign=True)
        assert before == [id(p) for p in model.parameters()]
        assert all(isinstance(p, DTensor) for p in model.parameters())
        placed = _placed_as_the_model(model, full)
        part = {name: value for name, value in placed.items() if name.startswith("layers.0.attn.")}
        with pytest.raises(ValueError, match=r"layers\.0, still on the meta device.*to_empty"):
            model.load_state_dict(part, assign=True, strict=False)
