"""Repeated blocks compiled once: each block's forward becomes a gather, then one shared body.

NOTE: one body per repeated block
    Dynamo, AOTAutograd, the partitioner and Inductor all cost time per traced op, so a
    whole-model graph takes time linear in depth. A block that read its sharded parameters
    through our markers inside its body could not be shared by the layers either: each
    marker carries its parameter's id, and the collectives would be hidden inside the body,
    out of reach of bucketing and prefetch. So ``fully_shard`` gives every repeated block (two
    or more children of one class in an ``nn.ModuleList`` / ``nn.Sequential``, outermost only)
    a forward in two parts:

    - in the caller's graph, every sharded parameter of the block is gathered: the block's
      shards lie in flat parameters (NOTE: flat parameters, in flat_params.py), one marker
      each, and a parameter that fits no flat has a marker of its own (read from a dict on
      the block rather than through its submodules: one graph input each, no module walk);
    - the body runs the block's own forward on each flat's members, copied out of it
      (``split_gathered``: inline by the body itself, ``_region_inline``; around the body's
      frame by its block call, NOTE: a flat's copies in the block call, in block_call.py),
      put in place of its parameters: stored into each owning submodule's ``_parameters``
      and put back after, in the body's own frame (``_stored_in``), or, run eagerly or
      traced inline, with ``torch.nn.utils.stateless._reparametrize_module``, which Dynamo
      accepts inside a higher-order op (``_reparametrized``); the getters return such plain
      tensors as they are (``api._gathered``).

    Compiled by mfsdp, the body is one ``fsdp_compile::block_forward`` node per layer in the
    step's graph, and runs as a Dynamo frame of its own, compiled once per structure and
    guarded at every call (NOTE: one op per block call, in block_call.py). Run eagerly, or
    compiled with ``options={"regional": False}``, the body is called directly: the whole
    graph holds every layer. Generated classes are shared per base class
    (``api._install_properties``) and the body takes only what is the same for every layer
    (the block, constants, tensors), so one compiled body serves every layer whose guards it
    passes; a layer that differs in anything the body reads fails them and gets a compile of
    its own.

NOTE: structure before guards
    Dynamo's guards miss two things a layer can differ in: a hook on one layer only (Dynamo
    does not guard module hooks by default) and, for a submodule reached through a module
    it has already met, its class. A body compiled for layer 0 would then run for such a
    layer, with wrong numbers and no error (tests/test_regions.py holds both). So blocks are
    first told apart by ``structure``: each structure gets a body function of its own
    (``_body_for``, run while tracing), with a code object, a frame cache and a traced
    output layout of its own, and Dynamo's guards only ever choose among blocks alike in
    structure.
"""

from __future__ import annotations

import functools
import itertools
import operator
import types
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from fsdp_compile import hf
from fsdp_compile.api import marker_args, next_param_id, shard_info, unshard_marker
from fsdp_compile.block_call import BLOCK_FORWARD, BLOCK_GRADED, BlockCall, FlatCopy, call_record, register_call
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.flat_params import check_linked, converted_flat, flat_groups, make_flat, note_graded
from fsdp_compile.side_outputs import (
    SideChannel,
    hook_counts,
    hooked_modules,
    layer_indices,
    put_back_hooks,
    recording_hooks,
    replay,
    stand_in_leaves,
)

__all__ = ["install_regions", "is_region", "RegionLayout"]


@dataclass(frozen=True)
class RegionLayout:
    """What a repeated block's wrapper gathers, and in which order its body takes it."""

    owners: tuple[tuple[str, tuple[str, ...]], ...]
    """(submodule path relative to the block, its parameter names), per owning submodule: the
    body's weights in this order, one per name (a parameter tied within the block has two)."""
    flats: tuple[tuple[str, ...], ...]
    """Each flat parameter's members (NOTE: flat parameters), as paths relative to the block."""
    alone: tuple[str, ...]
    """Parameters gathered on their own, as paths relative to the block."""
    slots: tuple[int, ...]
    """For each of the body's weights, its index among the gathered values: every flat's
    members in order, then the parameters on their own."""

    def paths(self) -> tuple[str, ...]:
        """The gathered values' parameter paths, in the order ``slots`` indexes."""
        return tuple(p for members in self.flats for p in members) + self.alone


