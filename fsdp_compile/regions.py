"""Repeated blocks compiled once: each block's forward becomes a gather, then one shared body.

NOTE: one body per repeated block
    Dynamo, AOTAutograd, the partitioner and Inductor all cost time per traced op, so a
    whole-model graph takes time linear in depth. torch's ``nested_compile_region`` traces a
    marked function once and "stamps out" the same subgraph (an ``invoke_subgraph`` call) for
    every later call whose inputs and guards match; AOTAutograd then traces, partitions and
    compiles that body once. A block that reads its sharded parameters through our markers
    cannot be such a body: each marker carries its parameter's id, so every layer's body
    would differ, and the collectives would be hidden inside it, out of reach of bucketing
    and prefetch. So ``fully_shard`` gives every repeated block (two or more children of one
    class in an ``nn.ModuleList`` / ``nn.Sequential``, outermost only) a forward in two parts:

    - in the caller's graph, every sharded parameter of the block is gathered (one marker per
      parameter, read from a flat dict on the block rather than through its submodules:
      values the outer frame has already wrapped are not re-checked when Dynamo decides to
      reuse a body);
    - the body, ``_region``, runs the block's own forward with those gathered tensors put in
      place of its parameters (``torch.nn.utils.stateless._reparametrize_module``, once per
      owning submodule, which Dynamo understands and does not count as a side effect); the
      getters return such plain tensors as they are (``api._gathered``).

    Generated classes are shared per base class (``api._install_properties``), so the blocks'
    modules have identical types and the body's guards hold for every layer. A layer that
    differs in anything the body reads (an attribute, a submodule's class, a shape) fails
    those guards and gets a body of its own; nothing is ever shared on trust. The backend can
    inline the bodies again (``options={"regional": False}``) to compile the whole graph.

NOTE: structure before guards
    Dynamo reuses a body for another call when the guards it collected while tracing the body
    hold for the new call's sources. In torch 2.13 those guards miss two things a layer can
    differ in: a submodule of another class, and a hook on one layer only (Dynamo does not
    guard module hooks by default). Reusing layer 0's body there gives wrong numbers, silently
    (tests/test_regions.py holds both). So blocks are first told apart by ``structure``: each
    structure gets a body function of its own (``_body_for``, run while tracing), and
    Dynamo's reuse, with its guards, only ever chooses among blocks alike in structure.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from fsdp_compile.api import ShardInfo, marker_args, shard_info, unshard_marker

__all__ = ["install_regions", "is_region", "RegionLayout"]

# Every layer that fails the guards of the bodies traced so far adds one; torch's default of 8
# would turn a model of many distinct blocks into an error instead of a slower compile.
_MAX_BODIES = 1 << 16


@dataclass(frozen=True)
class RegionLayout:
    """Which parameters a repeated block's wrapper gathers, in the order its body takes them."""

    owners: tuple[tuple[str, tuple[str, ...]], ...]
    """(submodule path relative to the block, its parameter names), per owning submodule."""
    infos: tuple[ShardInfo, ...]
    """The sharding record of each parameter, in the same flat order."""


def is_region(module: nn.Module) -> bool:
    return getattr(module, "_mfsdp_region", None) is not None


def _region_forward(self: nn.Module, *args, **kwargs):
    # The markers' constants come from one call Dynamo runs rather than traces: read field by
    # field from each ShardInfo, they were a guard each, nine parameters a layer (28% of
    # Dynamo's time on an HF Llama, A B A B). Nothing else of a ShardInfo is read here either
    # (a region holds no float8 weight, see _layout): each read was a guard too (an 8-layer
    # HF Llama: 2991 guard lines before, 2662 after; 1% fewer Python calls at 32 layers).
    weights = [
        unshard_marker(p.to_local(), c)
        for p, c in zip(self._mfsdp_region_params.values(), _marker_args(self._mfsdp_region_key))
    ]
    # The body takes flat leaves only (the block, a constant, tensors, None...): then Dynamo
    # fingerprints each call for reuse directly, instead of tracing pytree.tree_flatten over
    # the call's arguments per layer (74 ms a layer for an HF decoder layer). Tuples are
    # opened one level (HF's position_embeddings); one constant says how to regroup.
    leaves, widths = weights, [len(weights)]
    for value in (*args, *kwargs.values()):
        if type(value) is tuple:
            widths.append(len(value))
            leaves.extend(value)
        else:
            widths.append(_NOT_OPENED)
            leaves.append(value)
    layout = _call_layout(len(args), tuple(kwargs), tuple(widths))
    name = _body_for(self._mfsdp_region_key)
    if not name:  # traced inline: see _body_for
        return _region(self, layout, *leaves)
    return getattr(_BODIES, name)(self, layout, *leaves)


