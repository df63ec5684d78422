"""The constants a repeated block's traced forward reads (NOTE: one body per repeated block, in
regions.py): each through a function Dynamo runs rather than traces
(``assume_constant_result``), which looks the block up by key and returns what its wrapper
gathers, how its body regroups its leaves, and which layers share its body. Each table only
names, by a key that is a constant of the graph, what a block or a block call owns."""

from __future__ import annotations

import ast
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_compile.block_record import Recipe, call_record, flag_sources
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.flat_params import check_linked
from fsdp_compile.accumulation import marker_args
from fsdp_compile.records import shard_info
from fsdp_compile.side_outputs import hooked_modules, layer_indices


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


@torch._dynamo.assume_constant_result
def gather_recipe(block_key: int) -> tuple:
    """What the wrapper of the block ``block_key`` gathers, as constants (run, not traced, by
    Dynamo): the markers' arguments of its flat parameters, then of the parameters on their
    own, which of those are float8 weights, and the key of its recipe (``RECIPES``), which the
    block keeps. Refuses a block whose
    parameters were replaced since ``fully_shard``: its wrapper would gather the old ones."""
    block = BLOCKS[block_key]
    _check_params(block)
    return (
        tuple(marker_args(shard_info(f), f.dtype) for f in block._mfsdp_region_flats.values()),
        tuple(marker_args(shard_info(p), p.dtype) for p in block._mfsdp_region_params.values()),
        tuple(shard_info(p).float8 is not None for p in block._mfsdp_region_params.values()),
        _recipe_key(block),
    )


@torch._dynamo.assume_constant_result
def block_flag_sources(block_key: int) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """Where the flags of the block ``block_key`` are (run, not traced, by Dynamo): the
    wrapper reads them traced, so that a flag changed after the step compiled fails its guards
    (NOTE: parameters without a gradient, in block_fakes.py)."""
    return flag_sources(BLOCKS[block_key])


# How gathered values become a block's parameters: per flat, ``split_gathered``'s arguments and
# the rows each member keeps; the body's weights as indices into the members and the parameters
# on their own; the owners those weights go to; the modules whose hooks the body records; per
# weight, the tensor-parallel DTensor it is read as (NOTE: tensor-parallel blocks, in
# region_body.py), else None; per weight on its own, its float8 cast (``_float8_reads``). The
# same for every block of one structure and sharding, so a body's frame sees one value. The
# table names them only: each block owns the recipe it gathers with (``_mfsdp_recipe``) and each
# block call the one it was traced with, so a recipe goes with the last of them.
RECIPES: weakref.WeakValueDictionary[str, Recipe] = weakref.WeakValueDictionary()
_RECIPE_KEYS = itertools.count()


def _recipe_key(block: nn.Module) -> str:
    layout: RegionLayout = block._mfsdp_region
    flats = block._mfsdp_region_flats.values()
    paths = layout.paths()
    value = (
        tuple((f._mfsdp_layout.unpack_args(shard_info(f).param_dtype), f._mfsdp_layout.trims()) for f in flats),
        layout.slots,
        tuple((tuple(path.split(".")) if path else (), names) for path, names in layout.owners),
        hooked_modules(block),
        tuple(_tensor_parallel_read(param_at(block, paths[i])) for i in layout.slots),
        _float8_reads(block),
    )
    recipe = getattr(block, "_mfsdp_recipe", None)
    if recipe is None or recipe.value != value:
        # A key is a string, since a body's frame takes it as an argument: Dynamo may make an
        # int argument symbolic (a step compiled with ``dynamic=True``, an int that changed
        # between calls), and the body could then not read its table without a graph break
        # (torch 2.13) or an internal error (2.11); it never makes a string symbolic.
        recipe = next((r for r in list(RECIPES.values()) if r.value == value), None)
        if recipe is None:
            recipe = Recipe(key=str(next(_RECIPE_KEYS)), value=value)
            RECIPES[recipe.key] = recipe
        block._mfsdp_recipe = recipe
    return recipe.key


