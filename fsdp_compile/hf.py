"""What fsdp_compile knows of HuggingFace transformers, in one place (transformers 5.x).

Nothing here imports transformers: each helper looks for it among the modules already
imported, so a program without HF models pays nothing and sees nothing.

NOTE: HF's value-dependent decisions, made before the trace
    HF decides some things from the *values* of its inputs. Two matter to speed: whether a
    2-D ``attention_mask`` holds any zero (padding), and whether ``position_ids`` pack several
    sequences in one row. Run eagerly (FSDP2 + per-block compile runs HF's root so), HF reads
    them and, for a causal LM without padding, gives SDPA no mask and ``is_causal=True``:
    FlashAttention over the causal half, grouped-query attention kept. Traced by Dynamo, it
    cannot read them (``find_packed_sequence_indices`` and ``_ignore_causal_mask_sdpa`` give
    up under tracing), so it builds a boolean mask: every layer's SDPA then runs masked, over
    the whole square, with K and V repeated to every query head.

    So the module ``fully_shard`` gets, when it is an HF model, calls its forward through a
    prelude that Dynamo does not trace but whose callees it compiles
    (``torch._dynamo.disable(..., recursive=False)``: the step is still one graph, starting in
    the model's own forward). The prelude reads the values eagerly, as HF would, and hands
    the trace the answers, which Dynamo then guards on like any other Python value:

    - a 2-D ``attention_mask`` (or ``decoder_attention_mask``) without zeros is passed as
      None, which is what HF makes of it (no padding: ``fast_all`` in masking_utils);
    - where the position ids are not packed (HF makes them from ``arange``, or the given ones
      restart nowhere, as HF's own check finds on their values), HF's packed-sequence check
      answers "not packed" for the call (``masking_utils.find_packed_sequence_indices``).
      Given only for a single text model (the model and its base model): a composite model
      (vision-language, encoder-decoder) makes position ids of its own, which the answer
      would not describe;
    - where no padding mask is left, HF's skip checks answer from the shapes, as they do
      eagerly (``masking_utils._ignore_causal_mask_sdpa``, and for bidirectional attention,
      BERT's or an encoder's, ``_ignore_bidirectional_mask_sdpa``): before transformers 5.24
      the causal one refuses every skip under tracing, and on torch 2.11 both do, since
      Dynamo traces ``torch.compiler.is_exporting()`` as True there.

    - an int ``num_items_in_batch`` (the loss's divisor, which HF also hands every layer)
      becomes a 0-d tensor, as HF's Trainer passes it: an int that changes every step would
      become symbolic, which no block call carries.

    A padded mask or packed positions go through untouched: HF builds the mask from them in
    the graph, exactly as before, and a step with padding compiles a graph of its own. A
    model that makes a padding mask of its own when given none (HF's BioGPT makes an all-ones
    one) reaches the skip check with that mask, traced: HF's answer stands (masked, right for
    any values), and the prelude says so once, naming the model. A
    step captured whole (``capture_step``) must not read values while it warms up or
    captures; inside ``inputs_unread()`` the prelude leaves the inputs as they are (HF's
    masked path, right for any values a replay brings) and says so once.

    A call that checkpoints its layers (``gradient_checkpointing_enable()``, training,
    gradients on) gets ``use_cache=False``, as HF makes it inside its forward: there HF says so
    through its logger, which Dynamo cannot trace (a graph break in the step under HF's
    default ``use_cache=True``); the prelude says HF's message through HF's logger instead.

    The prelude also installs HF's output-capturing hooks (``output_router_logits``,
    ``output_attentions``...) before the trace when the call asks for them: HF installs them
    lazily inside its forward, where a compiled body would not yet see them (NOTE: hooks
    inside a repeated block, in fsdp_compile/side_outputs.py). Under HF's gradient
    checkpointing those hooks append to HF's collector from inside each layer's checkpoint
    region, which Dynamo accepts only when the backward's recompute skips that side effect
    (``skip_fwd_side_effects_in_bwd_under_checkpoint``, set for the call): eager's recompute
    adds nothing to the collector either, which is gone by then. A hook of the user's inside
    such a layer then runs once per step, not again in the recompute.

    HF's ``kernels`` package (a dependency of transformers from 5.25) gets the same setting:
    it runs HF's attention layers through its ``use_kernelized_func`` wrapper, which sets a
    global of its own for the layer's call and puts it back, a store Dynamo refuses inside
    each checkpoint region. Set and reset net to nothing and the kernel they select is traced
    into the region, so a recompute that skips them runs what eager's does. So does KV sharing
    (Gemma 3n and 4): a layer's keys and values, stored in HF's ``KVSharingDict`` for later
    layers, are stored again by eager's recompute, equal, after the layers reading them ran.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
import types
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from fsdp_compile.backend import compiling_backend
from fsdp_compile.hf_hooks import install_output_hooks, say_input_require_grads, writes_outside_its_call
from fsdp_compile.hf_mask_skips import SKIP_CHECKS, UNPADDED
from fsdp_compile.records import built_class_name

__all__ = ["is_hf_model", "install_prelude", "inputs_unread"]

_MASKS = ("attention_mask", "decoder_attention_mask")

_INPUTS_UNREAD = contextvars.ContextVar("mfsdp_hf_inputs_unread", default=False)



def _module(name: str) -> types.ModuleType | None:
    return sys.modules.get(name)


def is_hf_model(module: object) -> bool:
    modeling = _module("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


@contextlib.contextmanager
def inputs_unread() -> Iterator[None]:
    """Within: HF models' preludes read no input values (a CUDA graph capture, and the
    warm-up whose graphs it replays; see NOTE: HF's value-dependent decisions)."""
    token = _INPUTS_UNREAD.set(True)
    try:
        yield
    finally:
        _INPUTS_UNREAD.reset(token)


