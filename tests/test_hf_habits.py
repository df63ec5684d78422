"""HF models as users train them: default configs (``use_cache=True``), MoE router losses,
padded batches, hooks on modules inside the layers. Each compiles regionally and trains at
parity with the unsharded model; none falls back silently to a slow path.

What these hold: NOTE: HF's value-dependent decisions (fsdp_compile/hf.py), NOTE: hooks
inside a repeated block and NOTE: HF caches in a repeated block (fsdp_compile/side_outputs.py).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import tempfile
import types
import unittest.mock
import warnings

import pytest
import torch

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.block_call import BLOCK_FORWARD
from fsdp_compile.patterns import is_reduce_scatter
from harness import SUMMATION_ORDER_EPS, fake_process_group, one_rank_group, relative_error, spawn

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 128, 16

_DYNAMO_TRACES_DEEPCOPY = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def _config(family: str, **overrides):
    """A tiny model of ``family`` with its HF defaults (``use_cache=True`` among them), no
    dropout (parity across ranks), MoE families with their router loss on."""
    common = dict(vocab_size=VOCAB, max_position_embeddings=2 * SEQ)
    llama_like = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, **llama_like),
        "qwen3": lambda: transformers.Qwen3Config(**common, **llama_like, head_dim=8),
        "mixtral": lambda: transformers.MixtralConfig(
            **common, **llama_like, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common, **llama_like, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, **llama_like, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.1,
        ),
        "mistral_sliding": lambda: transformers.MistralConfig(**common, **llama_like, sliding_window=SEQ // 2),
        "gemma3": lambda: transformers.Gemma3TextConfig(**common, **llama_like, head_dim=8, sliding_window=SEQ // 2),
        # Its last 2 of 4 layers reuse the keys and values the first 2 store (KV sharing).
        "gemma4": lambda: transformers.Gemma4TextConfig(
            **common, **{**llama_like, "num_hidden_layers": 4}, head_dim=8, sliding_window=SEQ // 2,
            layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
        ),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **common, **{**llama_like, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        ),
        "bert": lambda: transformers.BertConfig(
            vocab_size=VOCAB, max_position_embeddings=2 * SEQ, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        ),
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        ),
        "biogpt": lambda: transformers.BioGptConfig(
            vocab_size=VOCAB, max_position_embeddings=2 * SEQ, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            activation_dropout=0.0, layerdrop=0.0,
        ),
        "jetmoe": lambda: transformers.JetMoeConfig(
            vocab_size=VOCAB, max_position_embeddings=2 * SEQ, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, kv_channels=8,
            num_local_experts=4, num_experts_per_tok=2,
        ),
        "t5": lambda: transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        ),
    }
    config = configs[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


class _Wrapped(torch.nn.Module):
    """A module of the user's around an HF causal LM, as PEFT's is: it calls the model's
    ``forward`` inside a context manager of its own, and scales the loss by parameters of
    its own."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss_scale = torch.nn.Parameter(torch.ones(4))

    @contextlib.contextmanager
    def _adapters_on(self):
        yield

    def forward(self, **inputs):
        with self._adapters_on():
            out = self.model.forward(**inputs)
        out["loss"] = out.loss * self.loss_scale.mean()
        return out


class _Scorer(torch.nn.Module):
    """A head of the user's on an HF model's hidden states: the whole causal LM's, or its base
    model's called alone."""

    def __init__(self, model: torch.nn.Module, base: bool) -> None:
        super().__init__()
        self.model, self.base = model, base
        self.head = torch.nn.Linear(model.config.hidden_size, 1)

    def forward(self, **inputs):
        if self.base:
            hidden = self.model.model(inputs["input_ids"], attention_mask=inputs.get("attention_mask")).last_hidden_state
        else:
            hidden = self.model(**inputs, output_hidden_states=True).hidden_states[-1]
        return self.head(hidden).mean()


