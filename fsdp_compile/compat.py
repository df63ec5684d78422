"""Workarounds for the torch releases we support, each scoped to the call that needs it.

Each names the torch behaviour it works around and is a no-op where torch already does the
right thing, so that a torch fix needs no change here.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch import fx
from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
from torch._higher_order_ops.passes import inline_invoke_subgraph as _inlining
from torch._inductor import output_code
from torch.distributed.device_mesh import DeviceMesh


@contextlib.contextmanager
def compile_caches_work() -> Iterator[None]:
    """Inside, torch 2.13's AOTAutograd and Inductor caches work for graphs of DTensors:
    a restart finds the entry the first process wrote, and the graph it loads runs.

    - The key is stable. Inductor's FX graph key pickles each ``DeviceMesh`` input whole,
      the ``_hash`` it caches included: ``hash()`` of a tuple of strings, salted per process,
      so every process got a different key and never hit. The state pickled here leaves
      that cached value out (``DeviceMesh.__hash__`` computes it again when it is missing).
    - The loaded graph has its opaque constants. A fresh compile builds the module with the
      graph's opaque constants (``get_attr`` of a ``DeviceMesh``, kept in
      ``CompiledFxGraph.torchbind_constants`` and pickled with the cache entry), but a cache
      hit hands the module only ``constants`` and ``opaque_value_type_classes``, and the
      constant read ``None``. Our backward returns each DTensor gradient's ``DeviceMesh``
      as such a constant (pass ``constant_opaque_outputs``), so the gradient came back
      without a mesh and the first op on it failed ("found no DeviceMesh from dtensor args
      for aten::detach"). The constants the entry holds are added under whatever torch
      already returns.

    Both are patched only while the backend compiles (or loads) a graph, and are no-ops
    where torch does this itself.
    """
    classes = (output_code.CompiledFxGraphConstants, output_code.CompiledFxGraphConstantsWithGm)
    unwraps = {cls: cls.__dict__["unwrap"] for cls in classes}
    mesh_getstate = DeviceMesh.__getstate__

    def with_constants(original):
        def unwrap(self, graph):
            return {**getattr(graph, "torchbind_constants", {}), **original(self, graph)}

        return unwrap

    def getstate_without_hash(self) -> dict:
        state = mesh_getstate(self)
        state.pop("_hash", None)
        return state

    for cls, original in unwraps.items():
        cls.unwrap = with_constants(original)
    DeviceMesh.__getstate__ = getstate_without_hash
    try:
        yield
    finally:
        for cls, original in unwraps.items():
            cls.unwrap = original
        DeviceMesh.__getstate__ = mesh_getstate


def _operand_layout(operands: tuple) -> tuple:
    """What of a body call's operands the schema depends on: each tensor's metadata and which
    operands share storage (aliasing decides what a write reaches); other operands as they are."""
    storages: dict[int, int] = {}
    layout = []
    for operand in operands:
        if isinstance(operand, torch.Tensor):
            storage = storages.setdefault(id(operand.untyped_storage()), len(storages))
            # Sizes as text: under dynamic shapes they are SymInts, which do not hash; the
            # same symbol prints the same.
            layout.append((
                type(operand), str((tuple(operand.shape), operand.stride(), operand.storage_offset())),
                operand.dtype, operand.device, operand.requires_grad, storage,
            ))
        else:
            layout.append((type(operand), repr(operand)))
    return tuple(layout)


@contextlib.contextmanager
def body_schema_once() -> Iterator[None]:
    """Inside, AOTAutograd traces a repeated block's body once per body and operand layout to
    learn whether it writes an input, instead of once per call.

    torch 2.13's autograd rule for ``invoke_subgraph`` asks for the call's schema at every
    call (``maybe_run_autograd`` in torch/_ops.py, to refuse in-place writes to inputs), and
    ``InvokeSubgraphHOP.gen_schema`` builds it by tracing the body anew
    (``materialize_as_graph``). AOTAutograd passes through each call three times (metadata,
    joint trace), so a 32-layer model traced its one body 96 times: 9 s of a 16 s joint trace
    on the CPU proxy (docs/performance.md). The schema is a function of the body and its
    operands' layout, so it is kept per body object (weakly: the bodies die with their graph)
    and layout, and the refusal still happens, once. A no-op where torch caches it itself.
    """
    original = InvokeSubgraphHOP.gen_schema
    schemas: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def gen_schema(self, subgraph, identifier, *operands):
        try:
            per_body = schemas.setdefault(subgraph, {})
        except TypeError:  # a body that cannot be weakly referenced: no caching
            return original(self, subgraph, identifier, *operands)
        key = (identifier, _operand_layout(operands))
        if key not in per_body:
            per_body[key] = original(self, subgraph, identifier, *operands)
        return per_body[key]

    InvokeSubgraphHOP.gen_schema = gen_schema
    try:
        yield
    finally:
        InvokeSubgraphHOP.gen_schema = original


def pre_bucket_all_gather_args(ins, world: int, group_name: str, dtype, out_dtype_ints, rank: int, foreach_groups) -> tuple:
    """The arguments of Inductor's ``bucketing::_pre_bucket_all_gather`` (the op that copies a
    bucket's shards into one buffer) in the order this torch's schema has them: torch 2.12
    takes the group's name after the world size, 2.13 no longer does."""
    schema = torch.ops.bucketing._pre_bucket_all_gather.default._schema
    named = {a.name for a in schema.arguments}
    return (ins, world, *((group_name,) if "group_name" in named else ()), dtype, out_dtype_ints, rank, foreach_groups)


def inline_invoke_subgraph(gm: fx.GraphModule) -> fx.GraphModule:
    """torch's ``inline_invoke_subgraph``: every body call replaced by the body's nodes.

    A body may read modules of its own (a checkpointed block's ``fwd_body_0``). torch 2.13
    moves them onto the graph that receives the body's nodes; 2.12 copies the ``get_attr``
    nodes without them, and the inlined graph reads a module it does not have. Where torch
    does not move them, they are moved here first, under names unique in the receiving graph.
    """
    if not hasattr(_inlining, "hoist_submodules"):
        for receiver in list(gm.modules()):
            if isinstance(receiver, fx.GraphModule):
                _hoist_body_modules(receiver)
    return _inlining.inline_invoke_subgraph(gm)


def _hoist_body_modules(receiver: fx.GraphModule) -> None:
    calls = receiver.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    for body_name in {str(call.args[0].target) for call in calls}:  # a body called by every layer: once
        body = getattr(receiver, body_name)
        for child_name, child in list(body.named_children()):
            name = f"{body_name}_{child_name}"
            receiver.add_module(name, child)
            body.add_module(name, child)
            for read in body.graph.find_nodes(op="get_attr", target=child_name):
                read.target = name