def install_prelude(root: nn.Module) -> None:
    """Call ``root``'s forward through the prelude when it is an HF model; in a module of the
    user's, each HF model's forward through ``_entry`` (NOTE: an HF model inside a module of
    yours). Those of an earlier ``fully_shard`` on a submodule come off first: inside an HF
    model's traced forward, a prelude would cut the graph."""
    for module in root.modules():
        if module.__dict__.get("_mfsdp_hf_prelude"):
            del module.forward, module._mfsdp_hf_prelude
    for model in [root] if is_hf_model(root) else [m for m in root.modules() if is_hf_model(m)]:
        # An instance attribute: the model's class stays the user's (and FSDP2's, HF's).
        model.forward = types.MethodType(_signed_as_forward(_PRELUDE if model is root else _entry, model), model)
        model._mfsdp_hf_prelude = True


def _signed_as_forward(function: Any, model: nn.Module) -> Any:
    """``function`` (the same code, so the same for Dynamo) with the signature of ``model``'s
    own forward: HF's ``generate`` reads ``inspect.signature(model.forward)`` to decide what to
    pass, and given ``(*args, **kwargs)`` it passed no ``position_ids`` (a left-padded prompt
    then read the positions of its padding: other tokens than the unsharded model's) and no
    ``logits_to_keep``."""
    signed = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    signed.__dict__.update(function.__dict__)  # Dynamo's mark on the prelude among them
    signed.__signature__ = inspect.signature(type(model).forward)
    return signed


# NOTE: an HF model inside a module of yours
#     A PEFT model, a head on an HF backbone: the step's frame starts in the user's forward,
#     where the prelude cannot be the first call. An HF model's own forward goes through it
#     instead (``_entry``), and Dynamo breaks the graph there: the user's code around the call
#     runs as Dynamo leaves it (around graphs of its own, or in Python where Dynamo gives up on
#     the frame, as on PEFT's forward), and the HF model's forward is compiled as a graph of
#     its own, HF deciding as eagerly. The break is said once (check_graph_breaks.py): what
#     runs outside the HF model gathers each parameter it reads on its own, far cheaper than
#     a masked attention in every layer. An HF model called inside one whose prelude runs (a
#     causal LM's base model) is traced inline; a step that must be one graph
#     (``cuda_graph=True``, or ``fullgraph=True``, where a break raises) traces every HF
#     model inline, masked, said once with the fix.

_IN_PRELUDE = contextvars.ContextVar("mfsdp_hf_in_prelude", default=False)


