"""Reading a sharded attribute in a forward returns the parameter gathered: the class swap and
the getter, which calls the ``unshard`` marker (its accumulation state: accumulation.py).

``fully_shard`` swaps a module's class for a generated subclass whose property for each sharded
name returns ``unshard(param.to_local())`` (see NOTE: why markers, in docs/design.md); a repeated
block's body (regions.py) calls the same marker for the weights it gathers.

NOTE: reads outside a forward
    Between steps a read returns the parameter itself, the sharded DTensor, as under FSDP2:
    what a program does there writes the parameter (``nn.init.normal_(module.weight)`` in a
    model's ``init_weights`` after ``to_empty``, ``module.weight.requires_grad = False``), and
    on a gathered copy it would be lost without a word. A read is a forward's while any
    module's call runs (the model's, a submodule's called on its own: HF's ``generate`` calls
    an encoder-decoder's encoder so; a hook's), while autograd runs a backward (a
    checkpointed module recomputed), and whenever Dynamo traces. The call is found on the
    stack rather than counted by hooks: no count to leave unbalanced by a forward that
    raises or is interrupted, and nothing for Dynamo to trace at each module.
"""

from __future__ import annotations

import copy
import functools
import sys
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compile.accumulation import ACCUMULATION_METHODS, marker_args, read_state, unshard_marker
from fsdp_compile.backend import compiling_backend
from fsdp_compile.compat import local_rows
from fsdp_compile.errors import UsageError
from fsdp_compile.float8 import float8_weight
from fsdp_compile.fsdp2_methods import FSDP2_METHODS
from fsdp_compile.hf_methods import hf_methods
from fsdp_compile.records import ShardInfo, shard_info
from fsdp_compile.state_dicts import load_into_shards, save_picklable_entries


__all__ = ["install_properties", "float8_read", "gather", "in_a_forward", "copied_module", "traced_by_mfsdp"]


# NOTE: a block compiled by another backend
#     FSDP2's users compile each block (``for layer in model.layers: layer.compile()``) and
#     expect one compile for all the layers, as an unsharded model gets. Dynamo guards the
#     constants a frame reads: a parameter's id (only mfsdp's passes use it) and a repeated
#     block's key differ in every layer, so each layer compiled again, and past
#     ``recompile_limit`` (8) the later layers ran uncompiled. Traced for another backend, a
#     read gives the marker the id -1 and a repeated block runs its own forward (regions.py),
#     its flats' members read one by one: the frame reads only what its layers share. (A
#     function of the user's around mfsdp looks like another backend; mfsdp's planner then
#     refuses the unnamed reads, naming the fix.) Such a read accumulates without sync into
#     an accumulator of its own, whose sums are reduced as sync turns on (accumulation.py),
#     so the read finds none to take: a checkpoint recomputing the block's frame would find
#     a sum its forward's read took gone and trace a graph that saves other tensors.


@torch._dynamo.assume_constant_result
def traced_by_mfsdp() -> bool:
    """Whether Dynamo traces the current frame for mfsdp (run, not traced, by Dynamo); False
    outside a trace."""
    return compiling_backend() is not None