def is_region(module: nn.Module) -> bool:
    return getattr(module, "_mfsdp_region", None) is not None


def _region_forward(self: nn.Module, *args, **kwargs):
    # The markers' constants come from one call Dynamo runs rather than traces: read field by
    # field from each ShardInfo, they were a guard each (28% of Dynamo's time on an HF Llama,
    # A B A B).
    flats, alone, recipe = _gather_recipe(self._mfsdp_region_key)
    gathered = [unshard_marker(f, c) for f, c in zip(self._mfsdp_region_flats.values(), flats)]
    if alone:
        gathered += [unshard_marker(p.to_local(), c) for p, c in zip(self._mfsdp_region_params.values(), alone)]
    # The body takes flat leaves only (the block, constants, tensors, None...), the same for
    # every layer: a frame of its own guards on each argument. Tuples are opened one level
    # (HF's position_embeddings); one constant says how to regroup. Dynamo steps through this
    # at every layer, so it is made of what Dynamo runs natively (map over builtins, slices,
    # getitem) and of functions it runs rather than traces: with a loop over the arguments
    # this wrapper cost 438 stepped instructions a layer on an HF Llama, now 196.
    values = (*args, *kwargs.values())
    opened = tuple(map(operator.is_, map(type, values), itertools.repeat(tuple)))  # not a namedtuple
    leaves, sizes = values, ()
    for at in _opened_at(opened):  # the last first: the earlier positions stay where they are
        sizes += (len(values[at]),)
        leaves = leaves[:at] + values[at] + leaves[at + 1 :]
    is_tensor = tuple(map(isinstance, leaves, itertools.repeat(torch.Tensor)))
    given, stood_in = leaves, True
    if any(map(hf.is_cache, leaves)):  # see NOTE: HF caches in a repeated block
        leaves, stood_in = stand_in_leaves(leaves, _layers_of(self._mfsdp_region_key))
    layout, tensor_at, constant_at = _call_layout(len(args), tuple(kwargs), len(gathered), opened, sizes, is_tensor)
    constants = tuple(map(operator.getitem, itertools.repeat(leaves), constant_at))
    # An argument no constant can stand for (an object of the user's) cannot reach the body,
    # and Dynamo would give up on the frame holding the layer loop: the call is traced inline.
    passable = all(map(_passable, constants))
    if not passable and torch.compiler.is_compiling():
        _say_inline(type(self).__name__, _first_unpassable(tuple(map(type, constants))))
    train = torch.is_grad_enabled()
    call, inline = (
        _block_call(self._mfsdp_region_key, layout, recipe, is_tensor, constants, train) if stood_in and passable else (-1, True)
    )
    tensors = list(map(operator.getitem, itertools.repeat(leaves), tensor_at))
    if inline:  # run eagerly, or traced inline
        if call >= 0:
            BLOCK_GRADED(gathered, tensors, call)
        return _region_inline(self, layout, recipe, *gathered, *given)
    outputs = BLOCK_FORWARD(gathered, tensors, call)
    form, own, side = _output_form(call)
    if side:
        replay(self, side, outputs[own:-1], given)
    return _regroup(form, outputs)


@torch._dynamo.assume_constant_result
def _gather_recipe(block_key: int) -> tuple:
    """What the wrapper of the block ``block_key`` gathers, as constants (run, not traced, by
    Dynamo): the markers' arguments of its flat parameters, then of the parameters on their
    own, and the key of its recipe (``_RECIPES``). Refuses a block whose parameters were
    replaced since ``fully_shard``: its wrapper would gather the old ones."""
    block = _BLOCKS[block_key]
    _check_params(block)
    return (
        tuple(marker_args(shard_info(f), f.dtype) for f in block._mfsdp_region_flats.values()),
        tuple(marker_args(shard_info(p), p.dtype) for p in block._mfsdp_region_params.values()),
        _recipe_key(block),
    )