class _Prompted(torch.nn.Module):
    """Learned virtual tokens before the text, as PEFT's prompt tuning: the wrapper computes
    (the inputs' embeddings) before it calls the HF model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.prompt = torch.nn.Parameter(torch.randn(2, model.config.hidden_size))

    def forward(self, input_ids, labels, attention_mask):
        prompt = self.prompt.expand(input_ids.shape[0], -1, -1)
        embeds = torch.cat([prompt, self.model.get_input_embeddings()(input_ids)], dim=1)
        labels = torch.cat([torch.full_like(labels[:, :2], -100), labels], dim=1)
        mask = torch.cat([torch.ones_like(attention_mask[:, :2]), attention_mask], dim=1)
        return self.model(inputs_embeds=embeds, labels=labels, attention_mask=mask)


def _build(family: str, **overrides):
    if family == "wrapped_llama":
        return _Wrapped(_build("llama", **overrides))
    torch.manual_seed(0)
    config = _config(family, **overrides)
    if family == "t5":
        return transformers.T5ForConditionalGeneration(config).train()
    if family == "bert":
        return transformers.BertForMaskedLM(config).train()
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if family == "gpt2":
        # GPT-2's class names no loss type: HF says so through its logger, a graph break.
        model.loss_type = "ForCausalLM"
    return model


def _inputs(family: str, tokens: torch.Tensor, **extra) -> dict:
    if family == "t5":
        return {"input_ids": tokens, "labels": tokens.flip(-1), **extra}
    return {"input_ids": tokens, "labels": tokens, **extra}


def _block_calls(backend: MfsdpBackend) -> int:
    return sum(
        1 for graph in backend.graphs for gm in graph.dynamo.modules() if isinstance(gm, torch.fx.GraphModule)
        for node in gm.graph.nodes if node.target is BLOCK_FORWARD
    )


def _sdpa_calls(backend: MfsdpBackend) -> list[dict]:
    """Every SDPA call Dynamo traced, in the step's graphs and the bodies': its mask, causal
    flag, grouped-query flag and key/value heads against query heads."""
    found = []
    for graph in backend.all_graphs():
        for node in (n for gm in graph.dynamo.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes):
            if "scaled_dot_product_attention" in str(node.target):
                query, key = (a.meta["example_value"] for a in node.args[:2])
                found.append({
                    "mask": node.kwargs.get("attn_mask") is not None,
                    "causal": node.kwargs.get("is_causal", False),
                    "gqa": node.kwargs.get("enable_gqa", False),
                    "kv_heads": key.shape[1],
                    "q_heads": query.shape[1],
                })
    return found


# ---- structure: what the step compiles -----------------------------------------------------------


@pytest.mark.structure
@pytest.mark.parametrize("family", ["llama", "gpt2", "t5", "qwen2_moe", "mixtral"])
def test_every_layer_is_one_block_call_with_hf_default_config(family):
    """HF's default ``use_cache=True`` hands each layer a cache, which no op takes: before,
    Dynamo gave up on the layer loop's frame and every layer ran eagerly, silently. Now each
    layer is one block call of one body, with no graph break, and the cache comes back filled
    as eagerly (T5: an encoder-decoder cache, the decoder's layers; GPT-2 and the MoEs too)."""
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    with fake_process_group(8), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = fully_shard(_build(family))
        backend = MfsdpBackend(compiler="eager")
        tokens = torch.randint(0, VOCAB, (2, SEQ))
        out = torch.compile(model, backend=backend)(**_inputs(family, tokens))
        out.loss.backward()
    assert not [w for w in said if "outside every compiled graph" in str(w.message)]
    assert not [w for w in said if "deprecated" in str(w.message)]  # nothing of ours calls HF's old names
    new_breaks = {reason for reason, count in counters["graph_break"].items() if count != breaks.get(reason, 0)}
    if family == "t5" and not _DYNAMO_TRACES_DEEPCOPY:
        # HF's encoder-decoder cache deep-copies the config, which Dynamo traces from torch
        # 2.13: before, the step breaks there, and each layer is still one block call.
        assert new_breaks and all(reason.startswith("copy.deepcopy()") for reason in new_breaks), new_breaks
    else:
        assert not new_breaks and len(backend.graphs) == 1, new_breaks
    layers = 4 if family == "t5" else 2
    assert _block_calls(backend) == layers
    assert all(len(bodies) == 1 for bodies in backend.bodies.values()), {k: len(v) for k, v in backend.bodies.items()}
    cache = out.past_key_values
    if family == "t5":
        cache = cache.self_attention_cache
    assert cache.get_seq_length(0) == SEQ and cache.get_seq_length(1) == SEQ


@pytest.mark.structure
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("run_eagerly_first", [False, True])
def test_outputs_asked_through_kwargs_keep_the_step_one_graph(family, run_eagerly_first):
    """``output_hidden_states=True`` reaches an HF model through its ``**kwargs``: the prelude
    installs HF's capturing hooks for it before the trace, as for ``output_router_logits``.
    Before, HF installed them inside the traced forward, under a lock Dynamo cannot enter:
    the step broke in two, the base model's forward in a graph of its own. The hooks go
    where HF puts them, on the base model: a model HF had hooked eagerly (a copy of the
    reference after its run) got them again from the causal LM, every layer's hidden state
    twice. Every hidden state equals eager's (one gloo rank)."""
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    reference = _build(family)
    expected = reference(**_inputs(family, tokens), output_hidden_states=True).hidden_states
    with one_rank_group(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = fully_shard(copy.deepcopy(reference) if run_eagerly_first else _build(family))
        backend = MfsdpBackend(compiler="eager")
        out = torch.compile(model, backend=backend)(**_inputs(family, tokens), output_hidden_states=True)
        out.loss.backward()
    assert not [w for w in said if "not one graph" in str(w.message)], [str(w.message) for w in said]
    assert len(backend.graphs) == 1 and _block_calls(backend) == 2
    assert len(out.hidden_states) == len(expected) and all(torch.equal(a, b) for a, b in zip(out.hidden_states, expected))


@pytest.mark.structure
@pytest.mark.parametrize(
    "family, use_cache, checkpointing",
    [("llama", False, False), ("llama", True, False), ("llama", False, True), ("llama", True, True),
     ("qwen3", False, False), ("qwen3", True, True), ("mixtral", False, True), ("mixtral", True, False)],
)
def test_sdpa_takes_hf_eager_fast_path(family, use_cache, checkpointing):
    """A causal LM without padding: every SDPA call compiled has no mask, ``is_causal=True``
    and grouped-query attention (K and V keep their heads), as HF's eager root gives it.
    Before, the traced root built a boolean mask: masked SDPA over the whole square, K and V
    repeated to every query head (no FlashAttention on a GPU)."""
    with fake_process_group(8):
        model = _build(family, use_cache=use_cache)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = fully_shard(model)
        backend = MfsdpBackend(compiler="eager")
        tokens = torch.randint(0, VOCAB, (2, SEQ))
        # A mask of ones is no padding, as HF reads it.
        extra = {"attention_mask": torch.ones_like(tokens)} if use_cache else {}
        torch.compile(model, backend=backend)(**_inputs(family, tokens, **extra)).loss.backward()
    calls = _sdpa_calls(backend)
    assert calls and all(
        not c["mask"] and c["causal"] and c["gqa"] and c["kv_heads"] * 2 == c["q_heads"] for c in calls
    ), calls


@pytest.mark.structure
@pytest.mark.parametrize("family", ["mistral_sliding", "gemma3", "gemma4", "deepseek_v3", "bert"])
def test_sdpa_calls_compiled_are_the_eager_ones(family):
    """Where eager HF needs a mask, the compiled step keeps it; where it needs none, none: a
    sliding window shorter than the sequence (Mistral; Gemma 3's alternating sliding and
    global layers; Gemma 4's too, whose later layers reuse earlier ones' keys and values, so
    its layers are traced inline) is masked in eager and compiled alike, DeepSeek-V3's
    latent attention is causal without a mask, and BERT's bidirectional attention stays
    non-causal. Each SDPA call's mask, causal and grouped-query flags and key-value heads (a
    body traces once the call its layers make each)."""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    eager = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        eager.append({"mask": attn_mask is not None, "causal": is_causal, "gqa": enable_gqa, "kv_heads": key.shape[1], "q_heads": query.shape[1]})
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    with unittest.mock.patch("torch.nn.functional.scaled_dot_product_attention", recorded):
        _build(family)(**_inputs(family, tokens)).loss.backward()
    with fake_process_group(8):
        model = fully_shard(_build(family))
        backend = MfsdpBackend(compiler="eager")
        torch.compile(model, backend=backend)(**_inputs(family, tokens)).loss.backward()

    def kinds(calls: list[dict]) -> set[tuple]:
        return {tuple(sorted({**c, "causal": bool(c["causal"]), "gqa": bool(c["gqa"])}.items())) for c in calls}

    assert eager and kinds(_sdpa_calls(backend)) == kinds(eager), (_sdpa_calls(backend), eager)


@pytest.mark.structure
@pytest.mark.parametrize("wrapper", ["peft_like", "scorer", "scorer_of_base_model", "prompted"])
def test_an_hf_model_inside_a_module_of_yours_takes_the_fast_path(wrapper):
    """A PEFT model, a head of the user's on an HF model (the causal LM, or its base model
    called alone), or virtual tokens computed before it: the HF model's forward is compiled
    as a graph of its own, where HF decides its mask as eagerly (no mask, causal,
    grouped-query attention), every layer one block call; the break at its call is said
    once (from the graph before it, when there is one, or the HF model's). Before, the HF
    model was traced with the wrapper and built a boolean mask (said at ``fully_shard``)."""
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with fake_process_group(8), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        llama = _build("llama")
        wrappers = {"peft_like": _Wrapped, "prompted": _Prompted}
        model = fully_shard(wrappers[wrapper](llama) if wrapper in wrappers else _Scorer(llama, wrapper == "scorer_of_base_model"))
        backend = MfsdpBackend(compiler="eager")
        step = torch.compile(model, backend=backend)
        for _ in range(2):
            out = step(**_inputs("llama", tokens, attention_mask=torch.ones_like(tokens)))
            (out.loss if wrapper in wrappers else out).backward()
    calls = _sdpa_calls(backend)
    assert calls and all(
        not c["mask"] and c["causal"] and c["gqa"] and c["kv_heads"] * 2 == c["q_heads"] for c in calls
    ), calls
    assert _block_calls(backend) == 2, _block_calls(backend)
    breaks = [str(w.message) for w in said if "not one graph" in str(w.message)]
    named = {"scorer_of_base_model": "the HF model LlamaModel", "prompted": "an HF model"}.get(wrapper, "the HF model LlamaForCausalLM")
    assert len(breaks) == 1 and f"calls {named}, whose forward mfsdp compiles as a graph of its own" in breaks[0], breaks


@pytest.mark.structure
@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_peft_applied_after_sharding_is_refused_with_the_order_that_works(compiled):
    """``get_peft_model`` after ``fully_shard`` replaces the sharded layers' linears with LoRA
    wrappers. ``fully_shard`` on the PeftModel was refused as "already called" (it read the
    sharded model's attribute through PEFT's ``__getattr__``), and the forward failed with
    ``KeyError: 'weight'`` inside the block's gather. Both now go on to one error naming the
    missing weight and the order that works (PEFT first, then ``fully_shard``)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with one_rank_group():
        model = peft.get_peft_model(fully_shard(_build("llama")), config)
        fully_shard(model)
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager")) if compiled else model
        with pytest.raises(ValueError, match=r"q_proj.weight, sharded by fully_shard, is no longer there.*get_peft_model, then fully_shard"):
            forward(input_ids=tokens, labels=tokens)


@pytest.mark.structure
def test_a_peft_lora_model_trains_as_eagerly_on_the_fast_path():
    """PEFT's LoRA on HF Llama, with checkpointing enabled after ``get_peft_model`` and HF's
    input hook disabled (the order the warning names): the HF model compiles as a graph of
    its own (PEFT's forward runs in Python around it, said once), each layer one block call,
    SDPA without a mask, causal, grouped-query; only the adapters are reduce-scattered. The
    losses and every parameter after three AdamW steps equal eager's bit for bit (one gloo
    rank)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    reference = peft.get_peft_model(_build("llama"), config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # HF 5.24's new names; PEFT calls the old
        reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference.disable_input_require_grads()
    model = copy.deepcopy(reference)
    batches = [torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def train(forward, module) -> list[torch.Tensor]:
        opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for tokens in batches:
            losses.append(forward(input_ids=tokens, labels=tokens).loss)
            losses[-1].backward()
            opt.step()
            opt.zero_grad()
        return losses

    expected = train(reference, reference)
    with one_rank_group(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = fully_shard(model)
        backend = MfsdpBackend(compiler="eager")
        losses = train(torch.compile(model, backend=backend), model)
        params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    breaks = [str(w.message) for w in said if "not one graph" in str(w.message)]
    assert len(breaks) == 1 and "calls the HF model LlamaForCausalLM" in breaks[0], breaks
    assert not [w for w in said if "input_require_grads" in str(w.message)]
    assert len(backend.graphs) == 1 and _block_calls(backend) == 2
    calls = _sdpa_calls(backend)
    assert calls and all(not c["mask"] and c["causal"] and c["gqa"] for c in calls), calls
    assert all(torch.equal(a, b) for a, b in zip(losses, expected))
    assert all(torch.equal(params[n], p) for n, p in reference.named_parameters())
    scattered = sum(n.meta["val"].numel() for n in backend.graphs[0].backward.graph.nodes if is_reduce_scatter(n))
    assert scattered == sum(p.numel() for p in reference.parameters() if p.requires_grad), scattered


@pytest.mark.structure
@pytest.mark.parametrize("asked", ["cuda_graph=True", "fullgraph=True"])
def test_a_step_that_must_be_one_graph_traces_a_wrapped_hf_model_inline_and_says_so(asked):
    """``cuda_graph=True`` (a step captured whole) or ``fullgraph=True`` (where a break
    raises) cannot have a graph of the HF model's own, so the HF model inside a module of the
    user's is traced inline, where HF masks what it cannot read while traced (a given mask of
    ones), said once (naming the outermost HF model and how one graph was asked) with the
    fix. Before, ``fullgraph=True`` raised Dynamo's "Skip inlining torch.compiler.disable()d
    function" at the prelude."""
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with fake_process_group(8), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = fully_shard(_Wrapped(_build("llama")))
        backend = MfsdpBackend(compiler="eager", cuda_graph=asked == "cuda_graph=True")
        inputs = _inputs("llama", tokens, attention_mask=torch.ones_like(tokens))
        torch.compile(model, backend=backend, fullgraph=asked == "fullgraph=True")(**inputs).loss.backward()
    calls = _sdpa_calls(backend)
    assert len(backend.graphs) == 1 and calls and all(c["mask"] and not c["causal"] for c in calls), calls
    inline = [str(w.message) for w in said if "traced into the step's one graph" in str(w.message)]
    assert len(inline) == 1 and inline[0].startswith(asked) and "Shard and compile LlamaForCausalLM itself" in inline[0], inline


@pytest.mark.structure
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_fullgraph_true_compiles_an_hf_model_as_one_graph_on_its_fast_path(family):
    """``torch.compile(model, backend="mfsdp", fullgraph=True)`` on an HF model: before, the
    prelude's generator expression, a frame Dynamo offered the backend, raised "Attempt to
    trace generator". Now the step is one graph, each layer one block call, SDPA on HF's eager
    fast path, and the loss and every gradient are eager's (one gloo rank)."""
    torch.manual_seed(0)
    eager = _build(family)
    model = copy.deepcopy(eager)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    expected = eager(**_inputs(family, tokens)).loss
    expected.backward()
    with one_rank_group():
        fully_shard(model)
        backend = MfsdpBackend(compiler="eager")
        loss = torch.compile(model, backend=backend, fullgraph=True)(**_inputs(family, tokens)).loss
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    assert len(backend.graphs) == 1 and _block_calls(backend) == 2, (len(backend.graphs), _block_calls(backend))
    calls = _sdpa_calls(backend)
    assert calls and all(not c["mask"] and c["causal"] and c["gqa"] for c in calls), calls
    assert relative_error(loss.detach(), expected.detach()) < SUMMATION_ORDER_EPS
    for name, p in eager.named_parameters():
        assert relative_error(grads[name], p.grad) < SUMMATION_ORDER_EPS, name


@pytest.mark.structure
def test_a_padded_batch_keeps_hf_mask():
    """Padding must be masked: with zeros in ``attention_mask`` the prelude leaves the mask
    to HF, which builds it in the graph (parity: ``test_hf_habits_train_at_parity``)."""
    with fake_process_group(8):
        model = fully_shard(_build("llama"))
        backend = MfsdpBackend(compiler="eager")
        tokens = torch.randint(0, VOCAB, (2, SEQ))
        mask = torch.ones_like(tokens)
        mask[0, :3] = 0
        torch.compile(model, backend=backend)(**_inputs("llama", tokens, attention_mask=mask)).loss.backward()
    calls = _sdpa_calls(backend)
    assert calls and all(c["mask"] and not c["causal"] for c in calls), calls


@pytest.mark.structure
@pytest.mark.parametrize(
    "regional, use_cache", [(False, False), (True, False), (True, True)], ids=["inline", "regional", "regional-cache"]
)
def test_each_call_gets_the_mask_its_padding_and_packing_need(regional, use_cache):
    """HF decides on values whether a call needs a mask: padding (zeros in
    ``attention_mask``) and sequences packed into one row (position ids that restart, no mask:
    HF's ``DataCollatorWithFlattening``). The prelude tells HF "no padding" and "not packed"
    only for a call whose values say so, so batches with and without either, in turn through
    one compiled model, each get eager's mask or its mask-free causal path (one gloo rank):
    loss and gradients equal eager's bit for bit. With a cache (HF's default
    ``use_cache=True``) HF checks no packing, in eager too."""
    reference = _build("llama", use_cache=use_cache)
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    ones = torch.ones_like(tokens)
    padded = ones.clone()
    padded[0, :5] = 0
    packed = torch.cat([torch.arange(6), torch.arange(SEQ - 6)]).expand(2, SEQ)
    calls = [
        {"attention_mask": ones}, {"attention_mask": padded}, {}, {"position_ids": packed},
        {"position_ids": torch.arange(SEQ).expand(2, SEQ)}, {"position_ids": packed}, {"attention_mask": padded.flip(0)},
    ]
    with one_rank_group():
        model = fully_shard(model)
        backend = MfsdpBackend(compiler="eager", regional=regional)
        forward = torch.compile(model, backend=backend)
        for extra in calls:
            expected = reference(**_inputs("llama", tokens, **extra))
            expected.loss.backward()
            loss = forward(**_inputs("llama", tokens, **extra)).loss
            loss.backward()
            assert torch.equal(loss, expected.loss), extra
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            assert all(torch.equal(grads[n], p.grad) for n, p in reference.named_parameters()), extra
            reference.zero_grad()
            model.zero_grad()
    sdpa = _sdpa_calls(backend)
    assert any(c["mask"] and not c["causal"] for c in sdpa), sdpa
    assert any(not c["mask"] and c["causal"] and c["gqa"] for c in sdpa), sdpa


@pytest.mark.structure
def test_a_mask_the_model_makes_itself_is_said_once_and_keeps_eager_results():
    """HF's BioGPT makes an all-ones mask when given none; traced, HF cannot read its values,
    so its SDPA calls get a mask where eager's get none. Not silent: said once, naming the
    model, and the loss is eager's. A model that leaves the mask None says nothing."""
    for family in ("biogpt", "llama"):
        reference = _build(family)
        model = copy.deepcopy(reference)
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
        expected = reference(**_inputs(family, tokens)).loss
        with one_rank_group(), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            backend = MfsdpBackend(compiler="eager")
            loss = torch.compile(fully_shard(model), backend=backend)(**_inputs(family, tokens)).loss
        assert torch.equal(loss, expected), family
        own = [str(w.message) for w in said if "padding mask of its own" in str(w.message)]
        if family == "biogpt":
            assert len(own) == 1 and own[0].startswith("BioGptForCausalLM "), own
            assert all(c["mask"] for c in _sdpa_calls(backend))
        else:
            assert not own and not any(c["mask"] for c in _sdpa_calls(backend)), own


@pytest.mark.structure
def test_a_block_that_reads_tensor_values_is_traced_inline_and_said_so():
    """HF's JetMoE reads its router's counts (``expert_size.tolist()``): its layer cannot run
    on fake tensors, so no body can be compiled for it. Before, the first step stopped with
    an error naming ``regional=False``; now its calls are traced inline by themselves, said
    once, and the loss is eager's, the gradients too but for the order the graph breaks sum
    them in (one gloo rank)."""
    reference = _build("jetmoe")
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    expected = reference(**_inputs("jetmoe", tokens)).loss
    expected.backward()
    with one_rank_group(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = fully_shard(model)
        backend = MfsdpBackend(compiler="eager")
        loss = torch.compile(model, backend=backend)(**_inputs("jetmoe", tokens)).loss
        loss.backward()
    reads = [str(w.message) for w in said if "reads tensor values" in str(w.message)]
    assert len(reads) == 1 and "JetMoeDecoderLayer" in reads[0], reads
    assert not backend.bodies and torch.equal(loss, expected)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        assert relative_error(grads[name], p.grad) <= 1e-6, name  # fp32 summation order


@pytest.mark.structure
def test_an_output_eager_computes_without_a_gradient_has_none_between_blocks():
    """T5's first decoder layer returns the cross-attention bias (zeros and the mask), which
    needs no gradient; the block call's outputs all required one, so the next layers got a
    differentiable mask, and their SDPA another CPU kernel than eager's (heads of 64, T5's
    default): the loss off in its last bits. Now each layer's call takes exactly the tensors
    eager's layer takes as differentiable, and the loss is eager's bit for bit (the
    gradients sum the encoder's output over the layers in another order: 3e-7)."""
    reference = _build("t5", d_kv=64, num_decoder_layers=3)
    eager_layers = {}

    def count(index, args, kwargs) -> None:
        eager_layers[index] = sum(t.requires_grad for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))

    hooks = [
        layer.register_forward_pre_hook(lambda m, args, kwargs, i=i: count(i, args, kwargs), with_kwargs=True)
        for i, layer in enumerate(reference.decoder.block)
    ]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": tokens, "labels": tokens}
    expected = reference(**inputs).loss
    for hook in hooks:
        hook.remove()
    with one_rank_group():
        model = fully_shard(copy.deepcopy(reference))
        backend = MfsdpBackend(compiler="eager")
        loss = torch.compile(model, backend=backend)(**inputs).loss
    decoder = list(model.decoder.block)
    compiled_layers = {
        decoder.index(call.block()): sum(call.traced["differentiable"])
        for graph in backend.graphs for call in graph.calls if call.block() in decoder
    }
    assert compiled_layers == eager_layers, (compiled_layers, eager_layers)
    assert torch.equal(loss, expected), (loss, expected)


@pytest.mark.structure
def test_checkpointing_every_other_layer_compiles_two_bodies_and_matches_eager():
    """HF's ``activation_checkpointing_enable(every_n_layers=2)`` (transformers 5.24)
    checkpoints every other layer: the layers' body compiles once for each kind (Dynamo guards
    on the layer's flag), the step stays one graph, and it is eager's bit for bit."""
    reference = _build("llama", num_hidden_layers=4)
    if not hasattr(reference, "activation_checkpointing_enable"):
        pytest.skip("transformers before 5.24 has no every_n_layers")
    reference.activation_checkpointing_enable(every_n_layers=2)
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = reference(**_inputs("llama", tokens)).loss
    expected.backward()
    with one_rank_group():
        model = fully_shard(model)
        backend = MfsdpBackend(compiler="eager")
        loss = torch.compile(model, backend=backend)(**_inputs("llama", tokens)).loss
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    assert [len(bodies) for bodies in backend.bodies.values()] == [2] and len(backend.graphs) == 1
    assert torch.equal(loss, expected)
    assert all(torch.equal(grads[n], p.grad) for n, p in reference.named_parameters())


@pytest.mark.structure
@pytest.mark.parametrize("family", ["llama", "gemma4"], ids=["kernels_routing", "kv_sharing"])
@pytest.mark.parametrize("regional", [False, True], ids=["inline", "regional"])
def test_layers_writing_outside_their_checkpoint_region_keep_one_graph_and_eager_arithmetic(regional, family):
    """Under HF's gradient checkpointing, writes a layer makes outside its call, which eager's
    recompute makes again to no effect: the routing wrapper of HF's ``kernels`` package (a
    dependency of transformers from 5.25) sets a global of kernels' for each attention call
    and puts it back; Gemma 4's layers store their keys and values in HF's ``KVSharingDict``
    for the later layers that reuse them. Inside HF's checkpoint region Dynamo refused those
    stores: the step broke at every layer, which then ran eagerly. The recompute now skips
    them: one graph, and eager's loss and gradients bit for bit (one gloo rank)."""
    from torch._dynamo.utils import counters

    reference = _build(family)
    if family == "llama":
        assert any("_kernel_funcs" in vars(m) for m in reference.modules()), "kernels' wrapper is not on HF's layers"
    else:
        assert reference.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = reference(**_inputs(family, tokens), use_cache=False).loss
    expected.backward()
    breaks = sum(counters["graph_break"].values())
    with one_rank_group():
        model = fully_shard(model)
        backend = MfsdpBackend(compiler="eager", regional=regional)
        loss = torch.compile(model, backend=backend)(**_inputs(family, tokens), use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert len(backend.graphs) == 1
    assert torch.equal(loss, expected)
    assert all(torch.equal(grads[n], p.grad) for n, p in reference.named_parameters())


@pytest.mark.structure
def test_input_require_grads_on_frozen_embeddings_is_said_with_the_fix():
    """HF's ``activation_checkpointing_enable()`` (and PEFT) hook the input embeddings with
    ``requires_grad_()``; on a frozen table (an adapter fine-tune) Dynamo breaks the step's
    graph there, and every layer ran outside the compiled step: said, naming
    ``disable_input_require_grads()`` for non-reentrant checkpointing, after which the step is
    one graph and trains the adapters as eager does."""
    reference = _build("llama")
    reference.requires_grad_(False)
    reference.lm_head.requires_grad_(True)  # the trainable part, past the layers
    for layer in reference.model.layers:
        layer.mlp.down_proj.requires_grad_(True)
    reference.activation_checkpointing_enable() if hasattr(reference, "activation_checkpointing_enable") else (
        reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    )
    if not getattr(reference, "_require_grads_hooks", None):  # HF 5.24's enabling did it already
        reference.enable_input_require_grads()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with fake_process_group(2), pytest.warns(UserWarning, match="disable_input_require_grads"):
        model = fully_shard(copy.deepcopy(reference))
        torch.compile(model, backend=MfsdpBackend(compiler="eager"))(**_inputs("llama", tokens)).loss.backward()
    reference.disable_input_require_grads()
    model = copy.deepcopy(reference)
    reference(**_inputs("llama", tokens)).loss.backward()
    with one_rank_group(), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said
        model = fully_shard(model)
        backend = MfsdpBackend(compiler="eager")
        torch.compile(model, backend=backend)(**_inputs("llama", tokens)).loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert len(backend.graphs) == 1
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(expected) and all(torch.equal(grads[n], g) for n, g in expected.items())


@pytest.mark.structure
def test_an_int_num_items_in_batch_keeps_one_graph_and_eager_arithmetic():
    """``num_items_in_batch`` as a Python int (``(labels != -100).sum().item()`` under gradient
    accumulation), a new value each step: HF hands it to every layer too, where Dynamo made
    it symbolic from the second value and the step broke at every layer (7 graphs in 5
    steps). As a 0-d tensor, as HF's Trainer passes it: one graph, and losses and weights
    equal eager's with the int, bit for bit (one gloo rank)."""
    reference = _build("llama")
    model = copy.deepcopy(reference)
    steps = []
    for step in range(4):
        tokens = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))
        labels = tokens.clone()
        labels[:, : step + 1] = -100
        steps.append({"input_ids": tokens, "labels": labels, "num_items_in_batch": int((labels != -100).sum())})

    def train(forward, parameters) -> list[torch.Tensor]:
        opt = torch.optim.AdamW(parameters, lr=1e-2)
        losses = []
        for inputs in steps:
            losses.append(forward(**inputs).loss)
            losses[-1].backward()
            opt.step()
            opt.zero_grad()
        return losses

    expected = train(reference, reference.parameters())
    with one_rank_group(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = fully_shard(model)
        backend = MfsdpBackend(compiler="eager")
        losses = train(torch.compile(model, backend=backend), model.parameters())
        params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    assert not [w for w in said if "not one graph" in str(w.message)], [str(w.message) for w in said]
    assert len(backend.graphs) == 1 and _block_calls(backend) == 2
    assert all(torch.equal(a, b) for a, b in zip(losses, expected))
    assert all(torch.equal(params[n], p) for n, p in reference.named_parameters())


@pytest.mark.structure
def test_input_require_grads_enabled_twice_is_said_with_the_order_that_undoes_it():
    """PEFT's ``get_peft_model`` on a model already checkpointing enables HF's input hook a
    second time, and HF then removes only the last one's: after the documented
    ``disable_input_require_grads()`` one hook stays and the step still breaks. Said, with the
    order that undoes it (checkpointing enabled after ``get_peft_model``)."""
    model = _build("llama")
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.mlp.down_proj.requires_grad_(True)
    model.enable_input_require_grads()
    model.enable_input_require_grads()
    model.disable_input_require_grads()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with fake_process_group(2), pytest.warns(UserWarning, match="Here it was enabled twice.*after get_peft_model"):
        torch.compile(fully_shard(model), backend=MfsdpBackend(compiler="eager"))(**_inputs("llama", tokens)).loss.backward()


@pytest.mark.structure
def test_a_captured_step_reads_no_input_values_and_keeps_the_fast_path_it_can():
    """capture_step replays values capture never saw, so inside ``inputs_unread`` nothing is
    decided from values: HF's own positions still need none (fast path; the first GPU run
    of a captured 8B step lost 70 ms of attention without this), and a given mask is left to
    HF, whose masked path is right for any replay (said once)."""
    from fsdp_compile.hf import inputs_unread

    tokens = torch.randint(0, VOCAB, (2, SEQ))
    for extra, masked in (({}, False), ({"attention_mask": torch.ones_like(tokens)}, True)):
        with fake_process_group(8), inputs_unread(), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            model = fully_shard(_build("llama"))
            backend = MfsdpBackend(compiler="eager")
            torch.compile(model, backend=backend)(**_inputs("llama", tokens, **extra)).loss.backward()
        calls = _sdpa_calls(backend)
        assert calls and all(c["mask"] == masked and c["causal"] != masked for c in calls), (extra, calls)
        assert any("captured step" in str(w.message) for w in said) == masked


@pytest.mark.structure
def test_a_hook_that_replaces_an_output_inside_a_block_is_refused():
    """A forward hook inside a block is called after the block's body (NOTE: hooks inside a
    repeated block): one returning a replacement output would be ignored, so it is refused
    with the fix."""
    with fake_process_group(8):
        model = fully_shard(_build("llama"))
        model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output * 2)
        backend = MfsdpBackend(compiler="eager")
        tokens = torch.randint(0, VOCAB, (2, SEQ))
        with pytest.raises(ValueError, match="returned a value"):
            torch.compile(model, backend=backend)(**_inputs("llama", tokens))


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, options):
        return self.linear(x) * options.scale


class _PassesAnObject(torch.nn.Module):
    """Hands each layer an object of its own: no constant can stand for it in a block call."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Scaled() for _ in range(3))

    def forward(self, x):
        options = types.SimpleNamespace(scale=0.5)
        for layer in self.layers:
            x = layer(x, options)
        return x


@pytest.mark.structure
def test_a_block_its_body_cannot_take_is_traced_inline_and_said_so():
    """A layer called with an object of the user's (as HF's cache was): no op can carry it to
    the body, and before, Dynamo gave up on the frame holding the layer loop (the layers ran
    as frames of their own, each cut in two). Now each call is traced inline in the one step
    graph, and the user is told once why, with the fix."""
    with fake_process_group(8):
        model = fully_shard(_PassesAnObject())
        backend = MfsdpBackend(compiler="eager")
        with pytest.warns(UserWarning, match="called with a SimpleNamespace"):
            torch.compile(model, backend=backend)(torch.randn(2, 8)).sum().backward()
    assert len(backend.graphs) == 1 and not backend.bodies


@pytest.mark.structure
def test_a_cache_of_another_class_is_traced_inline_and_said_so():
    """HF MiniMax's default cache is its own ``DynamicCache`` subclass, with linear-attention
    state and methods of its own. Before, its layers got the body's stand-in, which lacks
    them: the compile failed (``'DynamicStandIn' object has no attribute
    'get_linear_cache'``). Now such a call is traced inline, said once, and the loss, every
    gradient and the cache's length equal eager's (one gloo rank)."""
    config = transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, max_position_embeddings=2 * SEQ,
        router_jitter_noise=0.0, pad_token_id=0,
    )
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).train()
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    expected = reference(input_ids=tokens, labels=tokens)
    expected.loss.backward()
    with one_rank_group():
        model = fully_shard(model)
        with pytest.warns(UserWarning, match="called with a MiniMaxCache"):
            out = torch.compile(model, backend=MfsdpBackend(compiler="eager"))(input_ids=tokens, labels=tokens)
        out.loss.backward()
    assert torch.equal(out.loss, expected.loss)
    assert out.past_key_values.get_seq_length() == expected.past_key_values.get_seq_length() == SEQ
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        assert torch.equal(grads[name], p.grad), name


def _hybrid_config(family: str):
    """A model whose HF cache holds linear-attention or state-space layers: Qwen3.5's three
    gated-delta-net layers then one full-attention layer, two of Falcon-H1's
    Mamba-beside-attention layers."""
    llama_like = dict(
        vocab_size=VOCAB, max_position_embeddings=2 * SEQ, hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
    )
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**llama_like)
    return transformers.FalconH1Config(**{**llama_like, "num_hidden_layers": 2})


def _eager_and_compiled(model: torch.nn.Module, **inputs) -> tuple:
    """The model's loss and gradients eagerly, and a copy's sharded and compiled on one gloo
    rank (the eager runner): (eager loss, eager grads, compiled loss, compiled grads, the
    compile's backend)."""
    compiled = copy.deepcopy(model)
    expected = model(**inputs).loss
    expected.backward()
    with one_rank_group():
        backend = MfsdpBackend(compiler="eager")
        loss = torch.compile(fully_shard(compiled), backend=backend)(**inputs).loss
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in compiled.named_parameters()}
    return expected, {n: p.grad for n, p in model.named_parameters()}, loss, grads, backend


@pytest.mark.structure
def test_a_decoding_step_through_the_compiled_model_is_said_as_a_cache_holding_states():
    """A decoding step of the user's own (``past_key_values=`` the prefill's cache) through the
    compiled model: the cache holds the layer's keys and values, so each layer is traced
    inline. It was said as a ``DynamicCache`` that "cannot" be handed over while the same
    message listed ``DynamicCache`` among what goes through, with a fix (pass the values the
    block reads) no HF user can apply (a helper's probe). It is said as a cache holding
    states now, naming the uncompiled model for decoding; the logits are eager's (one gloo
    rank)."""
    reference = _build("llama").eval()
    prompt, step = torch.randint(0, VOCAB, (1, SEQ)), torch.randint(0, VOCAB, (1, 1))
    with torch.no_grad():
        cache = reference(input_ids=prompt, use_cache=True).past_key_values
        expected = reference(input_ids=step, past_key_values=cache, use_cache=True).logits
    model = copy.deepcopy(reference)
    with one_rank_group(), torch.no_grad(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        compiled = torch.compile(fully_shard(model), backend=MfsdpBackend(compiler="eager"))
        cache = compiled(input_ids=prompt, use_cache=True).past_key_values
        logits = compiled(input_ids=step, past_key_values=cache, use_cache=True).logits
    messages = [str(w.message) for w in said if "LlamaDecoderLayer" in str(w.message)]
    assert messages and all("already holding keys and values for its layer" in m for m in messages), messages
    torch.testing.assert_close(logits, expected)


@pytest.mark.structure
@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])
def test_a_cache_holding_linear_attention_layers_is_traced_inline_and_said_with_use_cache_false(family):
    """transformers 5.25's ``DynamicCache`` holds a linear-attention layer for each of
    Qwen3.5's gated-delta-net layers and a Mamba-beside-attention one for Falcon-H1's, whose
    own calls (``update_conv_state``, ``has_previous_state``) the body's stand-in does not
    answer. Before, HF's default call (``use_cache=True``) failed to compile
    (``'DynamicStandIn' object has no attribute 'layers'``). Now such a layer is traced
    inline, said once with the fix, at eager's loss and gradients; with ``use_cache=False``
    every layer is one call of the compiled body, unsaid (one gloo rank)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hybrid_config(family)).train()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    kind = "LinearAttentionLayer" if family == "qwen3_5" else "LinearAttentionAndFullAttentionLayer"
    with pytest.warns(UserWarning, match=f"with HF's DynamicCache holding a {kind} for its layer.*use_cache=False"):
        expected, expected_grads, loss, grads, backend = _eager_and_compiled(model, input_ids=tokens, labels=tokens)
    # Qwen3.5's attention layer keeps its body; the linear-attention ones are inline.
    assert _block_calls(backend) == (1 if family == "qwen3_5" else 0)
    assert relative_error(loss, expected) < 1e-6
    assert all(relative_error(grads[n], g) < 1e-5 for n, g in expected_grads.items())
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected, expected_grads, loss, grads, backend = _eager_and_compiled(
            model, input_ids=tokens, labels=tokens, use_cache=False
        )
    assert _block_calls(backend) == model.config.num_hidden_layers
    assert relative_error(loss, expected) < 1e-6
    assert all(relative_error(grads[n], g) < 1e-5 for n, g in expected_grads.items())


@pytest.mark.structure
def test_a_mamba_layer_whose_scan_maps_with_vmap_is_one_body_for_all_layers():
    """Traced, HF's Mamba layers scan with torch's ``associative_scan``, which maps its
    combine function with ``vmap`` on the CPU; inside the block op's kernels the dispatcher
    keeps torch.func's keys off, and the body's fake run and first compile failed there
    ("NYI: querying is_contiguous inside of vmap"). Now every layer is one call of the
    compiled body, at eager's loss and gradients (eager scans with a Python loop: the sums
    differ in order; one gloo rank)."""
    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    expected, expected_grads, loss, grads, backend = _eager_and_compiled(model, input_ids=tokens, labels=tokens)
    assert _block_calls(backend) == 2
    assert relative_error(loss, expected) < 1e-6
    assert all(relative_error(grads[n], g) < 1e-5 for n, g in expected_grads.items())


@pytest.mark.structure
@pytest.mark.parametrize("regional", [False, True], ids=["inline", "regional"])
def test_gemma4_s_default_call_with_kv_sharing_keeps_one_graph_and_eager_arithmetic(regional):
    """HF's default call of Gemma 4 (``use_cache=True``) whose last layers reuse earlier
    layers' keys and values: HF's cache holds a ``DummyLayer`` for each reusing layer, whose
    ``get_seq_length`` HF's cache calls but which has none, so asking whether the cache was
    empty at such a layer raised an AttributeError, after graph breaks. Now one graph, and
    eager's loss, gradients and cache length bit for bit (one gloo rank)."""
    reference = _build("gemma4")
    model = copy.deepcopy(reference)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    expected = reference(**_inputs("gemma4", tokens))
    expected.loss.backward()
    with one_rank_group():
        model = fully_shard(model)
        backend = MfsdpBackend(compiler="eager", regional=regional)
        out = torch.compile(model, backend=backend)(**_inputs("gemma4", tokens))
        out.loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    # Below torch 2.13 Dynamo skips copy.copy, which HF's per-layer config code calls as the
    # cache is made: a break there, upstream's.
    assert reference.config.use_cache and (len(backend.graphs) == 1 or not _DYNAMO_TRACES_DEEPCOPY)
    assert torch.equal(out.loss, expected.loss)
    assert out.past_key_values.get_seq_length() == expected.past_key_values.get_seq_length() == SEQ
    assert all(torch.equal(grads[n], p.grad) for n, p in reference.named_parameters())