def float8_read(gathered: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """A gathered float8 weight (``info``'s) as its float8 wrapper; any other as it is."""
    if info.float8 is None:
        return gathered
    group = info.tensor_parallel.group_name if info.tensor_parallel else ""
    return float8_weight(gathered, info.float8, info.param_dtype, group)


def gather(param: nn.Parameter, info: ShardInfo) -> torch.Tensor:
    """``param`` (its sharding record ``info``) gathered for use: the ``unshard`` marker, then,
    for a float8 weight, its float8 wrapper, and for a tensor-parallel one, its DTensor."""
    try:
        # See NOTE: a block compiled by another backend.
        anonymous = -1 if torch.compiler.is_compiling() and not traced_by_mfsdp() else None
        constants = marker_args(info, param.dtype, param_id=anonymous)
        local, state = local_rows(param), read_state(param, info)
        if state.get("anonymous" if anonymous is not None else "accumulator") is not None:
            # Its gradient goes to the accumulator alone. Left attached, autograd would run the
            # weight's post-accumulate-grad hooks (with .grad None) in a micro-batch without
            # sync, which FSDP2 does not, and another backend's AOTAutograd on torch 2.11
            # hands the shard the missing gradient as zeros, where the unsharded model's .grad
            # stays None.
            local = local.detach()
        read = unshard_marker(local, constants, state, anonymous=anonymous is not None)
        gathered = float8_read(read, info)
        return gathered if info.tensor_parallel is None else info.tensor_parallel.read(gathered)
    except AttributeError as error:
        # An AttributeError escaping a property makes Python fall back to
        # nn.Module.__getattr__, which would silently hand the *shard* to the caller.
        raise RuntimeError(f"gathering parameter {info.fqn} failed: {error}") from error


# A module's call runs through this frame, eagerly or compiled (``module.compile()`` too).
_MODULE_CALL = nn.Module._wrapped_call_impl.__code__


def in_a_forward() -> bool:
    """Whether a read of a sharded attribute now is a forward's (see NOTE: reads outside a
    forward): Dynamo traces, autograd runs a backward, or a module's call is on the stack."""
    if torch.compiler.is_compiling() or torch._C._current_graph_task_id() != -1:
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _MODULE_CALL:
            return True
        frame = frame.f_back
    return False


def _gathered(self: nn.Module, name: str) -> torch.Tensor:
    """What reading a sharded attribute returns: in a forward, the gathered parameter;
    outside one, the parameter (see NOTE: reads outside a forward).

    A plain tensor (not an ``nn.Parameter``) in ``_parameters`` is returned as it is: a
    repeated block's body finds there the weights its wrapper gathered (see NOTE: one body
    per repeated block, in fsdp_compile/regions.py), and ``torch.func.functional_call`` its
    substitutes.
    """
    param = self._parameters[name]
    if not isinstance(param, nn.Parameter) and isinstance(param, torch.Tensor):
        return param
    if not in_a_forward():
        return param
    info = shard_info(param)
    # isinstance and shape only: Dynamo traces this getter, and both are cheap guards for it.
    if info is None or not isinstance(param, DTensor) or tuple(param.shape) != info.dtensor_shape:
        raise UsageError(
            f"{type(self).__name__}.{name} was replaced after fully_shard (now "
            f"{type(param).__name__} of shape {tuple(param.shape)}); sharding happens once. "
            "Change the model before calling fully_shard, or copy new values into the shard "
            "(param.to_local().copy_(...))."
        )
    return gather(param, info)


# Inside a compiled frame Dynamo inlines the getter, and the marker's sizes are constants of
# that graph. Called from eager code (a frame Dynamo fell back on), the getter must run eagerly
# too: compiled as a frame of its own, its int arguments would turn symbolic after the second
# parameter and the marker would lose its static sizes.
torch._dynamo.eval_frame.skip_code(_gathered.__code__)
torch._dynamo.eval_frame.skip_code(gather.__code__)


# NOTE: converting after torch.compile
#     ``nn.Module._apply`` (``.to``, ``.cuda``, ``.float``) swaps each DTensor parameter for its
#     converted self with ``torch.utils.swap_tensors``, even when nothing changes, and
#     ``swap_tensors`` refuses a tensor anything holds a weak reference to. A step compiled by
#     mfsdp takes the sharded parameters outside the flats as graph inputs, and its compiled
#     code (kept in the traced module's globals, past ``torch.compiler.reset()``) holds the
#     fake-tensor memo that refers to them weakly (pytorch#186796). FSDP2's graphs take its
#     unsharded plain tensors, so FSDP2 does not meet it. So a parameter the conversion leaves
#     as it is (``model.to(device)`` on that device, ``.float()`` of fp32) is left out of
#     torch's loop, and a real conversion of a traced one is refused before anything changes,
#     naming the fix; flats are replaced, not swapped (``regions._refresh_params``), and their
#     members are no graph inputs, so they convert after a compile too.


def _untouched_by(module: nn.Module, fn) -> set[str]:
    """The names of ``module``'s own sharded parameters that ``fn`` leaves as they are and that
    torch could not swap (see NOTE: converting after torch.compile); raises a ``UsageError``
    if ``fn`` would convert such a parameter anywhere under ``module``."""
    untouched = set()
    with torch.no_grad():
        for name, param in module.named_parameters():
            if shard_info(param) is None or not weakref.getweakrefcount(param):
                continue
            if fn(param) is not param:
                raise UsageError(
                    f"cannot convert parameter {name} ({param.dtype}, {param.device}): a step "
                    "compiled by mfsdp traced it, and torch swaps a converted DTensor parameter "
                    "in with torch.utils.swap_tensors, which refuses a tensor the compiled code "
                    "still refers to (pytorch#186796). Move and cast the model before "
                    "torch.compile; for bf16 compute, keep fp32 parameters and pass "
                    "mp_policy=MixedPrecision(param_dtype=torch.bfloat16) to fully_shard."
                )
            if name in module._parameters:
                untouched.add(name)
    return untouched


def _reattach_shard_info(self: nn.Module, fn, recurse: bool = True):
    """``nn.Module._apply`` (``to_empty``, ``.to``, ``.cuda``, ``.float``) may wrap converted
    tensors in new Parameter objects; give them back their sharding record, for the dtype
    they are now stored in (``ShardInfo.stored_as``). A traced parameter ``fn`` leaves as it
    is stays out of torch's loop (see NOTE: converting after torch.compile)."""
    records = {name: shard_info(p) for name, p in self._parameters.items() if shard_info(p) is not None}
    held = {name: self._parameters[name] for name in _untouched_by(self, fn)}
    for name in held:  # nn.Module._apply skips a None parameter
        self._parameters[name] = None
    try:
        result = self._mfsdp_base._apply(self, fn, recurse)
    finally:
        self._parameters.update(held)
    for name, info in records.items():
        param = self._parameters[name]
        if param is not None:
            param._mfsdp = info.stored_as(param.dtype)
    return result


# NOTE: copying a sharded model
#     ``copy.deepcopy(model)`` after ``fully_shard`` (an EMA copy, ``AveragedModel(model)``)
#     gives a sharded model of its own: the same meshes and sharding, its own shards, trained
#     and compiled on its own (FSDP2 refuses to copy). Python's deepcopy, left to itself,
#     cannot copy a sharded parameter that holds a view at an offset (a flat's member; after
#     a step, a tensor-parallel one): the DTensor wrapper reports a data pointer but holds no
#     storage of its own ("invalid python storage"). And it would copy a region's bookkeeping
#     verbatim: its key (the copy's compiled calls would run the original's block) and its
#     flats (whose members are the original's). So each module with sharded parameters copies
#     them first, each as a DTensor over a clone of its shard (the memo then maps every
#     holder of a tied one to that copy), then the rest as deepcopy would; a region then
#     makes a key and flats of its own (``regions._copied_region``). Meshes and process
#     groups are shared, as DTensor's own copies share them.


def _copied_parameter(param: nn.Parameter, memo: dict) -> nn.Parameter:
    """A sharded parameter's copy, over a clone of its shard (a flat's member holds it until
    the copied region links it to a flat of its own)."""
    copied = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)  # DTensor's clone
    attributes = {k: v for k, v in param.__dict__.items() if k not in ("_is_param", "_mfsdp_flat")}
    copied.__dict__.update(copy.deepcopy(attributes, memo))
    if param.grad is not None:  # maybe a view at an offset too: a copy of its own
        copied.grad = param.grad.detach().clone()
    return copied


