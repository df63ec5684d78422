"""HF's mask-skip checks answered from the shapes where no padding mask is left, as HF
answers them eagerly (NOTE: HF's value-dependent decisions, in hf.py). The prelude (hf.py)
puts each answer in place of HF's own for the call."""

from __future__ import annotations

import contextvars
import functools
import inspect
import warnings
from typing import Any

import torch

__all__ = ["SKIP_CHECKS", "UNPADDED"]

UNPADDED = contextvars.ContextVar("mfsdp_hf_unpadded", default="")
"""The class of the HF model whose call is under way without a padding mask (none given, or
all ones), read as its skip checks are traced; empty otherwise."""


@functools.cache
def _answered_skip(original: Any) -> Any:
    """HF's ``_ignore_causal_mask_sdpa`` answering, where no padding mask is left, from the
    shapes alone as it does eagerly; traced, transformers before 5.24 refuses every skip (its
    ``is_tracing`` check comes first). With a padding mask, or a tensor ``q_offset`` (static
    caches, whose skip HF refuses under tracing), HF's own answer. One function per original,
    so Dynamo's guard on the global holds from call to call. None for a signature this does
    not know."""
    names = list(inspect.signature(original).parameters)
    known = {"padding_mask", "kv_length", "q_offset", "local_attention_size"}
    length = "q_length" if "q_length" in names else "query_length"
    if not known | {length} <= set(names):
        return None
    at = {name: names.index(name) for name in (*known, length)}

    def value(args: tuple, kwargs: dict, name: str) -> Any:
        return args[at[name]] if len(args) > at[name] else kwargs.get(name)

    def answered(*args: Any, **kwargs: Any) -> bool:
        q_offset = value(args, kwargs, "q_offset")
        if value(args, kwargs, "padding_mask") is not None:
            _say_own_mask()
            return original(*args, **kwargs)
        if isinstance(q_offset, torch.Tensor):
            return original(*args, **kwargs)
        q_length, kv_length = value(args, kwargs, length), value(args, kwargs, "kv_length")
        local = value(args, kwargs, "local_attention_size")
        if local is not None and kv_length >= local:
            return False
        return q_length == 1 or kv_length == q_length or q_offset == 0

    return answered


@functools.cache
def _answered_bidirectional_skip(original: Any) -> Any:
    """HF's ``_ignore_bidirectional_mask_sdpa`` answering, where no padding mask is left, from
    the shapes alone as it does eagerly (no bias unless a local window is shorter than the
    keys); with a padding mask, HF's own answer. One function per original, as
    ``_answered_skip``; None for a signature this does not know."""
    names = list(inspect.signature(original).parameters)
    if names != ["padding_mask", "kv_length", "local_attention_size"]:
        return None

    def answered(padding_mask: Any, kv_length: int, local_attention_size: int | None = None) -> bool:
        if padding_mask is not None:
            _say_own_mask()
            return original(padding_mask, kv_length, local_attention_size)
        return local_attention_size is None or kv_length < local_attention_size

    return answered


@torch._dynamo.assume_constant_result
def _say_own_mask() -> None:
    """Said once (Python's warnings keep the first), where a call given no padding reaches
    HF's skip check with a padding mask: the model made one itself (HF's BioGPT makes an
    all-ones one), and HF cannot read its values while tracing."""
    model = UNPADDED.get()
    if model:
        warnings.warn(
            f"{model} makes a padding mask of its own when its call has none, and HF cannot "
            "read that mask's values while tracing: every SDPA call compiled gets it as a mask "
            "(no FlashAttention, no grouped-query attention) even where it holds no padding, "
            "where the model run eagerly takes the causal fast path. The results are right; "
            "the fast path needs the model to leave its attention_mask None when given none.",
            stacklevel=2,
        )


SKIP_CHECKS = (
    ("_ignore_causal_mask_sdpa", _answered_skip),
    ("_ignore_bidirectional_mask_sdpa", _answered_bidirectional_skip),
)
"""HF's mask-skip checks and what answers each (NOTE: HF's value-dependent decisions, in hf.py)."""
