"""What leaves a repeated block's body besides its outputs: hooks' views and cache writes.

NOTE: hooks inside a repeated block
    A block's body is a frame of its own whose call is one opaque op in the step (NOTE: one
    op per block call, in block_call.py): only its outputs reach the step's graph. A forward
    hook on a module inside the block (HF's router-logit collection for the load-balancing
    loss, a user's activation logger) sees its values in the body, where nothing it keeps
    reaches the step, its autograd or the optimizer (HF's loss then found no router logits).

    So the body runs such a module with recorders in place of its forward hooks and
    pre-hooks (``recording_hooks``): each records what the hooks would have been called with
    (the module's inputs, keyword inputs where a hook takes them, its output). What they
    recorded leaves the op as outputs of its own, and the step, right after the block's call,
    calls the module's own hooks with them (``replay``): the same values, differentiable
    through the block's backward, in the order eager would call them. A hook that returns
    something (to replace the module's input or output) cannot be called late: it is refused
    with the fix (compile with ``regional=False``, or return None). Which modules have hooks
    is part of the block's recipe, read while the step is traced, and how many hooks, not
    which ones, is part of its structure: every layer's hooks differ (a closure each) and the
    layers still share one body.

NOTE: HF caches in a repeated block
    HF's models pass a cache (``DynamicCache``, ``EncoderDecoderCache``) to every layer when
    ``use_cache`` is on, the default of every HF config: each attention stores its keys and
    values in it and attends over what it returns. A cache is no tensor, so no op takes it.
    While the cache holds nothing for the block's layers (training, the first step of
    generation), its update returns the states it was given; the body then gets a stand-in
    that does the same and records each write (fsdp_compile/hf_caches.py), the writes leave
    the op as outputs, and the step makes them on the user's cache (``replay``), at the block's layer
    (HF's ``layer_idx`` of its attention; a block naming none, or several, runs inline). The
    stand-in never reads the layer it is told: Dynamo would specialise the body on it, one
    compile per layer. A cache that already holds states for the block (generation after its
    first step) makes the call run inline, as ``regional=False`` would, and so does a cache
    of another class (MiniMax's adds linear-attention state and methods the stand-in lacks)
    or one holding, for the block, a layer of a kind the stand-in does not answer for
    (transformers 5.25's linear-attention, state-space and indexer layers take calls of their
    own, ``update_conv_state`` and the like, whose answers HF computes from the layer's
    state; ``hf_caches.unanswered_layer``). Those two are said, the last with
    ``use_cache=False`` as the fix: training reads no cache.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from fsdp_compile import hf_caches
from fsdp_compile.errors import CompileUsageError

__all__ = [
    "SideChannel", "hook_counts", "hooked_modules", "is_tensor_parallel_hook", "mixes_tensor_parallel_hooks",
    "tensor_parallel_signature", "recording_hooks", "put_back_hooks", "flatten", "replay",
    "stand_in_leaves", "stand_ins_of", "layer_indices",
]


class SideChannel:
    """A body call's records: ``(path parts, "pre" | "post", args, kwargs, output)`` per hook
    site as the modules ran (NOTE: hooks inside a repeated block)."""

    def __init__(self) -> None:
        self.records: list[tuple] = []


def hook_counts(module: nn.Module) -> tuple:
    """What a module's forward hooks contribute to its block's structure: their numbers and
    which take keyword inputs, not the hooks themselves (they are replayed, not traced)."""
    return (
        len(module._forward_pre_hooks), len(module._forward_hooks),
        bool(module._forward_pre_hooks_with_kwargs), bool(module._forward_hooks_with_kwargs),
    )


def hooked_modules(block: nn.Module) -> tuple[tuple[tuple[str, ...], bool, bool], ...]:
    """The modules inside ``block`` (not the block: its hooks run in the step) with forward
    hooks or pre-hooks the body records, as path parts, and whether any of them takes keyword
    inputs. Tensor parallelism's hooks run in the body (NOTE: tensor-parallel blocks, in
    region_body.py): a module with only those is not listed."""
    return tuple(
        (tuple(path.split(".")), bool(m._forward_pre_hooks_with_kwargs), bool(m._forward_hooks_with_kwargs))
        for path, m in block.named_modules()
        if path and not all(map(is_tensor_parallel_hook, (*m._forward_pre_hooks.values(), *m._forward_hooks.values())))
    )


_TENSOR_PARALLEL_HOOKS = ("torch.distributed.tensor._api", "torch.distributed.tensor.parallel.style")
"""Where torch defines the hooks ``parallelize_module`` installs: ``distribute_module``'s
(ColwiseParallel, RowwiseParallel, SequenceParallel) and the ``PrepareModule*`` styles'."""