# How gathered values become a block's parameters: per flat, ``split_gathered``'s arguments and
# the rows each member keeps; the body's weights as indices into the members and the parameters
# on their own; the owners those weights go to. The same for every block of one structure and
# sharding, so a body's frame sees one value. Append-only; read by key (``_key_in``).
_RECIPES: list[tuple] = []


def _recipe_key(block: nn.Module) -> str:
    layout: RegionLayout = block._mfsdp_region
    flats = block._mfsdp_region_flats.values()
    recipe = (
        tuple((f._mfsdp_layout.unpack_args(shard_info(f).param_dtype), f._mfsdp_layout.trims()) for f in flats),
        layout.slots,
        tuple((tuple(path.split(".")) if path else (), names) for path, names in layout.owners),
        hooked_modules(block),
    )
    return _key_in(_RECIPES, recipe)


def _key_in(table: list, value: object) -> str:
    """``value``'s key in the append-only ``table`` (its index, as a string), appended if new:
    what Dynamo sees as a constant in place of the value. A string, since a body's frame
    takes it as an argument: Dynamo may make an int argument symbolic (a step compiled with
    ``dynamic=True``, an int that changed between calls), and the body could then not read
    its table without a graph break (torch 2.13) or an internal error (2.11); it never makes
    a string symbolic."""
    if value not in table:
        table.append(value)
    return str(table.index(value))


@torch._dynamo.assume_constant_result
def _recipe_of(recipe: str) -> tuple:
    return _RECIPES[int(recipe)]


def _check_params(block: nn.Module) -> None:
    layout: RegionLayout = block._mfsdp_region
    current = [_param_at(block, path) for path in layout.paths()]
    recorded = [m.param for f in block._mfsdp_region_flats.values() for m in f._mfsdp_members]
    recorded += list(block._mfsdp_region_params.values())
    for path, now, then in zip(layout.paths(), current, recorded):
        if now is not then:
            raise CompileUsageError(
                f"{type(block).__name__}.{path} was replaced after fully_shard (now "
                f"{type(now).__name__} of shape {tuple(now.shape)}); sharding happens once. "
                "Change the model before calling fully_shard, or copy new values into the shard "
                "(param.to_local().copy_(...))."
            )
    for flat in block._mfsdp_region_flats.values():
        check_linked(flat)


def _param_at(block: nn.Module, path: str) -> nn.Parameter:
    owner, _, name = path.rpartition(".")
    return block.get_submodule(owner)._parameters[name]


def _stored_in(block: nn.Module, owners, weights, args, kwargs):
    """The block's own forward with ``weights`` in place of its parameters: each owning
    submodule's ``_parameters`` entries hold the plain tensors for the call, and their
    parameters again after it. For the body's own frame, where nothing encloses the stores.

    Stores into ``_parameters`` rather than ``_reparametrize_module``: Dynamo steps through
    every instruction of the body's frame, and torch's context manager costs about 600 of
    them per owning submodule (its accessor objects, ``get_submodule``, ``contextlib``)
    against about 30 here. The stores put back what was there, so Dynamo, which replays a
    frame's side effects after its graph, finds none left to replay.
    """
    held, at = [], 0
    for parts, names in owners:
        owner = block
        for part in parts:
            owner = owner._modules[part]
        params = owner._parameters
        for name in names:
            held.append((params, name, params[name]))
            params[name] = weights[at]
            at += 1
    try:
        return block._mfsdp_region_forward(*args, **kwargs)
    finally:
        for params, name, param in held:
            params[name] = param


