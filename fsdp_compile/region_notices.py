"""What a repeated block's wrapper (regions.py) says, each once per block class and cause:
why a call of it is traced inline in the step rather than handed to its compiled body, and
why a block compiled by another backend gathers as it does. Said while Dynamo traces (run,
not traced, by it) or while ``fully_shard`` lays a block out; Python's warnings keep the
first of each message."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch._dynamo.symbolic_convert import InstructionTranslator

__all__ = [
    "say_inline", "say_cache_layer_inline", "say_cache_states_inline", "say_shared_inline", "say_tensor_parallel_inline", "say_dtensor_inline",
    "say_another_backend",
]


@torch._dynamo.assume_constant_result
def say_inline(block: str, argument: str) -> None:
    """Said once per block class and argument type (Python's warnings keep the first)."""
    warnings.warn(
        f"a repeated {block} is called with a {argument}, which mfsdp cannot hand to the "
        "block's compiled body (only tensors, None, numbers, strings, dtypes, devices and "
        "HF's DynamicCache and EncoderDecoderCache go through): each such call is traced "
        "inline in the step, as with options={'regional': False}, and compile time grows with "
        "depth. Pass the values the block reads from it instead (tensors or constants).",
        stacklevel=2,
    )


@torch._dynamo.assume_constant_result
def say_cache_layer_inline(block: str, cache: str, layer: str) -> None:
    """Said once per block class and cache layer class (Python's warnings keep the first)."""
    warnings.warn(
        f"a repeated {block} is called with HF's {cache} holding a {layer} for its layer, "
        "whose calls mfsdp cannot hand to the block's compiled body (it hands over a cache's keys and values "
        "only): each such call is traced inline in the step, as with "
        "options={'regional': False}, and compile time grows with depth. To train, call the "
        "model with use_cache=False (or set model.config.use_cache = False before compiling): "
        "HF then builds no cache, which training does not read, and each layer is one call of "
        "the compiled body.",
        stacklevel=2,
    )


@torch._dynamo.assume_constant_result
def say_cache_states_inline(block: str, cache: str) -> None:
    """Said once per block class and cache class (Python's warnings keep the first)."""
    warnings.warn(
        f"a repeated {block} is called with HF's {cache} already holding keys and values for its "
        "layer (a decoding step, a prefill's later chunk, a prefix passed in): the block's compiled "
        "body takes a cache only while it holds nothing for the layer, so each such call is traced "
        "inline in the step, as with options={'regional': False}, at eager's results, and compile "
        "time grows with depth (and with each new length). To decode, call the model fully_shard "
        "returned, uncompiled (model.generate(...) on the compiled one does).",
        stacklevel=2,
    )


def say_shared_inline(block: str, parameter: str) -> None:
    """Said once per block class and parameter (Python's warnings keep the first)."""
    warnings.warn(
        f"{parameter!r} of the repeated {block} blocks is also held outside each block (a "
        "weight shared between layers): a block's compiled body takes only weights of "
        "its own, so these blocks are traced inline in the step, as with "
        "options={'regional': False}, at eager's results, and compile time grows with depth.",
        stacklevel=3,
    )


def say_tensor_parallel_inline(block: str, module: str) -> None:
    """Said once per block class (Python's warnings keep the first)."""
    warnings.warn(
        f"{module!r} in the repeated {block} blocks has tensor parallelism's hooks and others: "
        "a block's compiled body runs the former and records the latter, not both on one "
        "module, so these layers are traced inline in the step, as with "
        "options={'regional': False}, and compile time grows with depth. Put the other hooks "
        "on a module without tensor-parallel ones (its parent, a child).",
        stacklevel=3,
    )


@torch._dynamo.assume_constant_result
def say_dtensor_inline(block: str) -> None:
    """Said once per block class (Python's warnings keep the first)."""
    warnings.warn(
        f"a repeated {block} is called with a DTensor of symbolic sizes (sequence parallelism "
        "keeps the residual stream one, and the step was compiled with dynamic shapes), or "
        "one still a masked partial sum (a vocabulary-parallel embedding's output before its "
        "reduction): a block's compiled body reads it again from its local tensor, global "
        "shape and placements, which a symbolic size or a call's own mask cannot give, so each "
        "such call is traced inline in the step, as with options={'regional': False}, and "
        "compile time grows with depth. Compile with dynamic=False (each new length compiles "
        "the step again), and reduce the embedding's output before the blocks, to keep one body.",
        stacklevel=2,
    )


@torch._dynamo.assume_constant_result
def say_another_backend(block: str) -> None:
    """Said once per block class and ``torch.compile`` call (NOTE: a block compiled by another
    backend, in gathered_reads.py): the backend object Dynamo compiles for keeps which it said,
    as Python's own once-only filter forgets whenever a compile enters
    ``warnings.catch_warnings``."""
    backend = InstructionTranslator.current_tx().output.compiler_fn
    said = getattr(backend, "_mfsdp_said_another_backend", None)
    if said is None:
        said = set()
        with contextlib.suppress(AttributeError):  # an object without attributes of its own says each time
            backend._mfsdp_said_another_backend = said
    if block in said:
        return
    said.add(block)
    warnings.warn(
        f"a repeated {block} of a sharded model is traced by Dynamo for a backend other than mfsdp "
        "(layer.compile() or torch.compile(model) with its default backend, as with FSDP2): it trains "
        "at parity, compiled once for all the layers, but gathers each of a layer's weights with a "
        "collective of its own, in the layer's frame, with no prefetch. For one gather per block, "
        "overlapped with compute, compile the model with torch.compile(model, backend=\"mfsdp\") "
        "and leave its layers uncompiled.",
        stacklevel=2,
    )