def is_tensor_parallel_hook(hook: Callable) -> bool:
    """A forward hook or pre-hook a ``parallelize_module`` style installed: it turns the
    module's inputs or outputs into (or out of) DTensors on the tensor-parallel mesh."""
    return getattr(hook, "__module__", None) in _TENSOR_PARALLEL_HOOKS


def mixes_tensor_parallel_hooks(module: nn.Module) -> bool:
    """Tensor parallelism's hooks and others on one module: the body can neither record them
    all (tensor parallelism's replace inputs and outputs) nor run them all."""
    kinds = set(map(is_tensor_parallel_hook, (*module._forward_pre_hooks.values(), *module._forward_hooks.values())))
    return kinds == {True, False}


def tensor_parallel_signature(module: nn.Module) -> tuple:
    """What ``module``'s tensor-parallel hooks do, for its block's structure: per hook, its code
    and what it closes over (the style's function and layouts, the mesh). The body traces
    these hooks; two layers split alike share it, two split otherwise do not."""
    return tuple(
        (hook.__code__, tuple(_closed_over(cell.cell_contents) for cell in hook.__closure__ or ()))
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
        if is_tensor_parallel_hook(hook)
    )


def _closed_over(value: Any) -> Any:
    if isinstance(value, functools.partial):  # distribute_module's input or output function
        value = (value.func, value.args, tuple(sorted(value.keywords.items())))
    elif isinstance(value, ParallelStyle):  # a PrepareModule* style: its layouts say what it does
        value = (type(value), repr(value))
    try:
        hash(value)
    except TypeError:  # layouts given as a dict (PrepareModuleInput's keyword layouts)
        return repr(value)
    return value


def recording_hooks(block: nn.Module, hooked: tuple, side: SideChannel) -> list[tuple]:
    """Give each hooked module of ``block`` recorders in place of its forward hooks (traced
    in the body's frame); returns what to put back (``put_back_hooks``)."""
    held = []
    for parts, pre_kwargs, post_kwargs in hooked:
        module = block
        for part in parts:
            module = module._modules[part]
        held.append((module, module._forward_pre_hooks, module._forward_hooks,
                     module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs))
        module._forward_pre_hooks = collections.OrderedDict({0: _recorder(side, parts, "pre", pre_kwargs)})
        module._forward_hooks = collections.OrderedDict({0: _recorder(side, parts, "post", post_kwargs)})
        # Every recorder takes keyword inputs; it keeps them only where a hook reads them.
        module._forward_pre_hooks_with_kwargs = {0: True}
        module._forward_hooks_with_kwargs = {0: True}
    return held


def put_back_hooks(held: list[tuple]) -> None:
    for module, pre, post, pre_kwargs, post_kwargs in held:
        module._forward_pre_hooks, module._forward_hooks = pre, post
        module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs = pre_kwargs, post_kwargs


def _recorder(side: SideChannel, parts: tuple, kind: str, keep_kwargs: bool) -> Callable:
    if kind == "pre":
        def record(module, args, kwargs):
            side.records.append((parts, kind, args, kwargs if keep_kwargs else None, None))
    else:
        def record(module, args, kwargs, output):
            side.records.append((parts, kind, args, kwargs if keep_kwargs else None, output))
    return record


# ---- out of the op and back: records as tensors and a form ---------------------------------------


def flatten(side: SideChannel, stand_ins: dict[int, Any]) -> tuple[tuple, list[Tensor]]:
    """A call's side values as (form, tensors): the hook records in order, then each cache
    stand-in's writes (``stand_ins``: by the leaf position of the user's cache). The form
    holds the constants and where the tensors go; equal forms regroup alike."""
    tensors: list[Tensor] = []
    form = []
    for parts, kind, args, kwargs, output in side.records:
        form.append(("hook", parts, kind, _encode(args, tensors), _encode(kwargs, tensors), _encode(output, tensors)))
    for at, (stand_in, layer) in stand_ins.items():
        for part, values in hf_caches.cache_writes(stand_in):
            form.append(("cache", at, part, layer, _encode(values, tensors)))
    return tuple(form), tensors