def _reparametrized(block: nn.Module, owners, weights, args, kwargs):
    """``_stored_in`` for a body run eagerly or traced inline (``regional=False``), one owning
    submodule at a time: traced inline, the body may lie inside a higher-order op (HF's
    gradient checkpointing wraps the block's call in one), where Dynamo refuses a store into
    a module's dict as a side effect and breaks the graph, but understands
    ``_reparametrize_module``."""
    if not owners:
        return block._mfsdp_region_forward(*args, **kwargs)
    (parts, names), rest = owners[0], owners[1:]
    with _reparametrize_module(block.get_submodule(".".join(parts)), dict(zip(names, weights[: len(names)]))):
        return _reparametrized(block, rest, weights[len(names) :], args, kwargs)


def _region(block: nn.Module, layout: str, recipe: str, side: SideChannel, *leaves):
    """The body: the block's forward with its parameters from the gathered weights, each
    flat's members copied out by the call (NOTE: a flat's copies in the block call), its
    modules' forward hooks recorded into ``side`` (NOTE: hooks inside a repeated block)."""
    owners, weights, args, kwargs, _ = _body_arguments(layout, recipe, leaves, copied_out=True)
    held = recording_hooks(block, _recipe_of(recipe)[3], side)
    try:
        return _stored_in(block, owners, weights, args, kwargs)
    finally:
        put_back_hooks(held)


def _region_inline(block: nn.Module, layout: str, recipe: str, *leaves):
    """The body run eagerly, or traced inline in the caller's frame (``regional=False``)."""
    owners, weights, args, kwargs, copies = _body_arguments(layout, recipe, leaves, copied_out=False)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # Run eagerly, each copy-out's node says at every backward which members have a
        # gradient (see NOTE: parameters without a gradient, in block_call.py).
        for flat, members in zip(block._mfsdp_region_flats.values(), copies):
            if members[0].grad_fn is not None:
                members[0].grad_fn.register_prehook(functools.partial(_note_reached, flat))
    return _reparametrized(block, owners, weights, args, kwargs)


def _note_reached(flat: nn.Parameter, grad_outputs: tuple) -> None:
    note_graded(flat, tuple(g is not None for g in grad_outputs), traced=False)


def _note_graded(self: nn.Module, graded: list[tuple[bool, ...]]) -> None:
    """Tell the block's flats which members a compiled call's backward gives a gradient (its
    fake run found it: ``graded`` has a tuple per gathered weight, flats first)."""
    for flat, flags in zip(self._mfsdp_region_flats.values(), graded):
        note_graded(flat, flags, traced=True)


def _body_arguments(layout: str, recipe: str, leaves: tuple, copied_out: bool) -> tuple:
    """A body's leaves as the block's owning submodules, their weights, its forward's
    arguments, and each flat's copied-out members. The leaves start with the gathered
    weights: each flat whole, or with ``copied_out`` its members (padded) one by one, then
    the parameters on their own."""
    n_args, names, widths = _call_layout_of(layout)
    unpacks, slots, owners, _ = _recipe_of(recipe)
    members, copies, at = [], [], 0
    for unpack, trims in unpacks:
        if copied_out:
            copied, at = leaves[at : at + len(trims)], at + len(trims)
        else:
            copied, at = torch.ops.fsdp_compile.split_gathered.default(leaves[at], *unpack), at + 1
        copies.append(copied)
        members.extend(m if rows is None else m[:rows] for m, rows in zip(copied, trims))
    alone = widths[0] - len(unpacks)
    members.extend(leaves[at : at + alone])
    at, values = at + alone, []
    for width in widths[1:]:
        if width == _NOT_OPENED:
            values.append(leaves[at])
            at += 1
        else:
            values.append(tuple(leaves[at : at + width]))
            at += width
    return owners, [members[i] for i in slots], tuple(values[:n_args]), dict(zip(names, values[n_args:])), copies


_NOT_OPENED = -1
# How a body call's flat leaves regroup: (positional count, keyword names, widths), the
# first width the gathered weights'. Append-only; a call names its entry by key
# (``_key_in``), a constant.
_CALL_LAYOUTS: list[tuple[int, tuple[str, ...], tuple[int, ...]]] = []