# ---- multirank: parity with the unsharded model --------------------------------------------------


def _batches(family: str, world: int, padded: bool):
    """Per step, every rank's inputs; padded: each rank's first row starts with 3 pad tokens
    (equal counts on every rank, so the mean of the ranks' losses is the global one)."""
    steps = []
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (2 * world, SEQ), generator=torch.Generator().manual_seed(step))
        per_rank = []
        for rank in range(world):
            mine = tokens[2 * rank : 2 * rank + 2]
            extra = {}
            if padded:
                mask = torch.ones_like(mine)
                mask[0, :3] = 0
                extra["attention_mask"] = mask
            inputs = _inputs(family, mine, **extra)
            if padded:
                inputs["labels"] = inputs["labels"].masked_fill(mask == 0, -100)
            per_rank.append(inputs)
        steps.append(per_rank)
    return steps


def _hooked(model, family: str) -> list:
    """A user's activation logger on each layer's MLP: what it saw, per call."""
    seen = []
    if family == "wrapped_llama":
        model = model.model
    layers = model.decoder.block if family == "t5" else model.model.layers if hasattr(model, "model") else model.transformer.h
    for layer in layers:
        mlp = getattr(layer, "mlp", None) or layer.layer[-1]
        mlp.register_forward_hook(lambda module, args, output: seen.append(output.detach().norm().item()))
    return seen


