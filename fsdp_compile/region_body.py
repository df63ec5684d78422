"""A repeated block's body: the block's own forward run on its gathered weights put in place
of its parameters, one body per block structure (NOTE: one body per repeated block, in
regions.py).

NOTE: structure before guards
    Dynamo's guards miss two things a layer can differ in: a hook on one layer only (Dynamo
    does not guard module hooks by default) and, for a submodule reached through a module
    it has already met, its class. A body compiled for layer 0 would then run for such a
    layer, with wrong numbers and no error (tests/test_regions.py holds both). So blocks are
    first told apart by ``structure``: the compiling backend names a body per structure
    (``MfsdpBackend.body_names``, while tracing), each with a frame of its own
    (``MfsdpBackend.frame``: a code object, a frame cache and a traced output layout of its
    own), and Dynamo's guards only ever choose among blocks alike in structure.

NOTE: tensor-parallel blocks
    A block split by ``parallelize_module`` is a body like any other. Its tensor-parallel
    weights are gathered over the data-parallel dimension in the step's graph, as every
    weight is, and the body reads each as the DTensor tensor parallelism made
    (``DTensor.from_local`` on the tensor-parallel mesh, from constants of the recipe: the
    mesh, placements, shape and stride). The styles' forward hooks and pre-hooks
    (``distribute_module``'s, and the ``PrepareModule*`` styles') run in the body, traced,
    where they turn inputs into DTensors and outputs back: they are not recorded for the step
    to replay (NOTE: hooks inside a repeated block, in side_outputs.py), which could not
    replace an input or output. So the tensor-parallel collectives are the body's, as an
    expert all-to-all is. What those hooks close over (the style's function and layouts, the
    mesh) is part of the structure: layers split alike share one body, layers split
    otherwise get one each. A tensor-parallel block keeps every parameter out of flats
    (regions.py). A call given a DTensor (a residual stream kept as one) or returning one is
    a body too (NOTE: DTensors at a block call, in block_call.py). A module holding tensor
    parallelism's hooks and others stays inline (the body cannot run the one kind and record
    the other on one module).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module

from fsdp_compile.flat_params import note_graded
from fsdp_compile.region_tables import NOT_OPENED, call_layout_of, recipe_of
from fsdp_compile.side_outputs import (
    SideChannel,
    hook_counts,
    put_back_hooks,
    recording_hooks,
    tensor_parallel_signature,
)


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


def region_body(block: nn.Module, layout: str, recipe: str, side: SideChannel, *leaves):
    """The body: the block's forward with its parameters from the gathered weights, each
    flat's members copied out by the call (NOTE: a flat's copies in the block call), its
    modules' forward hooks recorded into ``side`` (NOTE: hooks inside a repeated block)."""
    owners, weights, args, kwargs, _ = _body_arguments(layout, recipe, leaves, copied_out=True)
    held = recording_hooks(block, recipe_of(recipe)[3], side)
    try:
        return _stored_in(block, owners, weights, args, kwargs)
    finally:
        put_back_hooks(held)


def region_inline(block: nn.Module, layout: str, recipe: str, *leaves):
    """The body run eagerly, or traced inline in the caller's frame (``regional=False``)."""
    owners, weights, args, kwargs, copies = _body_arguments(layout, recipe, leaves, copied_out=False)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # Run eagerly, each copy-out's node says at every backward which members have a
        # gradient (see NOTE: parameters without a gradient, in block_fakes.py).
        for flat, members in zip(block._mfsdp_region_flats.values(), copies):
            if members[0].grad_fn is not None:
                members[0].grad_fn.register_prehook(functools.partial(_note_reached, flat))
    return _reparametrized(block, owners, weights, args, kwargs)


def _note_reached(flat: nn.Parameter, grad_outputs: tuple) -> None:
    note_graded(flat, tuple(g is not None for g in grad_outputs), traced=False)


def _body_arguments(layout: str, recipe: str, leaves: tuple, copied_out: bool) -> tuple:
    """A body's leaves as the block's owning submodules, their weights, its forward's
    arguments, and each flat's copied-out members. The leaves start with the gathered
    weights: each flat whole, or with ``copied_out`` its members (padded) one by one, then
    the parameters on their own."""
    n_args, names, widths = call_layout_of(layout)
    unpacks, slots, owners, _, reads, _ = recipe_of(recipe)
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
        if width == NOT_OPENED:
            values.append(leaves[at])
            at += 1
        else:
            values.append(tuple(leaves[at : at + width]))
            at += width
    weights = [members[i] if read is None else _tensor_parallel(members[i], *read) for i, read in zip(slots, reads)]
    return owners, weights, tuple(values[:n_args]), dict(zip(names, values[n_args:])), copies


def _tensor_parallel(piece: torch.Tensor, mesh, _group: str, placements: tuple, shape: tuple, stride: tuple) -> DTensor:
    """A tensor-parallel weight as its block reads it: this rank's piece, gathered over the
    data-parallel dimension, as the DTensor ``parallelize_module`` made (NOTE:
    tensor-parallel blocks)."""
    return DTensor.from_local(piece, mesh, placements, run_check=False, shape=shape, stride=stride)


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
            tensor_parallel_signature(module),
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in module._parameters.items() if t is not None),
            tuple((n, tuple(t.shape), t.dtype) for n, t in module._buffers.items() if t is not None),
        )
        for path, module in block.named_modules()
    )