@torch._dynamo.assume_constant_result
def _opened_at(opened: tuple[bool, ...]) -> tuple[int, ...]:
    """The positions of the arguments that are tuples, last first (run, not traced, by
    Dynamo)."""
    return tuple(at for at in range(len(opened) - 1, -1, -1) if opened[at])


@torch._dynamo.assume_constant_result
def _call_layout(
    n_args: int, names: tuple[str, ...], n_gathered: int, opened: tuple[bool, ...], sizes: tuple[int, ...],
    is_tensor: tuple[bool, ...],
) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """The key of this call's layout in ``_CALL_LAYOUTS``, then the positions of its tensor
    leaves and of its constant ones (run, not traced, by Dynamo). ``sizes``: the lengths of
    the tuples ``opened`` marks, last first."""
    size = iter(reversed(sizes))
    widths = (n_gathered, *(next(size) if o else _NOT_OPENED for o in opened))
    return (
        _key_in(_CALL_LAYOUTS, (n_args, names, widths)),
        tuple(at for at, t in enumerate(is_tensor) if t),
        tuple(at for at, t in enumerate(is_tensor) if not t),
    )


@torch._dynamo.assume_constant_result
def _call_layout_of(layout: str) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    # Run, not traced: a list Dynamo read while tracing would be guarded on, and a layout
    # added later would fail those guards.
    return _CALL_LAYOUTS[int(layout)]


@torch._dynamo.assume_constant_result
def _block_call(
    block_key: int, layout: str, recipe: str, is_tensor: tuple[bool, ...], constants: tuple, train: bool
) -> tuple[int, bool]:
    """The call of the block ``block_key`` (an index, see fsdp_compile/block_call.py), and
    whether its body runs inline (run, not traced, by Dynamo): outside a compile by mfsdp
    (no call: -1), or under ``options={"regional": False}``, where a training call is
    recorded only for its fake run (``BLOCK_GRADED``). ``constants``: the values of the
    leaves ``is_tensor`` does not mark, in order."""
    from fsdp_compile.backend import compiling_backend  # the backend builds on the regions

    backend = compiling_backend()
    if backend is None or (not backend.options.regional and not train):
        return -1, True
    block = _BLOCKS[block_key]
    name, body = _body_for(block)
    values = iter(constants)
    flats = tuple(FlatCopy(unpack=unpack) for unpack, _ in _RECIPES[int(recipe)][0])
    call = register_call(BlockCall(
        block=weakref.ref(block), body=body, name=name, layout=layout, recipe=recipe,
        constants=tuple(() if t else (next(values),) for t in is_tensor), train=train, backend=weakref.ref(backend),
        flats=flats,
    ))
    return call, not backend.options.regional


@torch._dynamo.assume_constant_result
def _output_form(call: int) -> tuple:
    """How the call's outputs regroup, how many are the block's, and the form of the side
    values after them (known once ``block_forward``'s fake kernel ran)."""
    traced = call_record(call).traced
    return traced["form"], traced["own"], traced["side"]


@torch._dynamo.assume_constant_result
def _layers_of(block_key: int) -> tuple[int, ...]:
    return layer_indices(_BLOCKS[block_key])


_PASSABLE = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _passable(value: object) -> bool:
    """A constant a block's call can carry to its body (traced by Dynamo)."""
    return type(value) in _PASSABLE or hf.is_stand_in_spec(value)


@torch._dynamo.assume_constant_result
def _first_unpassable(types_: tuple[type, ...]) -> str:
    return next(t.__name__ for t in types_ if t not in _PASSABLE and t is not tuple)


@torch._dynamo.assume_constant_result
def _say_inline(block: str, argument: str) -> None:
    """Said once per block class and argument type (Python's warnings keep the first)."""
    warnings.warn(
        f"a repeated {block} is called with a {argument}, which mfsdp cannot hand to the "
        "block's compiled body (only tensors, None, numbers, strings, dtypes, devices and HF "
        "caches go through): each such call is traced inline in the step, as with "
        "options={'regional': False}, and compile time grows with depth. Pass the values the "
        "block reads from it instead (tensors or constants).",
        stacklevel=2,
    )