def _hf_parity(rank, world, *, family, padded):
    """Three AdamW steps (weight decay 0.1; the epsilon of harness.SUMMATION_ORDER_EPS, since
    the ranks sum in another order): the sharded model compiled regionally against the
    unsharded model run on each rank's batch in turn (the ranks' mean loss, as data
    parallelism computes it): losses, first-step gradients, final parameters, the cache
    after the first forward, and what a hook inside each layer saw."""
    batches = _batches(family, world, padded)
    reference = _build(family)
    ref_seen = _hooked(reference, family)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, eps=SUMMATION_ORDER_EPS)
    ref_losses, ref_grads, ref_cache = [], None, None
    for step, per_rank in enumerate(batches):
        total = 0.0
        for r, inputs in enumerate(per_rank):
            out = reference(**inputs)
            (out.loss / world).backward()
            total += out.loss.item() / world
            if step == 0 and r == rank and family == "llama":
                ref_cache = [out.past_key_values.layers[i].keys.clone() for i in range(2)]
        if step == 0:
            ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(total)
    ref_seen_mine = list(ref_seen)

    model = fully_shard(_build(family))
    seen = _hooked(model, family)
    forward = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=SUMMATION_ORDER_EPS)
    losses, grads, cache = [], None, None
    for step, per_rank in enumerate(batches):
        out = forward(**per_rank[rank])
        out.loss.backward()
        loss = out.loss.detach().clone()
        torch.distributed.all_reduce(loss)
        losses.append(loss.item() / world)
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
            if family == "llama":
                cache = [out.past_key_values.layers[i].keys.clone() for i in range(2)]
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    ref_params = dict(reference.named_parameters())
    # The reference's hook ran on every rank's batch in turn; this rank's are every world-th.
    per_call = len(ref_seen_mine) // (3 * world)
    mine = [v for step in range(3) for v in ref_seen_mine[(step * world + rank) * per_call : (step * world + rank + 1) * per_call]]
    hook = max(abs(a - b) / b for a, b in zip(seen, mine)) if len(seen) == len(mine) else ("calls", len(seen), len(mine))
    after = _after_training(model, reference, rank, params) if family == "llama" and not padded else {}
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "grad_names": sorted(grads) == sorted(ref_grads),
        "grad": max(relative_error(grads[n], ref_grads[n]) for n in ref_grads),
        "param": max((relative_error(params[n], ref_params[n].detach()), n) for n in params),
        "cache": None if cache is None else max(relative_error(c, r) for c, r in zip(cache, ref_cache)),
        "hook": hook,
        **after,
    }


