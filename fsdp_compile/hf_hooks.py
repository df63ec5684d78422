"""HF's own hooks, as the prelude meets them (NOTE: HF's value-dependent decisions, in
fsdp_compile/hf.py): the output-capturing hooks HF installs lazily inside a forward, the
``requires_grad_()`` hook HF's checkpointing puts on the input embeddings, and the other
writes a layer makes outside its call, which a checkpoint's recompute may skip.

As fsdp_compile/hf.py, nothing here imports transformers: it is looked for among the modules
already imported.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from typing import Any

from torch import nn

__all__ = ["install_output_hooks", "say_input_require_grads", "writes_outside_its_call"]

_REQUIRE_GRADS_HOOK = "enable_input_require_grads.<locals>.make_inputs_require_grads"


def writes_outside_its_call(module: nn.Module) -> bool:
    """Whether ``module``'s call writes to state outside it that a checkpoint's recompute
    would write again to no effect (NOTE: HF's value-dependent decisions, in hf.py): HF's
    ``kernels`` routing wrapper, which leaves ``_kernel_funcs`` on the instance it wraps, or
    an attention layer storing its keys and values in HF's ``KVSharingDict`` for the later
    layers that reuse them (``store_full_length_kv``: Gemma 3n and 4)."""
    attributes = vars(module)
    return "_kernel_funcs" in attributes or attributes.get("store_full_length_kv") is True


def say_input_require_grads(model: nn.Module) -> None:
    """Say, once, that HF's ``enable_input_require_grads`` hook on frozen input embeddings
    breaks the graph, with the fix (HF's hook is a no-op Dynamo traces unless the
    embeddings are frozen)."""
    if not hasattr(model, "_require_grads_hooks"):  # never enabled (HF sets [] when disabled)
        return
    embeddings = model.get_input_embeddings()
    if not isinstance(embeddings, nn.Module) or any(p.requires_grad for p in embeddings.parameters()):
        return
    hooks = [h for h in embeddings._forward_hooks.values() if getattr(h, "__qualname__", "").endswith(_REQUIRE_GRADS_HOOK)]
    if not hooks:
        return
    # HF keeps the handles of the last enabling only: enabled twice, one hook stays.
    forgotten = len(hooks) - len(getattr(model, "_require_grads_hooks", None) or ())
    warnings.warn(  # once: Python's default warning filter keeps the first of a message
        f"{type(model).__name__}.enable_input_require_grads() (HF's checkpointing and PEFT call "
        "it) calls requires_grad_() on the output of the frozen input embeddings inside the "
        "compiled forward, where Dynamo breaks the graph: the layers then run outside mfsdp's "
        "compiled step. Non-reentrant checkpointing (use_reentrant=False, HF's default) needs "
        "no input that requires a gradient: there, call model.disable_input_require_grads() "
        "after enabling checkpointing."
        + (
            " Here it was enabled twice (PEFT's get_peft_model enables it again on a model "
            "already checkpointing), and HF removes only the last one's hook: enable "
            "checkpointing after get_peft_model, on the PEFT model, then disable it."
            if forgotten > 0 else ""
        ),
        stacklevel=5,
    )


def install_output_hooks(models: list[nn.Module], arguments: dict) -> bool:
    """HF's output-capturing hooks, on each of the HF ``models`` whose outputs this call
    asks for (``output_router_logits=True`` by argument or config), as HF's ``capture_outputs``
    would install them at its first such call, inside the traced forward; whether the call
    asks for any."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    install = getattr(capturing, "maybe_install_capturing_hooks", None)
    if registry is None or install is None:
        return False
    asked = False
    for module in models:
        # Keyed by the class's string in every 5.x (a plain dict before 5.24).
        flags = dict.get(registry, str(module.__class__)) or {}
        config = getattr(module, "config", None)
        if any(arguments.get(f"output_{key}", getattr(config, f"output_{key}", False)) for key in flags):
            asked = True
            # Only where HF installs them: an outer model installing them again over its base
            # model would hook each layer twice (twice the hidden states) when HF already did.
            if _captures_outputs(module, capturing):
                install(module)  # once: HF marks the model
    return asked


def _captures_outputs(model: nn.Module, capturing: types.ModuleType) -> bool:
    """Whether ``model``'s forward is wrapped by HF's ``capture_outputs``, which installs the
    hooks on the model whose forward it wraps."""
    wrappers = _nested_code(getattr(capturing, "capture_outputs", None))
    forward = type(model).forward
    while forward is not None:
        if getattr(forward, "__code__", None) in wrappers:
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


@functools.cache
def _nested_code(function: Any) -> frozenset[types.CodeType]:
    """The code objects defined inside ``function`` (its decorator's wrappers), at any depth."""
    found, todo = set(), [getattr(function, "__code__", None)]
    while todo:
        code = todo.pop()
        for const in code.co_consts if code is not None else ():
            if isinstance(const, types.CodeType):
                found.add(const)
                todo.append(const)
    return frozenset(found)