def _regroup(form: tuple, outputs: list) -> Any:
    if form[0] == "tensor":
        return outputs[0]
    tensors = iter(outputs)
    values = [next(tensors) if not c else c[0] for c in form[1]]
    return tuple(values) if form[0] == "tuple" else values


def structure(block: nn.Module) -> tuple:
    """What a block's body may depend on that Dynamo's guards do not see: the class of every
    submodule, its training flag, its backward hooks, how many forward hooks it has (NOTE:
    hooks inside a repeated block: the body records for them, the step calls them; the
    block's own run in the step), and the names, shapes and dtypes of its parameters and
    buffers (see NOTE: structure before guards)."""
    return tuple(
        (
            path,
            type(module),
            module.training,
            tuple(id(hook) for hooks in (module._backward_pre_hooks, module._backward_hooks) for hook in hooks.values()),
            hook_counts(module) if path else (),
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in module._parameters.items() if t is not None),
            tuple((n, tuple(t.shape), t.dtype) for n, t in module._buffers.items() if t is not None),
        )
        for path, module in block.named_modules()
    )


# One body function per block structure, each with a code object of its own (see NOTE:
# structure before guards).
_BODY_OF: dict[tuple, tuple[str, Callable]] = {}
# The region blocks by key, for the functions Dynamo runs rather than traces (they take
# constants only).
_BLOCKS: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
# Keys, not id(block): id() of a module in the traced wrapper is an ID_MATCH guard on it.
_BLOCK_KEYS = itertools.count()


def _body_for(block: nn.Module) -> tuple[str, Callable]:
    """The name and body function for the structure ``block`` has now: run while tracing, so
    a hook added after fully_shard counts."""
    key = structure(block)
    if key not in _BODY_OF:
        name = f"_region_{len(_BODY_OF)}"
        code = _region.__code__.replace(co_name=name)
        _BODY_OF[key] = (name, types.FunctionType(code, _region.__globals__, name))
    return _BODY_OF[key]


def _refresh_params(self: nn.Module, fn, recurse: bool = True):
    """``_apply`` (``to_empty``, ``.to``) converts each flat parameter once, and the members
    are linked to the result (``converted_flat``) rather than converted one by one; the
    parameters on their own are converted as usual, and the wrapper's dict follows them (they
    may be new objects)."""
    layout: RegionLayout = self._mfsdp_region
    members = {m.param for flat in self._mfsdp_region_flats.values() for m in flat._mfsdp_members}
    owners = [(self.get_submodule(path), name) for path, names in layout.owners for name in names]
    hidden = [(owner, name) for owner, name in owners if owner._parameters[name] in members]
    held = [owner._parameters[name] for owner, name in hidden]
    for owner, name in hidden:  # nn.Module._apply skips a None parameter
        owner._parameters[name] = None
    try:
        result = self._mfsdp_region_base._apply(self, fn, recurse)
    finally:
        for (owner, name), param in zip(hidden, held):
            owner._parameters[name] = param
    for (name, flat), paths in zip(list(self._mfsdp_region_flats.items()), layout.flats):
        self._mfsdp_region_flats[name] = converted_flat(flat, [_param_at(self, p) for p in paths], fn)
    self._mfsdp_region_params = _params_alone(self, layout.alone)
    return result


def _params_alone(block: nn.Module, paths: tuple[str, ...]) -> dict[str, nn.Parameter]:
    """The parameters gathered on their own, by path relative to the block (a dict: Dynamo
    names each graph input after its key, so plans see the parameter's path)."""
    params = {path: _param_at(block, path) for path in paths}
    for param in params.values():
        # Read from a dict, a parameter is a plain input to Dynamo, whose sizes
        # dynamic=True makes symbolic (and duck-sizes against the batch's): fixed, in fact.
        torch._dynamo.mark_static(param)
    return params