@pytest.mark.structure
def test_save_pretrained_names_the_model_s_own_class():
    """``save_pretrained`` writes the class's name into config.json's "architectures", which
    serving engines load a model by: the sharded model's is the user's ("LlamaForCausalLM"),
    as HF writes it under FSDP2, not the subclass fully_shard made ("ShardedLlamaForCausalLM",
    a class transformers does not have). One gloo rank."""
    import json

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with one_rank_group(), tempfile.TemporaryDirectory() as path:
        model = fully_shard(_build("llama"))
        model.save_pretrained(path, state_dict=get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
        with open(f"{path}/config.json") as config:
            assert json.load(config)["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.structure
@pytest.mark.parametrize("call", ["without_state_dict", "with_the_model_s_state_dict", "of_its_inner_model"])
def test_save_pretrained_of_shards_is_refused_with_the_full_state_dict_recipe(call):
    """``model.save_pretrained(path)``, as with DDP on rank 0 alone, given
    ``model.state_dict()``, or called on the HF model inside (``model.model``): refused with a
    ``ValueError`` naming the full state dict every rank gathers, before any collective and
    before a file is written. Before, on rank 0 alone HF's tied-weight check read an element
    of the members sharing a block's buffer, a collective the other ranks never joined: rank 0
    hung; on every rank safetensors failed on the DTensors, as under FSDP2. The full state
    dict, given by position, is written. Two ranks of a fake group: no collective runs there."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with fake_process_group(2), tempfile.TemporaryDirectory() as path:
        model = fully_shard(_build("llama"))
        saving = {
            "without_state_dict": lambda: model.save_pretrained(path),
            "with_the_model_s_state_dict": lambda: model.save_pretrained(path, state_dict=model.state_dict()),
            "of_its_inner_model": lambda: model.model.save_pretrained(path),
        }[call]
        with pytest.raises(ValueError, match=r"get_model_state_dict\(model, options=StateDictOptions\(full_state_dict=True"):
            saving()
        assert not os.listdir(path)
        model.save_pretrained(path, True, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
        assert "model.safetensors" in os.listdir(path)
        # The inner model holds the refusal, not FSDP2's methods: those would act on its part.
        assert not hasattr(model.model, "set_requires_gradient_sync")


def _after_training(model, reference, rank: int, params: dict) -> dict:
    """What users do once trained: HF's ``save_pretrained`` of the full state dict (sharded
    parameters alone fail in safetensors, under FSDP2 too; docs/user_guide.md, "Checkpoints")
    reloaded by ``from_pretrained``, and greedy ``generate`` from the sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    saved = None
    if rank == 0:
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path, state_dict=full)
            loaded = type(reference).from_pretrained(path)
        saved = max(relative_error(p.detach(), params[n]) for n, p in loaded.named_parameters())
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(7))
    model.eval()
    reference.eval()
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
        expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    return {"saved": saved, "generated": torch.equal(generated, expected)}


