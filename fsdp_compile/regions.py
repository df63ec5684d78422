"""Repeated blocks compiled once: each block's forward becomes a gather, then one shared body.

NOTE: one body per repeated block
    Dynamo, AOTAutograd, the partitioner and Inductor all cost time per traced op, so a
    whole-model graph takes time linear in depth. A block that read its sharded parameters
    through our markers inside its body could not be shared by the layers either: each
    marker carries its parameter's id, and the collectives would be hidden inside the body,
    out of reach of bucketing and prefetch. So ``fully_shard`` gives every repeated block (two
    or more layers of one class in a stack, ``records.stack_layers``: an ``nn.ModuleList``,
    ``nn.Sequential`` or torchtitan's ``nn.ModuleDict``; outermost only) a forward in two parts:

    - in the caller's graph, every sharded parameter of the block is gathered: the block's
      shards lie in flat parameters (NOTE: flat parameters, in flat_params.py), one marker
      each, and a parameter that fits no flat has a marker of its own (read from a dict on
      the block rather than through its submodules: one graph input each, no module walk);
    - the body runs the block's own forward on each flat's members, copied out of it
      (``split_gathered``: inline by the body itself, ``region_body.region_inline``; around the body's
      frame by its block call, NOTE: a flat's copies in the block call, in block_call.py),
      put in place of its parameters: stored into each owning submodule's ``_parameters``
      and put back after, in the body's own frame (``region_body._stored_in``), or, run eagerly or
      traced inline, with ``torch.nn.utils.stateless._reparametrize_module``, which Dynamo
      accepts inside a higher-order op (``region_body._reparametrized``); the getters return such plain
      tensors as they are (``gathered_reads._gathered``).

    Compiled by mfsdp, the body is one ``fsdp_compile::block_forward`` node per layer in the
    step's graph, and runs as a Dynamo frame of its own, compiled once per structure and
    guarded at every call (NOTE: one op per block call, in block_call.py). Run eagerly, or
    compiled with ``options={"regional": False}``, the body is called directly: the whole
    graph holds every layer; traced for another backend, the block runs its own forward
    (NOTE: a block compiled by another backend, in gathered_reads.py). Generated classes are shared per base class
    (``gathered_reads.install_properties``) and the body takes only what is the same for every layer
    (the block, constants, tensors), so one compiled body serves every layer whose guards it
    passes; a layer that differs in anything the body reads fails them and gets a compile of
    its own.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections import Counter, defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _MaskPartial as MaskPartial

from fsdp_compile import hf_caches
from fsdp_compile.backend import compiling_backend
from fsdp_compile.block_call import BLOCK_FORWARD, BLOCK_GRADED, block_ops_take_float8_weights, float8_without_gradient_detached
from fsdp_compile.block_record import BlockCall, FlatCopy, python_flags, register_call, say_written_in_step, written_in_trace
from fsdp_compile.block_runtime import as_dtensors, autocast_state
from fsdp_compile.compat import local_rows
from fsdp_compile.flat_params import converted_flat, flat_groups, make_flat
from fsdp_compile.accumulation import read_state, unshard_marker
from fsdp_compile.gathered_reads import copied_module, float8_read, traced_by_mfsdp
from fsdp_compile.records import next_param_id, shard_info, stack_layers
from fsdp_compile.region_body import region_body, region_inline, structure
from fsdp_compile.region_notices import (
    say_another_backend, say_cache_layer_inline, say_cache_states_inline, say_dtensor_inline, say_inline, say_shared_inline, say_tensor_parallel_inline,
)
from fsdp_compile.region_tables import (
    BLOCK_KEYS, BLOCKS, RECIPES, RegionLayout, block_flag_sources, call_layout, call_output_form, gather_recipe, layers_of, opened_at, param_at,
)
from fsdp_compile.side_outputs import mixes_tensor_parallel_hooks, replay, stand_in_leaves
from fsdp_compile.state_dicts import materialise_loaded_flats

__all__ = ["install_regions", "is_region", "RegionLayout"]


def is_region(module: nn.Module) -> bool:
    return getattr(module, "_mfsdp_region", None) is not None


def _region_forward(self: nn.Module, *args, **kwargs):
    if torch.compiler.is_compiling() and not traced_by_mfsdp():  # NOTE: a block compiled by another backend
        say_another_backend(type(self).__name__)
        return self._mfsdp_region_forward(*args, **kwargs)
    # The markers' constants come from one call Dynamo runs rather than traces: read field by
    # field from each ShardInfo, they were a guard each (28% of Dynamo's time on an HF Llama,
    # A B A B).
    flats, alone, float8, recipe = gather_recipe(self._mfsdp_region_key)
    flat_params = self._mfsdp_region_flats.values()
    gathered = [unshard_marker(f, c, shard_info(f).accumulation) for f, c in zip(flat_params, flats)]
    if alone:
        params = self._mfsdp_region_params.values()
        gathered += [unshard_marker(local_rows(p), c, read_state(p, shard_info(p))) for p, c in zip(params, alone)]
        if any(float8):  # NOTE: float8 weights in a block call, in block_call.py
            at = len(flats)
            gathered[at:] = [float8_read(g, shard_info(p)) if f else g for g, p, f in zip(gathered[at:], params, float8)]
    # The body takes flat leaves only (the block, constants, tensors, None...), the same for
    # every layer: a frame of its own guards on each argument. Tuples are opened one level
    # (HF's position_embeddings); one constant says how to regroup. Dynamo steps through this
    # at every layer, so it is made of what Dynamo runs natively (map over builtins, slices,
    # getitem) and of functions it runs rather than traces: 196 stepped instructions a layer
    # on an HF Llama where a loop over the arguments took 438 (the flags' reads add 76).
    values = (*args, *kwargs.values())
    opened = tuple(map(operator.is_, map(type, values), itertools.repeat(tuple)))  # not a namedtuple
    leaves, sizes = values, ()
    for at in opened_at(opened):  # the last first: the earlier positions stay where they are
        sizes += (len(values[at]),)
        leaves = leaves[:at] + values[at] + leaves[at + 1 :]
    is_tensor = tuple(map(isinstance, leaves, itertools.repeat(torch.Tensor)))
    given, stood_in, said = leaves, True, False
    if any(map(hf_caches.is_cache, leaves)):  # see NOTE: HF caches in a repeated block
        block_layers = layers_of(self._mfsdp_region_key)
        leaves, stood_in = stand_in_leaves(leaves, block_layers)
        if not stood_in and torch.compiler.is_compiling():
            for leaf in given:
                if hf_caches.is_cache(leaf) and (kind := hf_caches.unanswered_layer(leaf, block_layers)):
                    say_cache_layer_inline(type(self).__name__, type(leaf).__name__, kind)
                    said = True
                elif hf_caches.is_cache(leaf) and len(block_layers) == 1 and hf_caches.holds_states_at(leaf, block_layers):
                    say_cache_states_inline(type(self).__name__, type(leaf).__name__)
                    said = True
    layout, tensor_at, constant_at = call_layout(len(args), tuple(kwargs), len(gathered), opened, sizes, is_tensor)
    constants = tuple(map(operator.getitem, itertools.repeat(leaves), constant_at))
    # An argument no constant can stand for (an object of the user's) cannot reach the body,
    # and Dynamo would give up on the frame holding the layer loop: the call is traced inline.
    passable = all(map(_passable, constants))
    if not passable and not said and torch.compiler.is_compiling():
        say_inline(type(self).__name__, _first_unpassable(tuple(map(type, constants))))
    if any(map(isinstance, leaves, itertools.repeat(DTensor))) and _dtensors_kept_inline(leaves):
        # The body reads a DTensor again from its local tensor and a global shape, which a
        # symbolic size could not give it, and from its placements, of which a masked partial
        # sum holds a mask of the call's own (NOTE: DTensors at a block call, in block_call.py).
        passable = False
        if torch.compiler.is_compiling():
            say_dtensor_inline(type(self).__name__)
    train = torch.is_grad_enabled()
    call, inline = (
        _block_call(self._mfsdp_region_key, layout, recipe, is_tensor, constants, train, _flags(self)) if stood_in and passable else (-1, True)
    )
    tensors = list(map(operator.getitem, itertools.repeat(leaves), tensor_at))
    if inline:  # run eagerly, or traced inline
        if call >= 0:
            BLOCK_GRADED(gathered, tensors, call)
        elif train and self._mfsdp_region_flats and torch.compiler.is_compiling():
            # Traced inline with no fake run (an argument no constant stands for, a DTensor, a
            # cache with states): nothing says which members of a flat get a gradient, and an
            # idle one would get zeros (NOTE: parameters without a gradient, in block_fakes.py).
            # The block's own forward: each read gathers, one without a gradient keeps None.
            return self._mfsdp_region_forward(*args, **kwargs)
        return region_inline(self, layout, recipe, *gathered, *given)
    if train and any(float8):
        gathered = float8_without_gradient_detached(gathered, tensors, call, len(flats))
    outputs = BLOCK_FORWARD(gathered, tensors, call)
    form, own, side, specs = call_output_form(call)
    if specs:  # NOTE: DTensors at a block call, in block_call.py
        outputs = [*as_dtensors(outputs[:-1], specs), outputs[-1]]
    if side:
        replay(self, side, outputs[own:-1], given)
    return _regroup(form, outputs)


def _flags(block: nn.Module) -> tuple:
    """The block's flags, read where Dynamo guards them: one changed later traces the step
    again, whose fake run (keyed by ``python_flags``) is then done for the new value."""
    values = ()
    for path, names in block_flag_sources(block._mfsdp_region_key) if torch.compiler.is_compiling() else ():
        module = block
        for part in path:
            module = module._modules[part]
        values += tuple(map(getattr, itertools.repeat(module), names))
    return values


@torch._dynamo.assume_constant_result
def _block_call(
    block_key: int, layout: str, recipe: str, is_tensor: tuple[bool, ...], constants: tuple, train: bool, guarded: tuple
) -> tuple[int, bool]:
    """The call of the block ``block_key`` (an index, see fsdp_compile/block_record.py), and
    whether its body runs inline (run, not traced, by Dynamo): outside a compile by mfsdp
    (no call: -1), or under ``options={"regional": False}``, where a training call is
    recorded only for its fake run (``BLOCK_GRADED``). ``constants``: the values of the
    leaves ``is_tensor`` does not mark, in order; ``guarded``: the flags Dynamo guards (``_flags``)."""

    backend = compiling_backend()
    if backend is None or (not backend.options.regional and not train):
        return -1, True
    block = BLOCKS[block_key]
    if written := written_in_trace(block):  # a value its body would not read
        say_written_in_step(type(block).__name__, written)
        return -1, True
    name = backend.body_names.setdefault(structure(block), f"_region_{len(backend.body_names)}")
    if name in backend.unfakeable:  # NOTE: a block fake tensors cannot run, in block_fakes.py
        return -1, True
    values = iter(constants)
    traced_with = RECIPES[recipe]
    flats = tuple(FlatCopy(unpack=unpack) for unpack, _ in traced_with.value[0])
    call = register_call(BlockCall(
        block=weakref.ref(block), body=region_body, name=name, layout=layout, recipe=traced_with,
        constants=tuple(() if t else (next(values),) for t in is_tensor), train=train, backend=weakref.ref(backend),
        autocast=autocast_state(), flats=flats, float8=traced_with.value[5], flags=python_flags(block),
    ), backend.calls)
    return call, not backend.options.regional


_PASSABLE = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _passable(value: object) -> bool:
    """A constant a block's call can carry to its body (traced by Dynamo)."""
    return type(value) in _PASSABLE or hf_caches.is_stand_in_spec(value)