@torch._dynamo.assume_constant_result
def _marker_args(block_key: int) -> tuple[tuple, ...]:
    """The ``unshard`` markers' constant arguments for the block ``block_key``'s parameters, in
    the body's order (run, not traced, by Dynamo)."""
    block = _BLOCKS[block_key]
    return tuple(
        marker_args(info, param.dtype)
        for param, info in zip(block._mfsdp_region_params.values(), block._mfsdp_region.infos)
    )


def _with_weights(block: nn.Module, owners, weights, args, kwargs):
    """The block's own forward with ``weights`` in place of its parameters, one owning
    submodule at a time."""
    if not owners:
        return block._mfsdp_region_forward(*args, **kwargs)
    (path, names), rest = owners[0], owners[1:]
    owner = block.get_submodule(path)
    with _reparametrize_module(owner, dict(zip(names, weights[: len(names)]))):
        return _with_weights(block, rest, weights[len(names) :], args, kwargs)


def _region(block: nn.Module, layout: int, *leaves):
    n_args, names, widths = _call_layout_of(layout)
    weights, at, values = leaves[: widths[0]], widths[0], []
    for width in widths[1:]:
        if width == _NOT_OPENED:
            values.append(leaves[at])
            at += 1
        else:
            values.append(tuple(leaves[at : at + width]))
            at += width
    args, kwargs = tuple(values[:n_args]), dict(zip(names, values[n_args:]))
    return _with_weights(block, block._mfsdp_region.owners, weights, args, kwargs)


_NOT_OPENED = -1
# How a body call's flat leaves regroup: (positional count, keyword names, widths), the
# first width the weights'. Append-only; a call names its entry by index, a constant.
_CALL_LAYOUTS: list[tuple[int, tuple[str, ...], tuple[int, ...]]] = []


@torch._dynamo.assume_constant_result
def _call_layout(n_args: int, names: tuple[str, ...], widths: tuple[int, ...]) -> int:
    """The index of this call's layout in ``_CALL_LAYOUTS`` (run, not traced, by Dynamo)."""
    key = (n_args, names, widths)
    if key not in _CALL_LAYOUTS:
        _CALL_LAYOUTS.append(key)
    return _CALL_LAYOUTS.index(key)


@torch._dynamo.assume_constant_result
def _call_layout_of(layout: int) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    # Run, not traced: a list Dynamo read while tracing would be guarded on, and a layout
    # added later would fail those guards.
    return _CALL_LAYOUTS[layout]


def structure(block: nn.Module) -> tuple:
    """What a block's body may depend on that Dynamo does not guard when it reuses a body for
    another layer: the class of every submodule, its hooks, its training flag, and the names,
    shapes and dtypes of its parameters and buffers (see NOTE: structure before guards)."""
    return tuple(
        (
            path,
            type(module),
            module.training,
            tuple(
                id(hook)
                for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks)
                for hook in hooks.values()
            ),
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in module._parameters.items() if t is not None),
            tuple((n, tuple(t.shape), t.dtype) for n, t in module._buffers.items() if t is not None),
        )
        for path, module in block.named_modules()
    )


# One body function per block structure, each with a code object of its own: Dynamo keeps
# its reuse entries per code object, so blocks of different structure never meet.
# Attributes, not list items: Dynamo reads an attribute afresh, while a list it has met once in
# a trace would not show a body added since.
_BODIES = types.SimpleNamespace()
_BODY_OF: dict[tuple, str] = {}
# The region blocks by id, for _body_for (a function Dynamo runs rather than traces takes
# constants only).
_BLOCKS: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
# Keys, not id(block): id() of a module in the traced wrapper is an ID_MATCH guard on the block,
# which Dynamo's reuse check re-evaluates for the next layer (the block is the body's argument)
# and which then always fails.
_BLOCK_KEYS = itertools.count()