@pytest.mark.multirank
@pytest.mark.parametrize(
    "family, padded",
    [("llama", False), ("llama", True), ("gemma3", True), ("gpt2", False), ("t5", False), ("qwen2_moe", False),
     ("qwen3_moe", False), ("mixtral", False), ("wrapped_llama", False), ("wrapped_llama", True)],
)
def test_hf_habits_train_at_parity(family, padded):
    """Two gloo ranks, the eager runner: HF's default cache, a padded batch, MoE router losses
    (``output_router_logits=True``: HF's load-balancing loss from hooks inside each layer,
    which crashed before), a user's hook inside each layer and an HF model inside a module of
    the user's (its own graph, the wrapper's parameters read outside it) match the unsharded
    model."""
    for result in spawn(_hf_parity, 2, family=family, padded=padded):
        assert result["grad_names"], result
        assert result["loss"] < 1e-5 and result["grad"] < 1e-5 and result["param"][0] < 1e-5, result
        assert result["hook"] is not None and not isinstance(result["hook"], tuple) and result["hook"] < 1e-5, result
        if result["cache"] is not None:
            assert result["cache"] < 1e-5, result
        if "saved" in result:
            assert result["generated"], result
            assert result["saved"] is None or result["saved"] == 0.0, result


@pytest.mark.structure
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_from_a_left_padded_prompt_matches_the_unsharded_model(family):
    """Greedy ``generate`` from a left-padded batch on the sharded model: HF reads
    ``inspect.signature(model.forward)`` to decide what to pass, and the prelude's
    ``(*args, **kwargs)`` made it pass no ``position_ids``: GPT-2 (absolute positions) read
    its padding's positions and generated other tokens, as FSDP2's model does not. The
    forward and ``generate`` have the class's signatures; tokens and logits are the unsharded
    model's (one gloo rank, uncompiled)."""
    reference = _build(family).eval()
    model = copy.deepcopy(reference)
    prompt = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    prompt[1, :3] = 0
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    asked = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                 return_dict_in_generate=True)
    with torch.no_grad():
        expected = reference.generate(prompt, **asked)
    with one_rank_group():
        fully_shard(model)
        for method in ("forward", "generate"):
            mine, theirs = inspect.signature(getattr(model, method)), inspect.signature(getattr(reference, method))
            assert list(mine.parameters) == list(theirs.parameters), method
        with torch.no_grad():
            got = model.generate(prompt, **asked)
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, expected.logits)) < 1e-5


