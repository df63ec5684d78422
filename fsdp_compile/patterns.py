"""Node predicates, defined once for every pass, check and test.

The shapes they match, per sharded parameter (``*`` = zero or more, ``[]`` = only when padded)::

    traced (Dynamo / joint graph, before lowering)
        shard ── fsdp_compile.unshard ──> use            grad ── fsdp_compile.reduce_grad ──> .grad
    lowered (joint graph; casts only under mixed precision, [+ pending] only after accumulation)
        shard ─[cast]─[pad]─ all_gather_into_tensor ─ wait_tensor ─[slice]─ view* ──> use
        grad ─[cast]─[+ pending]─[pad]─ reduce_scatter_tensor ─ wait_tensor
             ─[all_reduce ─ wait_tensor]─[slice]─ div ─[cast]──> .grad     (ZeRO-2/3, [HSDP])
        grad ─[cast]─[+ pending]─ all_reduce ─ wait_tensor ─[slice]─ div ─[cast]──> .grad
                                                                           (no_shard, optim)
    bucketed (partitioned graphs; collectives tagged meta["mfsdp_bucket"], see bucket_collectives)
        shards ─ _pre_bucket_all_gather (copy-in) ─ all_gather_into_tensor_out ─ wait_tensor
            ─ view(world, -1) ─ split ─ reshape (copy-out, per parameter) ─[slice]─ view* ──> use
        grads ─ view(world, -1) ─ cat (copy-in) ─ reduce_scatter_tensor ─ wait_tensor ─ split
            ─ view (per parameter) ─[slice]─ div ──> .grad
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import fx

from fsdp_compile import ops as _ops  # noqa: F401  (registers the fsdp_compile:: ops)

UNSHARD = torch.ops.fsdp_compile.unshard.default
REDUCE_GRAD = torch.ops.fsdp_compile.reduce_grad.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
ALL_GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default

COLLECTIVES = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce"}
MARKERS = {UNSHARD: "unshard", REDUCE_GRAD: "reduce_grad"}


def _calls(node: fx.Node, op: torch._ops.OpOverload) -> bool:
    # Dynamo records a custom op call by its packet, AOTAutograd by its overload.
    return node.op == "call_function" and node.target in (op, op.overloadpacket)


def is_unshard(node: fx.Node) -> bool:
    return _calls(node, UNSHARD)


def is_reduce_grad(node: fx.Node) -> bool:
    return _calls(node, REDUCE_GRAD)


def is_marker(node: fx.Node) -> bool:
    return is_unshard(node) or is_reduce_grad(node)


def is_all_gather(node: fx.Node) -> bool:
    """Either spelling: bucketed gathers write into a preallocated buffer (the ``_out`` op)."""
    return _calls(node, ALL_GATHER) or _calls(node, ALL_GATHER_OUT)


def is_reduce_scatter(node: fx.Node) -> bool:
    return _calls(node, REDUCE_SCATTER)


def is_all_reduce(node: fx.Node) -> bool:
    return _calls(node, ALL_REDUCE)


def is_collective(node: fx.Node) -> bool:
    return is_all_gather(node) or is_reduce_scatter(node) or is_all_reduce(node)


def is_wait(node: fx.Node) -> bool:
    return _calls(node, WAIT)


def is_view(node: fx.Node) -> bool:
    """An aten view op: its output aliases its input, so saving it saves the input's storage."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and bool(
        target.is_view
    )


def bucket_index(node: fx.Node) -> int | None:
    """The plan bucket a parameter collective (or its wait) moves; None for user collectives."""
    return node.meta.get("mfsdp_bucket")


def is_param_collective(node: fx.Node) -> bool:
    """An all-gather or reduce-scatter that lower_collectives made for sharded parameters
    (tagged with its bucket once bucketed): what bucketing merges and scheduling moves. Other
    collectives (the user's, an all-reduce) are never merged; an all-reduce that only
    post-processes a parameter's reduce-scatter result moves with that result."""
    return (is_all_gather(node) or is_reduce_scatter(node)) and (
        node.meta.get("mfsdp_param_id") is not None or bucket_index(node) is not None
    )


def gathered_param_id(node: fx.Node) -> int | None:
    """``param_id`` when ``node`` is a gathered parameter: an unbucketed gather's wait, or a
    bucket's per-parameter copy-out; None otherwise."""
    if node.meta.get("mfsdp_unpacked") is not None:
        return node.meta["mfsdp_unpacked"]
    if is_wait(node) and is_all_gather(node.args[0]):
        return node.meta.get("mfsdp_param_id")
    return None


def marker_param_id(node: fx.Node) -> int:
    """The ``param_id`` a marker node carries."""
    assert is_marker(node), node.format_node()
    schema = (UNSHARD if is_unshard(node) else REDUCE_GRAD)._schema
    index = next(i for i, a in enumerate(schema.arguments) if a.name == "param_id")
    return node.args[index] if len(node.args) > index else node.kwargs["param_id"]


def count_collectives(graph: fx.Graph) -> Counter[str]:
    """Collectives and markers in ``graph`` by kind: all_gather, reduce_scatter, all_reduce,
    unshard, reduce_grad."""
    kinds = Counter()
    for node in graph.nodes:
        if is_all_gather(node):
            kinds["all_gather"] += 1
        elif is_reduce_scatter(node):
            kinds["reduce_scatter"] += 1
        elif is_all_reduce(node):
            kinds["all_reduce"] += 1
        elif is_unshard(node):
            kinds["unshard"] += 1
        elif is_reduce_grad(node):
            kinds["reduce_grad"] += 1
    return kinds