@torch._dynamo.assume_constant_result
def _body_for(block_key: int) -> str:
    """The name in ``_BODIES`` of the region function for the structure the block
    ``block_key`` has now: Dynamo runs this in Python while tracing, so a hook added after
    fully_shard counts, at no guard's cost.

    "" under ``torch.compile(dynamic=True)``: the block is then traced inline, as with
    ``regional=False``, because torch 2.13's reuse of a body fails there (``KeyError`` in
    Dynamo's ``stamp_out_subgraph`` once a symbolic size of the first call has been
    specialized). Automatic dynamic shapes, the default, keep one body per block."""
    if not torch._dynamo.config.assume_static_by_default:
        return ""
    key = structure(_BLOCKS[block_key])
    if key not in _BODY_OF:
        name = f"_region_{len(_BODY_OF)}"
        code = _region.__code__.replace(co_name=name)
        body = types.FunctionType(code, _region.__globals__, name)
        setattr(_BODIES, name, torch.compiler.nested_compile_region(max_reuse_entries=_MAX_BODIES)(body))
        _BODY_OF[key] = name
    return _BODY_OF[key]


def _refresh_params(self: nn.Module, fn, recurse: bool = True):
    """``_apply`` (``to_empty``, ``.to``) may replace parameter objects: the wrapper's flat
    dict follows."""
    result = self._mfsdp_region_base._apply(self, fn, recurse)
    self._mfsdp_region_params = _flat_params(self, self._mfsdp_region.owners)
    return result


def _flat_params(block: nn.Module, owners) -> dict[str, nn.Parameter]:
    """The block's sharded parameters by path relative to the block, in the body's order (a
    dict: Dynamo names each graph input after its key, so plans see the parameter's path)."""
    params = {
        f"{path}.{name}" if path else name: block.get_submodule(path)._parameters[name]
        for path, names in owners
        for name in names
    }
    for param in params.values():
        # Read from a dict, a parameter is a plain input to Dynamo, whose sizes
        # dynamic=True makes symbolic (and duck-sizes against the batch's): fixed, in fact.
        torch._dynamo.mark_static(param)
    return params


# One region class per block class (see NOTE: one body per repeated block).
_REGION_CLASSES: dict[type, type] = {}


def _layout(block: nn.Module, shared: set[int]) -> RegionLayout | None:
    """The block's sharded parameters by owner; None when the block cannot be one body: a
    parameter not sharded by fully_shard, one shared with a module outside the block, or a
    float8 weight."""
    owners, infos = defaultdict(list), []
    for path, owner in block.named_modules():
        for name, param in owner._parameters.items():
            if param is None:
                continue
            info = shard_info(param)
            # A float8 weight reaches the body as torchao's Float8TrainingTensor, and torch
            # 2.13's invoke_subgraph takes no tensor-subclass input under AOTAutograd (no rule
            # for it): such a block is traced inline, as with regional=False.
            if info is None or id(param) in shared or info.float8 is not None:
                return None
            owners[path].append(name)
            infos.append(info)
    if not infos:
        return None
    return RegionLayout(owners=tuple((p, tuple(n)) for p, n in owners.items()), infos=tuple(infos))


def _make_region(block: nn.Module, layout: RegionLayout) -> None:
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
            },
        )
    block.__class__ = _REGION_CLASSES[cls]
    block._mfsdp_region_key = next(_BLOCK_KEYS)
    _BLOCKS[block._mfsdp_region_key] = block
    block._mfsdp_region = layout
    block._mfsdp_region_params = _flat_params(block, layout.owners)


def install_regions(root: nn.Module) -> None:
    """Make every outermost repeated block under ``root`` a region (see NOTE: one body per
    repeated block); blocks that already are, or lie inside one, are left alone."""
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
                    _make_region(block, layout)
