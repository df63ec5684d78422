"""Every HF causal-LM family at hand, compiled by mfsdp against itself run eagerly.

    python benchmarks/hf_families.py                       # the families listed below
    python benchmarks/hf_families.py llama,phimoe --checkpointing
    python benchmarks/hf_families.py --autocast              # both sides under CPU bf16 autocast
    python benchmarks/hf_families.py --compiler inductor     # the default compiler, one call each
    python benchmarks/hf_families.py --encoder-decoder       # T5, BART and the other seq2seq families

For each family: a tiny model from its config class (HF's defaults, dropout and router jitter
off), trained one step eagerly and, from the same weights, sharded over one gloo rank (its
collectives compute, so the arithmetic is real) and compiled with the eager runner. Three calls each: HF's default ``use_cache=True``, ``use_cache=False``, and a padded
batch. A row says whether the loss and every gradient equal eager's bit for bit, whether each
parameter that eager leaves without a gradient stays without one, how many graphs the step
took (1: no graph break), how often each block's body compiled, and whether every SDPA call
compiled has eager's arguments (mask or none, ``is_causal``, grouped-query attention, K/V
heads). Anything else is marked ``<<<``. With ``--compiler inductor`` (users' default) the
call is HF's default one only, and loss and gradients must agree with eager's to 1e-4 relative
(Inductor fuses, so not bit for bit; the row gives the largest error). Not a test: transformers' families change from release
to release, and a check over all of them takes minutes (about 4 on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fsdp_compile import MfsdpBackend, fully_shard

FAMILIES = (
    "llama,mistral,qwen2,qwen3,gemma,gemma2,gemma3_text,gemma4_text,phi,phi3,olmo,olmo2,olmo3,granite,"
    "starcoder2,gpt_neox,cohere,cohere2,stablelm,smollm3,glm,glm4,helium,ministral,exaone4,seed_oss,arcee,"
    "internlm3,ernie4_5,nemotron,persimmon,opt,gpt_bigcode,gpt2,biogpt,lfm2,nanochat,bitnet,diffllama,"
    "mixtral,qwen2_moe,qwen3_moe,olmoe,granitemoe,phimoe,glm4_moe,llama4_text,minimax,jetmoe,gpt_oss,"
    "qwen3_5_text,qwen3_next,falcon_h1,nemotron_h,olmo_hybrid,mamba,falcon_mamba"
)
ENCODER_DECODER = "t5,mt5,umt5,bart,mbart,pegasus,marian,blenderbot,blenderbot-small,m2m_100,plbart,led,bigbird_pegasus"
"""Sequence-to-sequence families (``--encoder-decoder``): labels feed the decoder."""
VOCAB, SEQ = 128, 16
SHAPES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=4 * SEQ, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, decoder_start_token_id=0, n_embd=32, n_layer=2, n_head=4,
)
SIDES = dict(
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64,
)
"""Where a config has them (BART's kind): its encoder's and decoder's own shapes."""


def _sdpa_signature(query, key, mask, causal, gqa) -> tuple:
    return (mask is not None, bool(causal), bool(gqa), key.shape[1], query.shape[1])


class _EagerAttention(TorchFunctionMode):
    """Records each SDPA call eager makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: set[tuple] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.add(_sdpa_signature(args[0], args[1], mask, kwargs.get("is_causal"), kwargs.get("enable_gqa")))
        return func(*args, **kwargs)


def _compiled_attention(backend: MfsdpBackend) -> set[tuple]:
    calls = set()
    for graph in backend.all_graphs():
        for gm in (m for m in graph.dynamo.modules() if isinstance(m, torch.fx.GraphModule)):
            for node in (n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)):
                query, key = (a.meta["example_value"] for a in node.args[:2])
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.add(_sdpa_signature(query, key, mask, node.kwargs.get("is_causal"), node.kwargs.get("enable_gqa")))
    return calls


def _model(family: str, use_cache: bool, checkpointing: bool):
    import transformers

    config = transformers.AutoConfig.for_model(family, **SHAPES)
    config.use_cache = use_cache
    for name, value in SIDES.items():
        if hasattr(config, name):
            setattr(config, name, value)
    for name, value in list(vars(config).items()):
        if isinstance(value, float) and ("drop" in name or "jitter" in name):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    model = auto.from_config(config).train()
    model.loss_type = "ForCausalLM"  # GPT-2's class names none: HF says so through its logger
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The norm of the difference over the norm of ``expected``."""
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def _agree(actual: torch.Tensor, expected: torch.Tensor, bound: float | None, floor: float = 0.0) -> bool:
    """Bit for bit (``bound`` None), or to ``bound`` relative to the larger of ``expected``'s
    norm and ``floor``: a gradient that is zero but for rounding (OPT's key bias, which the
    softmax cannot see) is noise on both sides."""
    if bound is None:
        return torch.equal(actual, expected)
    return float((actual.double() - expected.double()).norm()) <= bound * max(float(expected.double().norm()), floor)


def check(
    family: str, use_cache: bool, padded: bool, checkpointing: bool, autocast: bool = False, compiler: str = "eager"
) -> str:
    torch._dynamo.reset()
    try:
        reference = _model(family, use_cache, checkpointing)
    except Exception as error:  # a config these shapes do not fit
        return f"eager fails: {type(error).__name__}: {str(error)[:120]}"
    model = copy.deepcopy(reference)
    tokens = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=tokens, labels=tokens)
    if padded:
        inputs["attention_mask"] = torch.ones_like(tokens).index_fill_(1, torch.arange(4), 0)
    eager = _EagerAttention()
    try:
        with eager, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            expected = reference(**inputs)
        expected.loss.backward()
    except Exception as error:  # the family's own limits, not mfsdp's
        return f"eager fails: {type(error).__name__}: {str(error)[:120]}"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = fully_shard(model)
        backend = MfsdpBackend(compiler=compiler)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.compile(sharded, backend=backend)(**inputs).loss
            loss.backward()
    except Exception as error:
        return f"compiled fails: {type(error).__name__}: {str(error)[:160]}  <<<"
    finally:
        dist.destroy_process_group()
    bound = None if compiler == "eager" else 1e-4
    grads = {name: p.grad for name, p in sharded.named_parameters()}
    floor = 1e-3 * float(torch.cat([p.grad.flatten() for p in reference.parameters() if p.grad is not None]).norm())
    wrong = [
        name for name, p in reference.named_parameters()
        if (grads[name] is None) != (p.grad is None)
        or p.grad is not None and not _agree(grads[name].full_tensor(), p.grad, bound, floor)
    ]
    same_attention = _compiled_attention(backend) == eager.calls
    compiles = sorted(len(bodies) for bodies in backend.bodies.values())
    same_loss = _agree(loss.detach(), expected.loss.detach(), bound)
    ok = same_loss and not wrong and len(backend.graphs) == 1 and same_attention
    # What mfsdp said of a path eager does not take: a layer traced inline, a mask the model made.
    inline = sorted({
        str(w.message).split(",")[0] for w in said
        if "traced inline" in str(w.message) or "padding mask of its own" in str(w.message)
    })
    pairs = [(grads[name].full_tensor(), p.grad) for name, p in reference.named_parameters() if p.grad is not None and grads[name] is not None]
    errors = [_error(loss.detach(), expected.loss.detach()), *(_error(a, e) for a, e in pairs if e.norm() >= floor)]
    agreement = f"(largest error {max(errors):.1e}) " if bound is not None or not same_loss or wrong else ""
    return (
        f"{agreement}loss {'=' if same_loss else '!='} grads {'=' if not wrong else 'differ: ' + ', '.join(wrong[:3])} "
        f"graphs {len(backend.graphs)} body compiles {compiles} attention {'as eager' if same_attention else 'differs'}"
        f"{' ' + '; '.join(inline) if inline else ''}{'' if ok else '  <<<'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="?", help="comma-separated HF model types (default: the list above)")
    parser.add_argument("--encoder-decoder", action="store_true", help="by default, the sequence-to-sequence families")
    parser.add_argument("--checkpointing", action="store_true", help="HF's gradient_checkpointing_enable()")
    parser.add_argument("--autocast", action="store_true", help="both runs under torch.autocast('cpu', bfloat16)")
    parser.add_argument("--compiler", choices=("eager", "inductor"), default="eager", help="mfsdp's compiler")
    args = parser.parse_args()
    calls = ((True, False), (False, False), (False, True)) if args.compiler == "eager" else ((True, False),)
    families = args.families or (ENCODER_DECODER if args.encoder_decoder else FAMILIES)
    for family in families.split(","):
        for use_cache, padded in calls:
            row = check(family, use_cache, padded, args.checkpointing, args.autocast, args.compiler)
            print(f"{family:14s} use_cache={use_cache!s:5} padded={padded!s:5} {row}", flush=True)


if __name__ == "__main__":
    main()