def copied_module(module: nn.Module, memo: dict, leave_out: tuple[str, ...] = ()) -> nn.Module:
    """``copy.deepcopy`` of a module with sharded parameters (see NOTE: copying a sharded
    model), but for the attributes ``leave_out``."""
    for param in module._parameters.values():
        if shard_info(param) is not None and id(param) not in memo:
            memo[id(param)] = _copied_parameter(param, memo)
    copied = type(module).__new__(type(module))
    memo[id(module)] = copied
    # As deepcopy does: through __getstate__, which leaves out what must not be shared (a
    # ``module.compile()``'s compiled call, bound to the original).
    state = {k: v for k, v in module.__getstate__().items() if k not in leave_out}
    copied.__setstate__(copy.deepcopy(state, memo))
    return copied


def _fsdp2_methods(base: type, held: frozenset[str]) -> dict:
    """FSDP2's ``FSDPModule`` methods for a sharded subclass of ``base`` (fsdp2_methods.py):
    those ``base`` does not define itself (a model's own ``unshard`` stays the model's) and its
    instance does not hold (``held``)."""
    return {name: method for name, method in _ALL_FSDP2_METHODS.items() if name not in held and not hasattr(base, name)}


_ALL_FSDP2_METHODS = {**FSDP2_METHODS, **ACCUMULATION_METHODS}

# One generated class per (base class, sharded names, FSDP2 names its instances hold): the
# properties read each instance's own parameters, so every block of a repeated class shares
# its classes, which lets a compiled body serve them all (see fsdp_compile/regions.py).
# Classes only: no instance state here.
_SHARDED_CLASSES: dict[tuple[type, frozenset[str], frozenset[str], bool], type] = {}


def install_properties(module: nn.Module, names: set[str], *, fsdp2_methods: bool = True) -> None:
    """Swap ``module``'s class for a subclass whose attributes ``names`` read parameters
    gathered; with ``fsdp2_methods`` False (an HF model inside, swapped for its HF methods
    alone: ``hf_methods``) without FSDP2's methods, which would act on its part only."""
    cls = module.__class__
    base = getattr(cls, "_mfsdp_base", cls)
    names = frozenset(getattr(cls, "_mfsdp_names", frozenset()) | names)
    # A child module, parameter or buffer named as a method (``self.reshard = nn.Linear``)
    # stays what the module's attribute reads: a class attribute would hide it.
    held = frozenset(n for n in (*module._modules, *module._parameters, *module._buffers) if n in _ALL_FSDP2_METHODS)
    fsdp2_methods = fsdp2_methods or getattr(cls, "_mfsdp_fsdp2_methods", False)
    if (base, names, held, fsdp2_methods) not in _SHARDED_CLASSES:
        namespace = {
            **{name: property(functools.partial(_gathered, name=name)) for name in names},
            "_mfsdp_base": base,
            "_mfsdp_names": names,
            "_mfsdp_fsdp2_methods": fsdp2_methods,
            "_apply": _reattach_shard_info,
            "_load_from_state_dict": load_into_shards,
            "_save_to_state_dict": save_picklable_entries,
            "__deepcopy__": copied_module,
            **(_fsdp2_methods(base, held) if fsdp2_methods else {}),
            **hf_methods(base),
            # Named as the user's class: libraries key registries on str(cls) (HF's output
            # recorders) and write its name down (HF's save_pretrained, config.json's
            # "architectures", which serving engines load by), and the class is the user's
            # but for the getters.
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        }
        _SHARDED_CLASSES[base, names, held, fsdp2_methods] = type(base.__name__, (base,), namespace)
    module.__class__ = _SHARDED_CLASSES[base, names, held, fsdp2_methods]