@torch._dynamo.assume_constant_result
def _first_unpassable(types_: tuple[type, ...]) -> str:
    return next(t.__name__ for t in types_ if t not in _PASSABLE and t is not tuple)


def _dtensors_kept_inline(leaves: tuple) -> bool:
    dtensors = [t for t in leaves if isinstance(t, DTensor)]
    symbolic = any(isinstance(s, torch.SymInt) for t in dtensors for s in (*t.shape, *t.stride()))
    return symbolic or any(isinstance(p, MaskPartial) for t in dtensors for p in t.placements)


def _regroup(form: tuple, outputs: list) -> Any:
    if form[0] == "tensor":
        return outputs[0]
    tensors = iter(outputs)
    values = [next(tensors) if not c else c[0] for c in form[1]]
    return tuple(values) if form[0] == "tuple" else values


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
        self._mfsdp_region_flats[name] = converted_flat(flat, [param_at(self, p) for p in paths], fn)
    self._mfsdp_region_params = _params_alone(self, layout.alone)
    return result


_OWN_BOOKKEEPING = ("_mfsdp_region_key", "_mfsdp_region_flats", "_mfsdp_region_params", "_mfsdp_recipe")


def _copied_region(self: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a region: a region of its own, with a key and flats of its own, its
    members linked to them as ``fully_shard`` links them (see NOTE: copying a sharded model,
    in gathered_reads.py)."""
    copied = copied_module(self, memo, leave_out=_OWN_BOOKKEEPING)
    copied._mfsdp_region_key = next(BLOCK_KEYS)
    BLOCKS[copied._mfsdp_region_key] = copied
    layout: RegionLayout = self._mfsdp_region
    copied._mfsdp_region_flats = {
        name: make_flat(
            [param_at(copied, p) for p in paths], param_id=next_param_id(), fqn=flat._mfsdp.fqn,
            names=flat._mfsdp.members,
        )
        for (name, flat), paths in zip(self._mfsdp_region_flats.items(), layout.flats)
    }
    copied._mfsdp_region_params = _params_alone(copied, layout.alone)
    return copied


def _params_alone(block: nn.Module, paths: tuple[str, ...]) -> dict[str, nn.Parameter]:
    """The parameters gathered on their own, by path relative to the block (a dict: Dynamo
    names each graph input after its key, so plans see the parameter's path)."""
    params = {path: param_at(block, path) for path in paths}
    for param in params.values():
        # Read from a dict, a parameter is a plain input to Dynamo, whose sizes
        # dynamic=True makes symbolic (and duck-sizes against the batch's): fixed, in fact.
        torch._dynamo.mark_static(param)
    return params


# One region class per block class (see NOTE: one body per repeated block).
_REGION_CLASSES: dict[type, type] = {}


def _layout(block: nn.Module, shared: set[int]) -> RegionLayout | None:
    """The block's sharded parameters by owner, grouped into flats; None when the block
    cannot be one body: a parameter not sharded by fully_shard, one shared between layers
    (``shared``: held outside the block, or reached from several blocks; said), or a module
    with tensor parallelism's hooks and others."""
    owners, slot_params, path_of = defaultdict(list), [], {}
    for path, owner in block.named_modules():
        if mixes_tensor_parallel_hooks(owner):
            say_tensor_parallel_inline(type(block).__name__, path)
            return None
        for name, param in owner._parameters.items():
            if param is None:
                continue
            info = shard_info(param)
            if info is not None and id(param) in shared:
                say_shared_inline(type(block).__name__, f"{path}.{name}" if path else name)
                return None
            if info is None:
                return None
            owners[path].append(name)
            slot_params.append(param)
            path_of.setdefault(param, f"{path}.{name}" if path else name)  # a tie: its first name
    if not slot_params:
        return None
    if any(shard_info(p).tensor_parallel is not None for p in path_of):
        # No flats in a tensor-parallel block: a call traced inline because it is given a
        # DTensor (sequence parallelism) records no fake run, so a flat could not tell which
        # members got a gradient and would hand an idle one zeros (NOTE: parameters without
        # a gradient, in block_fakes.py); gathered alone, each keeps its own None.
        flats, alone = [], list(path_of)
    else:
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
                "__deepcopy__": _copied_region,
                "__module__": cls.__module__,  # printed as the user's (see gathered_reads.install_properties)
                "__qualname__": cls.__qualname__,
            },
        )
    block.__class__ = _REGION_CLASSES[cls]
    block._mfsdp_region_key = next(BLOCK_KEYS)
    BLOCKS[block._mfsdp_region_key] = block
    block._mfsdp_region = layout
    # Not module parameters (plain dict values): the optimizer, state_dict and DCP see only
    # the members, which hold views of these.
    block._mfsdp_region_flats = {
        f"_flat{i}": make_flat(
            [param_at(block, p) for p in members], param_id=next_param_id(), fqn=f"{path}._flat{i}",
            names=tuple(f"{path}.{p}" for p in members),
        )
        for i, members in enumerate(layout.flats)
    }
    block._mfsdp_region_params = _params_alone(block, layout.alone)
    if any(shard_info(p).float8 is not None for p in block._mfsdp_region_params.values()):
        block_ops_take_float8_weights()
    if block._mfsdp_region_flats:
        block.register_load_state_dict_post_hook(materialise_loaded_flats)


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
        if id(container) in claimed:
            continue
        by_class = defaultdict(list)
        for child in stack_layers(container):
            by_class[getattr(type(child), "_mfsdp_region_base", type(child))].append(child)
        for blocks in (b for b in by_class.values() if len(b) > 1):
            # A weight shared between layers: held by a module outside the block, or reached
            # from several of the blocks (one module every layer holds).
            own = [{id(p) for m in block.modules() for p in m._parameters.values()} for block in blocks]
            in_blocks = Counter(p for params in own for p in params)
            for block, params in zip(blocks, own):
                members = {id(m) for m in block.modules()}
                claimed |= members
                shared = {p for p in params if holders[p] - members or in_blocks[p] > 1}
                layout = None if is_region(block) else _layout(block, shared)
                if layout is not None:
                    _make_region(block, layout, paths[id(block)])