# One region class per block class (see NOTE: one body per repeated block).
_REGION_CLASSES: dict[type, type] = {}


def _layout(block: nn.Module, shared: set[int]) -> RegionLayout | None:
    """The block's sharded parameters by owner, grouped into flats; None when the block
    cannot be one body: a parameter not sharded by fully_shard, one shared with a module
    outside the block, or a float8 weight."""
    owners, slot_params, path_of = defaultdict(list), [], {}
    for path, owner in block.named_modules():
        for name, param in owner._parameters.items():
            if param is None:
                continue
            info = shard_info(param)
            # A float8 weight is read as torchao's Float8TrainingTensor, which the float8 cast
            # makes after the gather; a block's call takes plain tensors only (a subclass
            # input would need the op to be one torchao's dispatch knows): such a block is
            # traced inline, as with regional=False.
            if info is None or id(param) in shared or info.float8 is not None:
                return None
            owners[path].append(name)
            slot_params.append(param)
            path_of.setdefault(param, f"{path}.{name}" if path else name)  # a tie: its first name
    if not slot_params:
        return None
    flats, alone = flat_groups(list(path_of))
    order = [p for members in flats for p in members] + alone
    index = {param: i for i, param in enumerate(order)}
    return RegionLayout(
        owners=tuple((p, tuple(n)) for p, n in owners.items()),
        flats=tuple(tuple(path_of[p] for p in members) for members in flats),
        alone=tuple(path_of[p] for p in alone),
        slots=tuple(index[p] for p in slot_params),
    )


def _make_region(block: nn.Module, layout: RegionLayout, path: str) -> None:
    cls = type(block)
    if cls not in _REGION_CLASSES:
        _REGION_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "forward": _region_forward,
                "_mfsdp_region_forward": cls.forward,
                "_mfsdp_region_base": cls,
                "_apply": _refresh_params,
                "_mfsdp_note_graded": _note_graded,
                "__module__": cls.__module__,  # printed as the user's (see api._install_properties)
                "__qualname__": cls.__qualname__,
            },
        )
    block.__class__ = _REGION_CLASSES[cls]
    block._mfsdp_region_key = next(_BLOCK_KEYS)
    _BLOCKS[block._mfsdp_region_key] = block
    block._mfsdp_region = layout
    # Not module parameters (plain dict values): the optimizer, state_dict and DCP see only
    # the members, which hold views of these.
    block._mfsdp_region_flats = {
        f"_flat{i}": make_flat(
            [_param_at(block, p) for p in members], param_id=next_param_id(), fqn=f"{path}._flat{i}",
            names=tuple(f"{path}.{p}" for p in members),
        )
        for i, members in enumerate(layout.flats)
    }
    block._mfsdp_region_params = _params_alone(block, layout.alone)


def install_regions(root: nn.Module) -> None:
    """Make every outermost repeated block under ``root`` a region (see NOTE: one body per
    repeated block); blocks that already are, or lie inside one, are left alone."""
    paths = {id(m): name for name, m in root.named_modules()}
    holders: dict[int, set[int]] = defaultdict(set)  # parameter -> the modules holding it
    for module in root.modules():
        for param in module._parameters.values():
            if param is not None:
                holders[id(param)].add(id(module))
    claimed: set[int] = set()
    for container in root.modules():
        if id(container) in claimed or not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class = defaultdict(list)
        for child in container.children():
            by_class[getattr(type(child), "_mfsdp_region_base", type(child))].append(child)
        for blocks in (b for b in by_class.values() if len(b) > 1):
            for block in blocks:
                members = {id(m) for m in block.modules()}
                claimed |= members
                shared = {p for m in block.modules() for p in map(id, m._parameters.values()) if holders[p] - members}
                layout = None if is_region(block) else _layout(block, shared)
                if layout is not None:
                    _make_region(block, layout, paths[id(block)])