def _entry(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """An HF model's forward inside a module of the user's (NOTE: an HF model inside a
    module of yours): through the prelude, a graph of its own where Dynamo traces it; inline
    inside another HF model's prelude, or where the step must be one graph (``cuda_graph`` or
    ``fullgraph``)."""
    if _inline_here(type(self).__name__):
        return type(self).forward(self, *args, **kwargs)
    return _PRELUDE(self, *args, **kwargs)


@torch._dynamo.assume_constant_result
def _inline_here(model: str) -> bool:
    """Whether an HF model's forward runs inline: inside another HF model's prelude, or in a
    step that must be one graph (traced for ``cuda_graph=True`` or with ``fullgraph=True``;
    said once). Run by Dynamo as it traces, a constant of the trace: a frame entered through
    a prelude always is, and Dynamo guards a compiled frame on its backend."""
    if _IN_PRELUDE.get():
        return True
    backend = compiling_backend()
    asked = None if backend is None else "cuda_graph=True" if backend.options.cuda_graph else _asked_one_graph()
    if asked is None:
        return False
    if backend.says_first(("an HF model traced inline", "")):  # the outermost, traced first
        warnings.warn(
            f"{asked}: the HF model {model} inside the compiled module is traced into "
            "the step's one graph, where HF builds a boolean attention mask (no FlashAttention, "
            "no grouped-query attention); mfsdp gives it HF's fast path only in a graph of its "
            f"own. Shard and compile {model} itself, and call it from your code, to capture its "
            "fast path.",
            stacklevel=2,
        )
    return True


def _asked_one_graph() -> str | None:
    """How the trace under way was asked to be one graph, where it was: torch.compile's
    ``fullgraph=True`` (or Dynamo's ``error_on_graph_break``), under which a break raises."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    return "fullgraph=True" if tx.one_graph or getattr(tx, "error_on_graph_break", False) else None


def _prelude(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    bound, held, tokens = _decided(self, forward, args, kwargs)
    try:
        return forward(*bound.args, **bound.kwargs)
    finally:
        _put_back(held, tokens)


# Dynamo compiles what the prelude calls (recursive=False): the model's forward, to be
# compiled, and the prelude's own work, disabled. So the prelude's frame calls nothing else:
# under fullgraph=True, Dynamo refuses any other frame it cannot compile (a generator
# expression: "Attempt to trace generator").
_PRELUDE = torch._dynamo.disable(_prelude, recursive=False)


@torch._dynamo.disable
def _decided(model: nn.Module, forward: Any, args: tuple, kwargs: dict) -> tuple[inspect.BoundArguments, dict, tuple]:
    """The call's arguments, an all-ones mask made None, an int ``num_items_in_batch`` a
    tensor, HF's output hooks installed where the call asks for outputs, and HF's
    packed-sequence check answered where the position ids are unpacked; the prelude's
    context set for the call. Returns the arguments and what ``_put_back`` restores after
    the call."""
    bound = _signature(forward).bind_partial(model, *args, **kwargs)
    arguments = bound.arguments
    unread = _INPUTS_UNREAD.get()
    if unread:
        _say_unread(type(model).__name__, [n for n in (*_MASKS, "position_ids") if arguments.get(n) is not None])
    else:
        for name in _MASKS:
            mask = arguments.get(name)
            if isinstance(mask, torch.Tensor) and mask.ndim == 2 and bool(mask.all()):
                arguments[name] = None
        _count_as_tensor(bound)  # not in a capture, which copies no new tensor to the device
    say_input_require_grads(model)
    held = {}
    # HF renamed the property in 5.24 and warns on the old name.
    renamed = hasattr(type(model), "is_activation_checkpointing")
    checkpointed = getattr(model, "is_activation_checkpointing" if renamed else "is_gradient_checkpointing", False)
    if checkpointed and model.training and torch.is_grad_enabled():
        _drop_cache_as_hf_does(model, bound)
    hf_models = [m for m in model.modules() if is_hf_model(m)]
    hooked = install_output_hooks(hf_models, _named(bound))
    writing = checkpointed and any(writes_outside_its_call(m) for m in model.modules())
    if checkpointed and (hooked or writing) and hasattr(torch._dynamo.config, _SKIP_REPLAY):
        # HF's output hooks, kernels' wrapper and KV sharing write outside each layer's
        # checkpoint region, which Dynamo refuses (a graph break per layer) unless the
        # backward's recompute skips those writes, which change nothing in eager (NOTE above).
        held[_SKIP_REPLAY] = _dynamo_config(_SKIP_REPLAY, True)
    masking = _module("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    positions = arguments.get("position_ids")
    # HF's own positions need no value read: a captured step gets the answer too.
    if original is not None and _single_text_model(model) and (positions is None or not unread and _unpacked(positions)):
        masking.find_packed_sequence_indices = _never_packed
        held["find_packed_sequence_indices"] = original
    for name, answering in SKIP_CHECKS:
        skip = getattr(masking, name, None)
        if skip is not None and (answered := answering(skip)) is not None:
            setattr(masking, name, answered)
            held[name] = skip
    unpadded = not unread and all(arguments.get(name) is None for name in _MASKS)
    tokens = (_IN_PRELUDE.set(True), UNPADDED.set(built_class_name(model) if unpadded else ""))
    return bound, held, tokens


def _count_as_tensor(bound: inspect.BoundArguments) -> None:
    """HF's ``num_items_in_batch`` (the loss's divisor under gradient accumulation) given as a
    Python int becomes a 0-d tensor on the inputs' device, as HF's Trainer passes it, and HF's
    loss divides by either alike. HF hands its ``**kwargs`` on to every layer: an int that
    changes from step to step becomes symbolic to Dynamo, which no block call carries (the
    step broke at every layer)."""
    into = _holder(bound, "num_items_in_batch")
    count = None if into is None else into.get("num_items_in_batch")
    if type(count) is int:
        device = next((v.device for v in _named(bound).values() if isinstance(v, torch.Tensor)), None)
        into["num_items_in_batch"] = torch.tensor(count, device=device)


@functools.cache
def _var_keyword(signature: inspect.Signature) -> str | None:
    """The name of the signature's ``**kwargs``, if it has one."""
    return next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)


