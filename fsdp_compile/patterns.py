"""Node predicates, defined once for every pass, check and test.

The shapes they match, per sharded parameter (``*`` = zero or more, ``[]`` = only when padded)::

    traced (Dynamo / joint graph, before lowering)
        shard ── fsdp_compile.unshard ──> use            grad ── fsdp_compile.reduce_grad ──> .grad
    a flat parameter's (fsdp_compile/flat_params.py), traced and joint
        flat ─ unshard ─ split_gathered ─ getitem (per member) ─[slice]──> use
        grads (per member) ─ pack_for_reduce_scatter ─ view ─ reduce_grad ──> the flat's .grad
    a flat a block call reads (NOTE: a flat's copies in the block call, in block_call.py), joint
        flat ─ unshard ─ block_forward            (the call copies the members out)
        block_backward ─ getitem (per member) ─ pack_for_reduce_scatter ─ view ─ reduce_grad ──> the flat's .grad
            (the block op's autograd formula packs the members' gradients)
    lowered (joint graph; casts only under mixed precision, [+ pending] only after accumulation,
    div only where the plan's reduce_op is "sum": see NOTE: averaging in the collective, in markers.py)
        shard ─[cast]─[pad]─ all_gather_into_tensor ─ wait_tensor ─[slice]─ view* ──> use
        grad ─[cast]─[+ pending]─[pad]─ reduce_scatter_tensor ─ wait_tensor
             ─[all_reduce ─ wait_tensor]─[slice]─[div]─[cast]──> .grad     (ZeRO-2/3, [HSDP])
        grad ─[cast]─[+ pending]─ all_reduce ─ wait_tensor ─[slice]─[div]─[cast]──> .grad
                                                                           (no_shard, optim)
    bucketed (partitioned graphs; collectives tagged meta[BUCKET], see bucket_collectives)
        shards ─ _pre_bucket_all_gather (copy-in) ─ all_gather_into_tensor_out ─ wait_tensor
            ─ split_gathered (copy-out) ─ getitem (per parameter) ─[slice]─ view* ──> use
        grads ─ pack_for_reduce_scatter (copy-in) ─ reduce_scatter_tensor ─ wait_tensor ─ split
            ─ view (per parameter) ─[slice]─[div]──> .grad
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group

from fsdp_compile.node_meta import BUCKET, BYTES_BY_DTYPE, CARRIES, PARAM_ID, UNPACKED
from fsdp_compile import bucket_copies as _bucket_copies  # noqa: F401  (registers its ops)
from fsdp_compile import whole_gathers as _whole_gathers  # noqa: F401  (registers its op)
from fsdp_compile.block_call import BLOCK_BACKWARD, BLOCK_FORWARD, BLOCK_GRADED, RNG_STATE
from fsdp_compile import markers as _markers  # noqa: F401  (registers the fsdp_compile:: ops)
from fsdp_compile.float8 import FLOAT8_CAST

UNSHARD = torch.ops.fsdp_compile.unshard.default
REDUCE_GRAD = torch.ops.fsdp_compile.reduce_grad.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
ALL_GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
ALL_TO_ALL_AUTOGRAD = torch.ops._c10d_functional_autograd.all_to_all_single.default
"""``all_to_all_single_autograd`` as torch 2.11's Dynamo records it (2.13's records ALL_TO_ALL);
AOTAutograd lowers it to ALL_TO_ALL."""
WAIT = torch.ops._c10d_functional.wait_tensor.default
SPLIT_GATHERED = torch.ops.fsdp_compile.split_gathered.default
GATHER_WHOLE_MEMBERS = torch.ops.fsdp_compile.gather_whole_members.default
PACK_FOR_REDUCE_SCATTER = torch.ops.fsdp_compile.pack_for_reduce_scatter.default
CONVERT_ELEMENT_TYPE = torch.ops.prims.convert_element_type.default

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


def _calls(node: fx.Node, op: torch._ops.OpOverload) -> bool:
    # Dynamo records a custom op call by its packet, AOTAutograd by its overload.
    return node.op == "call_function" and node.target in (op, op.overloadpacket)


def is_unshard(node: fx.Node) -> bool:
    return _calls(node, UNSHARD)


def is_reduce_grad(node: fx.Node) -> bool:
    return _calls(node, REDUCE_GRAD)


def is_float8_cast(node: fx.Node) -> bool:
    """The cast of a gathered float8 weight (see NOTE: float8 gathers, in fsdp_compile/float8.py)."""
    return _calls(node, FLOAT8_CAST)


def is_marker(node: fx.Node) -> bool:
    return is_unshard(node) or is_reduce_grad(node)


def is_all_gather(node: fx.Node) -> bool:
    """Any spelling: bucketed gathers write into a preallocated buffer (the ``_out`` op), a
    flat gathered member by member is ``gather_whole_members`` (NOTE: members gathered whole,
    in fsdp_compile/whole_gathers.py)."""
    return _calls(node, ALL_GATHER) or _calls(node, ALL_GATHER_OUT) or _calls(node, GATHER_WHOLE_MEMBERS)


def is_unbucketed_all_gather(node: fx.Node) -> bool:
    """``all_gather_into_tensor`` itself: one sharded tensor's gather, into a tensor the
    collective allocates (a bucket's writes into its buffer, ``_out``)."""
    return _calls(node, ALL_GATHER)


def is_reduce_scatter(node: fx.Node) -> bool:
    return _calls(node, REDUCE_SCATTER)


def is_all_reduce(node: fx.Node) -> bool:
    return _calls(node, ALL_REDUCE)


def is_all_to_all(node: fx.Node) -> bool:
    return _calls(node, ALL_TO_ALL)


def is_traced_all_to_all(node: fx.Node) -> bool:
    """An all-to-all in Dynamo's graph, on any supported torch (see ``ALL_TO_ALL_AUTOGRAD``)."""
    return is_all_to_all(node) or _calls(node, ALL_TO_ALL_AUTOGRAD)


def is_collective(node: fx.Node) -> bool:
    """Any functional collective: ours (gathers, reductions) or the user's (an expert
    all-to-all, an all-reduce in the model)."""
    return is_all_gather(node) or is_reduce_scatter(node) or is_all_reduce(node) or is_all_to_all(node)


def is_wait(node: fx.Node) -> bool:
    return _calls(node, WAIT)


def is_split_gathered(node: fx.Node) -> bool:
    """A gathered buffer's copy-out: a bucket's, or a flat parameter's (NOTE: flat parameters,
    in fsdp_compile/flat_params.py)."""
    return _calls(node, SPLIT_GATHERED)


def is_pack_for_reduce_scatter(node: fx.Node) -> bool:
    return _calls(node, PACK_FOR_REDUCE_SCATTER)


def is_block_call(node: fx.Node) -> bool:
    """A repeated block's call (its forward or its backward; NOTE: one op per block call, in
    fsdp_compile/block_call.py)."""
    return _calls(node, BLOCK_FORWARD) or _calls(node, BLOCK_BACKWARD)


def is_block_forward(node: fx.Node) -> bool:
    return _calls(node, BLOCK_FORWARD)


def is_block_probe(node: fx.Node) -> bool:
    """The fake-run probe of a block call traced inline (``block_graded``), dropped from
    Dynamo's graph by the pass drop_block_probes."""
    return _calls(node, BLOCK_GRADED)


def named_calls(gm: fx.GraphModule) -> list[int]:
    """The block calls ``gm`` names (``block_forward``'s and the probes' call indices), in its
    subgraphs too (the regions ``torch.utils.checkpoint`` traces as one)."""
    graphs = (g for g in gm.modules() if isinstance(g, fx.GraphModule))
    return [n.args[2] for g in graphs for n in g.graph.nodes if is_block_forward(n) or is_block_probe(n)]


def is_rng_state(node: fx.Node) -> bool:
    """A read of the random generators' state for a block call's recompute (passes
    save_block_rng and replay_block_rng)."""
    return _calls(node, RNG_STATE)


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype ``node`` converts its input to, where it does nothing else: a
    ``convert_element_type``, or a ``_to_copy`` given only a dtype (how autograd casts a
    gradient to its input's dtype); None for any other node."""
    if node.op != "call_function":
        return None
    if node.target is CONVERT_ELEMENT_TYPE:
        return node.args[1]
    if node.target is torch.ops.aten._to_copy.default and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def grad_mode_set(node: fx.Node) -> bool | None:
    """The grad mode a Dynamo graph's node switches to (``with torch.no_grad()`` is traced as
    ``torch._C._set_grad_enabled(False)`` ... ``(True)``), or None for any other node."""
    if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
        return bool(node.args[0])
    return None


def is_view(node: fx.Node) -> bool:
    """An aten view op: its output aliases its input, so saving it saves the input's storage."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and bool(
        target.is_view
    )


def bucket_index(node: fx.Node) -> int | None:
    """The plan bucket a parameter collective (or its wait) moves; None for user collectives."""
    return node.meta.get(BUCKET)


def is_ours(node: fx.Node) -> bool:
    """A node fsdp_compile made: a marker, or what a pass inserted for a parameter or a bucket
    (lowered chains carry ``mfsdp_param_id``, bucket copies ``mfsdp_bucket``). Only these may
    be removed when dead (see NOTE: nothing the user wrote is removed, in fx_utils.py)."""
    if is_marker(node):
        return True
    return any(node.meta.get(key) is not None for key in (PARAM_ID, BUCKET, UNPACKED))


def is_param_collective(node: fx.Node) -> bool:
    """An all-gather or reduce-scatter that lower_collectives made for sharded parameters
    (tagged with its bucket once bucketed): what bucketing merges and scheduling moves. Other
    collectives (the user's, an all-reduce) are never merged; an all-reduce that only
    post-processes a parameter's reduce-scatter result moves with that result."""
    return (is_all_gather(node) or is_reduce_scatter(node)) and (
        node.meta.get(PARAM_ID) is not None or bucket_index(node) is not None
    )


def gathered_param_id(node: fx.Node) -> int | None:
    """``param_id`` when ``node`` is a gathered parameter: an unbucketed gather's wait, or a
    bucket's per-parameter copy-out; None otherwise."""
    if node.meta.get(UNPACKED) is not None:
        return node.meta[UNPACKED]
    if is_wait(node) and is_all_gather(node.args[0]):
        return node.meta.get(PARAM_ID)
    return None


def marker_param_id(node: fx.Node) -> int:
    """The ``param_id`` a marker node carries."""
    assert is_marker(node), node.format_node()
    schema = (UNSHARD if is_unshard(node) else REDUCE_GRAD)._schema
    index = next(i for i, a in enumerate(schema.arguments) if a.name == "param_id")
    return node.args[index] if len(node.args) > index else node.kwargs["param_id"]


@dataclass(frozen=True, kw_only=True)
class CollectiveFacts:
    """What one collective node moves: the facts every reader (the schedule pass, the dumps,
    ``explain``, the bench census, the simulator) takes from here and nowhere else."""

    kind: CollectiveKind
    group_name: str
    world: int
    """Ranks in the group."""
    nbytes: int
    """The full-size tensor: the gathered output (all_gather), the reduced input
    (reduce_scatter, all_reduce), the sent input (all_to_all)."""
    dtype: torch.dtype
    """What the bytes are: a float8 gather moves its float8 bytes as ``uint8`` (the type gloo
    and NCCL move) and says ``float8_e4m3fn`` here (``meta[CARRIES]``); a bucket of
    several dtypes says ``uint8``."""
    members_by_dtype: tuple[tuple[torch.dtype, int], ...] = ()
    """A merged gather's members' bytes by what they are (``meta[BYTES_BY_DTYPE]``,
    set by bucket_collectives); empty otherwise."""

    @property
    def bytes_by_dtype(self) -> dict[torch.dtype, int]:
        """``nbytes`` by what the bytes are: each member of a bucket under its own dtype,
        else all under ``dtype``."""
        return dict(self.members_by_dtype) or {self.dtype: self.nbytes}


def op_argument(node: fx.Node, name: str):
    """Argument ``name`` of a call to an aten-style op, given by position or keyword."""
    schema = node.target._schema if hasattr(node.target, "_schema") else node.target.default._schema
    index = next(i for i, a in enumerate(schema.arguments) if a.name == name)
    return node.args[index] if len(node.args) > index else node.kwargs[name]


def collective_kind(node: fx.Node) -> CollectiveKind:
    assert is_collective(node), node.format_node()
    if is_all_gather(node):
        return "all_gather"
    if is_reduce_scatter(node):
        return "reduce_scatter"
    return "all_reduce" if is_all_reduce(node) else "all_to_all"


def collective_facts(node: fx.Node) -> CollectiveFacts:
    """Kind, group, world, bytes and dtype of a collective node (see ``CollectiveFacts``)."""
    kind = collective_kind(node)
    group_name = str(op_argument(node, "group_name"))
    if kind in ("all_gather", "reduce_scatter"):
        world = int(op_argument(node, "group_size"))
    else:  # all_reduce and all_to_all name only their group
        world = _resolve_process_group(group_name).size()
    full = node.meta["val"] if kind == "all_gather" else node.args[0].meta["val"]
    nbytes = full.numel() * full.element_size()
    dtype = node.meta.get(CARRIES, full.dtype)
    return CollectiveFacts(
        kind=kind,
        group_name=group_name,
        world=world,
        nbytes=nbytes,
        dtype=dtype,
        members_by_dtype=tuple(node.meta.get(BYTES_BY_DTYPE, {}).items()),
    )


def count_collectives(graph: fx.Graph) -> Counter[str]:
    """Collectives and markers in ``graph`` by kind: all_gather, reduce_scatter, all_reduce,
    all_to_all, unshard, reduce_grad."""
    kinds = Counter()
    for node in graph.nodes:
        if is_collective(node):
            kinds[collective_kind(node)] += 1
        elif is_unshard(node):
            kinds["unshard"] += 1
        elif is_reduce_grad(node):
            kinds["reduce_grad"] += 1
    return kinds