def _encode(value: Any, tensors: list[Tensor]) -> tuple:
    if isinstance(value, Tensor):
        tensors.append(value)
        return ("t",)
    if type(value) in (tuple, list):
        return (type(value).__name__, tuple(_encode(v, tensors) for v in value))
    if type(value) is dict:
        return ("dict", tuple((k, _encode(v, tensors)) for k, v in value.items()))
    if hf_caches.is_cache(value):
        raise CompileUsageError(
            "a hook inside a repeated block takes a cache among its keyword inputs: it is called "
            "after the block (NOTE: hooks inside a repeated block), when the cache is the "
            "step's. Register it without with_kwargs, or compile with options={'regional': False}."
        )
    return ("c", value)


def _decode(form: tuple, tensors) -> Any:
    kind = form[0]
    if kind == "t":
        return next(tensors)
    if kind == "c":
        return form[1]
    if kind == "dict":
        return {k: _decode(v, tensors) for k, v in form[1]}
    values = [_decode(v, tensors) for v in form[1]]
    return tuple(values) if kind == "tuple" else values


def replay(block: nn.Module, form: tuple, tensors: list[Tensor], leaves: tuple) -> None:
    """After the block's call, in the step (traced): its modules' own hooks called with what
    the body recorded, and each cache write made on the user's cache (``leaves[at]``)."""
    values = iter(tensors)
    for record in form:
        if record[0] == "hook":
            _, parts, kind, args, kwargs, output = record
            module = block
            for part in parts:
                module = module._modules[part]
            _call_hooks(module, kind, _decode(args, values), _decode(kwargs, values), _decode(output, values))
        else:
            _, at, part, layer, written = record
            hf_caches.replay_cache_write(leaves[at], part, layer, _decode(written, values))


def _call_hooks(module: nn.Module, kind: str, args: tuple, kwargs: dict | None, output: Any) -> None:
    hooks = module._forward_pre_hooks if kind == "pre" else module._forward_hooks
    with_kwargs = module._forward_pre_hooks_with_kwargs if kind == "pre" else module._forward_hooks_with_kwargs
    for hook_id, hook in hooks.items():
        if kind == "pre":
            result = hook(module, args, kwargs) if hook_id in with_kwargs else hook(module, args)
        else:
            result = hook(module, args, kwargs, output) if hook_id in with_kwargs else hook(module, args, output)
        if result is not None:
            _refuse_replacing_hook(type(module).__name__, kind)


@torch._dynamo.assume_constant_result
def _refuse_replacing_hook(module: str, kind: str) -> None:
    raise CompileUsageError(
        f"a forward {'pre-' if kind == 'pre' else ''}hook on a {module} inside a repeated block "
        f"returned a value, to replace the module's {'input' if kind == 'pre' else 'output'}: "
        "mfsdp calls such hooks after the block's compiled body (NOTE: hooks inside a repeated "
        "block), too late to change it. Return None from the hook, or compile with "
        "options={'regional': False}."
    )


def stand_in_leaves(leaves: tuple, block_layers: tuple[int, ...]) -> tuple[tuple, bool]:
    """``leaves`` with each user cache replaced by its stand-in's spec (a constant), and
    whether every cache could be (see NOTE: HF caches in a repeated block): the block names
    one cache layer (HF's ``layer_idx``), for which the cache holds nothing yet. Traced in
    the step."""
    if len(block_layers) != 1:
        return leaves, False
    replaced = []
    for leaf in leaves:
        if hf_caches.is_cache(leaf):
            if not hf_caches.cache_empty_at(leaf, block_layers):
                return leaves, False
            replaced.append(hf_caches.stand_in_spec(leaf, block_layers[0]))
        else:
            replaced.append(leaf)
    return tuple(replaced), True


def stand_ins_of(constants: tuple[tuple, ...]) -> dict[int, tuple[Any, int]]:
    """A fresh stand-in, with the layer its writes go to, for each leaf whose constant is a
    stand-in spec, by leaf position."""
    return {
        at: (hf_caches.stand_in(c[0]), hf_caches.spec_layer(c[0])) for at, c in enumerate(constants) if c and hf_caches.is_stand_in_spec(c[0])
    }


def layer_indices(block: nn.Module) -> tuple[int, ...]:
    """The cache layers a block writes, as HF's layers name them (``layer_idx``)."""
    return tuple(sorted({m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)}))