def _holder(bound: inspect.BoundArguments, name: str) -> dict | None:
    """Where the call's argument ``name`` is, or would be given: its named arguments, or the
    dict of its ``**kwargs``; None where it takes no such argument."""
    if name in bound.signature.parameters:
        return bound.arguments
    extra = _var_keyword(bound.signature)
    return None if extra is None else bound.arguments.setdefault(extra, {})


def _named(bound: inspect.BoundArguments) -> dict:
    """The call's arguments by name, with those in its ``**kwargs`` (``output_hidden_states``)."""
    extra = _var_keyword(bound.signature)
    return {**(bound.arguments.get(extra, {}) if extra else {}), **bound.arguments}


_CACHE_DROPPED = "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."


def _drop_cache_as_hf_does(model: nn.Module, bound: inspect.BoundArguments) -> None:
    """HF turns ``use_cache`` off for a call that checkpoints its layers (training, gradients
    on), saying so through its logger: traced, the logger call breaks the graph (HF configs
    default to ``use_cache=True``). The call gets ``use_cache=False`` here, and HF's logger
    the same message, once."""
    into = _holder(bound, "use_cache")
    if into is None:
        return
    asked = into.get("use_cache")
    if asked is None:
        asked = getattr(getattr(model, "config", None), "use_cache", None)
    if asked:
        into["use_cache"] = False
        logger = getattr(_module("transformers.utils.generic"), "logger", None)
        if hasattr(logger, "warning_once"):
            logger.warning_once(_CACHE_DROPPED)


_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def _dynamo_config(name: str, value: Any) -> Any:
    before = getattr(torch._dynamo.config, name)
    setattr(torch._dynamo.config, name, value)
    return before


@torch._dynamo.disable
def _put_back(held: dict, tokens: tuple) -> None:
    for var, token in zip((_IN_PRELUDE, UNPADDED), tokens):
        var.reset(token)
    masking = _module("transformers.masking_utils")
    for name, value in held.items():
        setattr(masking if hasattr(masking, name) else torch._dynamo.config, name, value)


@functools.cache
def _signature(forward: Any) -> inspect.Signature:
    return inspect.signature(forward)


def _say_unread(model: str, given: list[str]) -> None:
    """Said once (Python's default warning filter keeps the first of a message)."""
    if not given:
        return
    warnings.warn(
        f"{model} was called with {', '.join(given)} in a captured step (capture_step), which "
        "cannot read their values: HF builds its attention mask in the graph (no "
        "FlashAttention, no grouped-query attention), right for whatever a replay brings. For "
        "batches without padding or packing, pass neither and HF's causal fast path is taken.",
        stacklevel=5,
    )


def _unpacked(position_ids: Any) -> bool:
    """Whether the position ids restart nowhere: None (HF makes them from ``arange``), or
    given ones HF's own check finds unpacked on their values."""
    if position_ids is None:
        return True
    masking = _module("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2 or find is None:
        return False
    return find(position_ids) is None


def _single_text_model(model: nn.Module) -> bool:
    """An HF model holding no HF model but its base model (``LlamaForCausalLM`` and its
    ``LlamaModel``), not an encoder-decoder."""
    nested = [m for m in model.modules() if m is not model and is_hf_model(m)]
    config = getattr(model, "config", None)
    return len(nested) <= 1 and not getattr(config, "is_encoder_decoder", False)


def _never_packed(position_ids: torch.Tensor) -> None:
    """``find_packed_sequence_indices``'s answer for positions found unpacked."""
    return None
