"""HF's caches inside a repeated block: the stand-in a layer's compiled body gets in place of
HF's ``DynamicCache`` (or an encoder-decoder pair of them), and the writes it records, made on
the user's cache after the call (NOTE: HF caches in a repeated block, in
fsdp_compile/side_outputs.py).

As fsdp_compile/hf.py, nothing here imports transformers: it is looked for among the modules
already imported, and a program without HF models pays nothing.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

__all__ = [
    "is_cache",
    "cache_empty_at",
    "unanswered_layer",
    "holds_states_at",
    "stand_in_spec",
    "is_stand_in_spec",
    "spec_layer",
    "stand_in",
    "cache_writes",
    "replay_cache_write",
]

_SPEC = "mfsdp:cache-stand-in"


def _cache_utils() -> types.ModuleType | None:
    return sys.modules.get("transformers.cache_utils")


def is_cache(value: object) -> bool:
    caches = _cache_utils()
    return caches is not None and isinstance(value, caches.Cache)


def cache_empty_at(cache: Any, layers: tuple[int, ...]) -> bool:
    """Whether ``cache`` is one the stand-in can take the place of (HF's ``DynamicCache``, or an
    encoder-decoder pair of them, with layers of the kinds it answers for at ``layers``)
    holding nothing yet for ``layers`` (traced in the step: HF's own accessors, whose answers
    Dynamo guards on)."""
    parts = _dynamic_parts(cache)
    if parts is None or unanswered_layer(cache, layers) is not None:
        return False
    if len(parts) == 2:
        return all(_holds_nothing(parts[0], layer) and not cache.is_updated.get(layer) for layer in layers)
    return all(_holds_nothing(cache, layer) for layer in layers)


def holds_states_at(cache: Any, layers: tuple[int, ...]) -> bool:
    """Whether ``cache`` is one the stand-in could take the place of, but holds states for
    ``layers`` already (a decoding step, a prefill's later chunk, a prefix passed in). Traced
    in the step: ``cache_empty_at`` is False for it, as for a cache the stand-in cannot take."""
    return _dynamic_parts(cache) is not None and unanswered_layer(cache, layers) is None and not cache_empty_at(cache, layers)


def unanswered_layer(cache: Any, layers: tuple[int, ...]) -> str | None:
    """The class of ``cache``'s layer at ``layers`` that the stand-in does not answer for, if
    any: HF's layers of linear attention and state-space models (Qwen3.5's, Qwen3-Next's,
    Mamba's, Falcon-H1's and other hybrids') and of a sparse attention's indexer
    (DeepSeek-V3.2's) take calls of their own (``update_conv_state``, ``update_indexer``...),
    whose answers HF's layer computes from its state; the stand-in answers ``update`` alone."""
    caches = _cache_utils()
    answered = tuple(getattr(caches, name) for name in _ANSWERED_LAYERS if hasattr(caches, name))
    for part in _dynamic_parts(cache) or ():
        for layer in layers:
            # A layer not made yet is made as a DynamicLayer (a cache built without a config).
            if layer < len(part.layers) and type(part.layers[layer]) not in answered:
                return type(part.layers[layer]).__name__
    return None


_ANSWERED_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer")
"""HF's cache layers the stand-in answers for while they hold nothing: ``update`` returns the
states it is given, ``get_seq_length`` 0 (``DummyLayer``, a layer reusing earlier layers'
keys and values, holds none)."""


def _dynamic_parts(cache: Any) -> tuple | None:
    """The ``DynamicCache`` s the stand-in takes the place of: ``cache`` itself, or an
    encoder-decoder cache's two parts; None for a cache of another class. Exactly HF's
    classes: a subclass has methods of its own (MiniMax's linear-attention cache), which the
    stand-in does not answer."""
    caches = _cache_utils()
    parts = (cache.self_attention_cache, cache.cross_attention_cache) if type(cache) is caches.EncoderDecoderCache else (cache,)
    return parts if all(type(part) is caches.DynamicCache for part in parts) else None


def _holds_nothing(cache: Any, layer: int) -> bool:
    """Whether a ``DynamicCache`` holds no states for ``layer``: none yet, or a layer that keeps
    none, HF's ``DummyLayer`` (Gemma 4's layers reusing earlier layers' keys and values), whose
    ``get_seq_length`` HF's cache calls but which has none."""
    entries = getattr(cache, "layers", ())
    if layer < len(entries) and isinstance(entries[layer], getattr(_cache_utils(), "DummyLayer", ())):
        return True
    return cache.get_seq_length(layer) == 0


def stand_in_spec(cache: Any, layer: int) -> tuple:
    """A constant naming the stand-in for ``cache`` and the block's layer (its fake run is
    the block's own, and its writes go to that layer)."""
    kind = "encoder_decoder" if isinstance(cache, _cache_utils().EncoderDecoderCache) else "dynamic"
    return (_SPEC, kind, layer)


def is_stand_in_spec(value: object) -> bool:
    return type(value) is tuple and len(value) == 3 and value[0] == _SPEC


def spec_layer(spec: tuple) -> int:
    return spec[2]


def stand_in(spec: tuple) -> Any:
    """A fresh stand-in for the spec's cache: it returns what it is given and records it."""
    dynamic, encoder_decoder = _stand_in_classes()
    return encoder_decoder() if spec[1] == "encoder_decoder" else dynamic()


def cache_writes(stand_in: Any) -> list[tuple[str, tuple]]:
    """What a stand-in recorded, as (part of the cache, values) in the order to make them:
    ``""`` a write of (keys, values), ``"self"`` / ``"cross"`` one into an encoder-decoder
    cache's part, ``"updated"`` its cross-attention marked filled. At the block's one layer:
    the stand-in does not record the layer it is told, which would make Dynamo specialise the
    body on it (NOTE: HF caches in a repeated block)."""
    _, encoder_decoder = _stand_in_classes()
    if isinstance(stand_in, encoder_decoder):
        return [
            *(("self", kv) for kv in stand_in.self_attention_cache.writes),
            *(("cross", kv) for kv in stand_in.cross_attention_cache.writes),
            *(("updated", ()) for _ in range(stand_in.is_updated.marked)),
        ]
    return [("", kv) for kv in stand_in.writes]


def replay_cache_write(cache: Any, part: str, layer: int, values: tuple) -> None:
    """Make a recorded write on the user's cache (traced in the step)."""
    if part == "updated":
        cache.is_updated[layer] = True
    elif part == "":
        cache.update(*values, layer)
    else:
        (cache.self_attention_cache if part == "self" else cache.cross_attention_cache).update(*values, layer)


@functools.cache
def _stand_in_classes() -> tuple[type, type]:
    caches = _cache_utils()

    class DynamicStandIn(caches.DynamicCache):
        """Empty, and stays so: ``update`` returns the states it is given (what an empty layer
        returns) and records them; it never reads the layer, so a body traced for one layer
        serves the others."""

        def __init__(self) -> None:  # noqa: D107 (nothing of DynamicCache's state is used)
            self.writes: list[tuple] = []

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self.writes.append((key_states, value_states))
            return key_states, value_states

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

    class NothingUpdated(dict):
        """An encoder-decoder cache's ``is_updated``: nothing filled yet; what is marked is
        recorded."""

        def __init__(self) -> None:
            super().__init__()
            self.marked = 0

        def get(self, layer, default=None):
            return False

        def __getitem__(self, layer):
            return False

        def __setitem__(self, layer, value):
            self.marked += 1

    class EncoderDecoderStandIn(caches.EncoderDecoderCache):
        """Two recording stand-ins, for self- and cross-attention."""

        def __init__(self) -> None:  # noqa: D107
            self.self_attention_cache = DynamicStandIn()
            self.cross_attention_cache = DynamicStandIn()
            self.is_updated = NothingUpdated()

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

    return DynamicStandIn, EncoderDecoderStandIn