@pytest.mark.structure
def test_resize_token_embeddings_after_sharding_is_refused_with_the_order_that_works():
    """HF's ``resize_token_embeddings`` on a sharded model failed inside DTensor
    (``aten._is_all_true.default does not have a sharding strategy``), naming nothing; it is
    refused before any collective, naming resize-then-shard, which trains. A call that keeps
    the size is HF's, as before (one gloo rank)."""
    model = _build("llama")
    with one_rank_group():
        fully_shard(model)
        with pytest.raises(ValueError, match=r"resize_token_embeddings\(131\).*Resize first, then shard"):
            model.resize_token_embeddings(VOCAB + 3)
        for same in ((), (VOCAB,), (VOCAB - 3, 64)):  # the last padded to a multiple of 64
            assert model.resize_token_embeddings(*same).weight.shape == (VOCAB, 32), same
        resized = _build("llama")
        resized.resize_token_embeddings(VOCAB + 3)
        fully_shard(resized)
        tokens = torch.randint(0, VOCAB + 3, (2, SEQ), generator=torch.Generator().manual_seed(0))
        resized(input_ids=tokens, labels=tokens).loss.backward()
        assert resized.model.embed_tokens.weight.grad.full_tensor().shape == (VOCAB + 3, 32)


class _OwnGenerate(transformers.LlamaForCausalLM):
    """A class with a ``generate`` of its own that passes its keywords on (as 31 HF model
    classes have)."""

    def generate(self, *args, **kwargs):
        return super().generate(*args, **kwargs)