def _float8_reads(block: nn.Module) -> tuple:
    """Per parameter gathered on its own, ``(Float8Gather, dtype its matmuls compute in)`` for
    a float8 weight, else None; empty where the block holds none (NOTE: float8 weights in a
    block call, in block_call.py)."""
    infos = [shard_info(p) for p in block._mfsdp_region_params.values()]
    if all(info.float8 is None for info in infos):
        return ()
    return tuple(None if info.float8 is None else (info.float8, info.param_dtype) for info in infos)


def _tensor_parallel_read(param: nn.Parameter) -> tuple | None:
    """A tensor-parallel weight's DTensor as (mesh, its group's name, placements, shape,
    stride): constants a body's frame reads (``assume_constant_result`` hands back plain
    tuples and meshes). The group's name is there for the recipe's equality: meshes compare
    by ranks and names, so a mesh of a process group made again after one was destroyed
    would match the old recipe, and its body would read the old mesh."""
    read = shard_info(param).tensor_parallel
    if read is None:
        return None
    return (read.mesh, read.mesh.get_group().group_name, read.placements, read.shape, read.stride)


@torch._dynamo.assume_constant_result
def recipe_of(recipe: str) -> tuple:
    return RECIPES[recipe].value


def _check_params(block: nn.Module) -> None:
    layout: RegionLayout = block._mfsdp_region
    for path in layout.paths():
        try:
            param_at(block, path)
        except (AttributeError, KeyError):
            raise CompileUsageError(
                f"{type(block).__name__}.{path}, sharded by fully_shard, is no longer there: a "
                "module of the block was replaced after fully_shard (by PEFT's get_peft_model, "
                "or another wrapper of its layers?). Sharding happens once: change the model "
                "first (get_peft_model, then fully_shard), as under FSDP2."
            ) from None
    current = [param_at(block, path) for path in layout.paths()]
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


def param_at(block: nn.Module, path: str) -> nn.Parameter:
    owner, _, name = path.rpartition(".")
    return block.get_submodule(owner)._parameters[name]


NOT_OPENED = -1


@torch._dynamo.assume_constant_result
def opened_at(opened: tuple[bool, ...]) -> tuple[int, ...]:
    """The positions of the arguments that are tuples, last first (run, not traced, by
    Dynamo)."""
    return tuple(at for at in range(len(opened) - 1, -1, -1) if opened[at])


# A body call's layout, how its flat leaves regroup: (positional count, keyword names, widths),
# the first width the gathered weights'. Its key is its own repr, a string of ints and names:
# the same layout has the same key in every process, whatever was compiled before.
@torch._dynamo.assume_constant_result
def call_layout(
    n_args: int, names: tuple[str, ...], n_gathered: int, opened: tuple[bool, ...], sizes: tuple[int, ...],
    is_tensor: tuple[bool, ...],
) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """The key of this call's layout, then the positions of its tensor
    leaves and of its constant ones (run, not traced, by Dynamo). ``sizes``: the lengths of
    the tuples ``opened`` marks, last first."""
    size = iter(reversed(sizes))
    widths = (n_gathered, *(next(size) if o else NOT_OPENED for o in opened))
    return (
        repr((n_args, names, widths)),
        tuple(at for at, t in enumerate(is_tensor) if t),
        tuple(at for at, t in enumerate(is_tensor) if not t),
    )


@torch._dynamo.assume_constant_result
def call_layout_of(layout: str) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    # Run, not traced: Dynamo does not trace the parser.
    return ast.literal_eval(layout)


# The region blocks by key, for the functions Dynamo runs rather than traces (they take
# constants only).
BLOCKS: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()


# Keys, not id(block): id() of a module in the traced wrapper is an ID_MATCH guard on it.
BLOCK_KEYS = itertools.count()


@torch._dynamo.assume_constant_result
def layers_of(block_key: int) -> tuple[int, ...]:
    return layer_indices(BLOCKS[block_key])


@torch._dynamo.assume_constant_result
def call_output_form(call: int) -> tuple:
    """How the call's outputs regroup, how many are the block's, the form of the side values
    after them, and, where the block returned DTensors, each output's spec (NOTE: DTensors at
    a block call, in block_call.py): known once ``block_forward``'s fake kernel ran."""
    traced = call_record(call).traced
    specs = traced["output_specs"]
    return traced["form"], traced["own"], traced["side"], tuple(specs) if any(specs) else ()