def _generate_until_each_rank_s_end(rank, world, *, own_generate: bool):
    """Each rank its own prompt and an end-of-sequence token that ends rank 0's after one new
    token, rank 1's later: the tokens of the unsharded model on each rank."""
    reference = _build("llama").eval()
    if own_generate:
        reference.__class__ = _OwnGenerate
    model = copy.deepcopy(reference)
    fully_shard(model)
    first = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eos = reference.generate(first, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1].item()
        prompt = first if rank == 0 else torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
        asked = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=eos)
        expected = reference.generate(prompt, **asked)
        got = model.generate(prompt, **asked)
    return {"new": expected.shape[1] - 5, "equal": torch.equal(got, expected)}


@pytest.mark.multirank
@pytest.mark.parametrize("own_generate", [False, True], ids=["hf_generate", "own_generate"])
def test_generate_on_ranks_whose_sequences_end_apart_keeps_them_in_step(own_generate):
    """``generate`` on two gloo ranks whose sequences end at different lengths: the rank done
    first stopped joining the weight gathers, and the other waited until the process group
    timed out. As HF does for a model FSDP2 shards, every rank steps until all are done
    (``synced_gpus``), through a class's own ``generate`` too; each rank's tokens are the
    unsharded model's."""
    results = spawn(_generate_until_each_rank_s_end, 2, pg_timeout=60, own_generate=own_generate)
    assert results[0]["new"] == 1 and results[1]["new"] > 1, results
    assert all(r["equal"] for r in results), results
