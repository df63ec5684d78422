"""Pass (joint graph): a gradient reduced in a wider dtype than it was computed in is packed
once, in the reduce dtype.

NOTE: gradients packed once
    Under mixed precision a block's gradients are computed in ``param_dtype`` (bf16) and
    reduced in ``reduce_dtype`` (fp32). As traced, a flat parameter's members' gradients are
    packed rank-major for the reduce-scatter in bf16, and the lowered ``reduce_grad`` then
    casts the whole gathered-size gradient to fp32: one more read and write of it, which
    FSDP2 does not pay (its copy-in writes its fp32 buffer straight from the bf16 gradients).
    The pack is a node of the step's graph wherever a flat is: in a block traced inline
    (``regional=False``, or a flat read outside a block call) it is the autograd rule of the
    copy-out, and behind a block call it is the block op's autograd formula (NOTE: a flat's
    copies in the block call, in block_call.py). A widening cast of its result becomes the
    pack's own ``dtype`` (``pack_for_reduce_scatter``, which casts as it copies): the copy of
    the widened values is the widened copy. The pack takes the cast's parameter tag, so it
    moves with its reduce-scatter's issue (``schedule_collectives``).

    Every cast removed changes no value, so the numbers are the eager markers' (which pack
    in bf16 and cast), and every node removed is a cast or the pack it folds into. A
    bucket's copy-in does the same for parameters reduced on their own (NOTE: bucket
    layout, in bucket_collectives.py).
"""

from __future__ import annotations

import torch
from torch import fx

from fsdp_compile.bucket_copies import widens
from fsdp_compile.fx_utils import call, finish, inserting
from fsdp_compile.patterns import (
    PACK_FOR_REDUCE_SCATTER,
    cast_dtype,
    is_pack_for_reduce_scatter,
)
from fsdp_compile.plan import Plan

aten = torch.ops.aten


def _foldable_pack(cast: fx.Node) -> fx.Node | None:
    """The pack whose result ``cast`` widens (through one view), read by nothing else: it
    can write the widened values itself."""
    source = cast.args[0]
    pack = source.args[0] if source.target is aten.view.default else source
    if not (isinstance(pack, fx.Node) and is_pack_for_reduce_scatter(pack)):
        return None
    alone = len(pack.users) == 1 and len(source.users) == 1
    return pack if alone and widens(pack.meta["val"].dtype, cast_dtype(cast)) else None


def _pack_widened(graph: fx.Graph, cast: fx.Node, pack: fx.Node) -> None:
    """``cast``'s pack, written in the cast's dtype; the cast and the old pack go."""
    view = cast.args[0] if cast.args[0] is not pack else None
    with inserting(graph, before=pack):
        widened = call(graph, PACK_FOR_REDUCE_SCATTER, *pack.args[:2], cast_dtype(cast))
        result = widened if view is None else call(graph, view.target, widened, *view.args[1:], **view.kwargs)
    for old, new in ((pack, widened), (view, result)):
        if old is not None:  # provenance and tags; not the old call's values and inputs
            new.meta.update({k: v for k, v in old.meta.items() if k not in ("val", "eager_input_vals")})
    cast.replace_all_uses_with(result)
    for node in (cast, view, pack):
        if node is not None:
            graph.erase_node(node)


def pack_in_reduce_dtype(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no gradient is cast between its pack and its reduction: a widening cast of
    a pack read by nothing else is the pack's own ``dtype``, tagged with the cast's parameter
    (NOTE: gradients packed once). Every cast removed is exact: the numbers are unchanged.
    """
    graph = gm.graph
    for cast in [n for n in graph.nodes if cast_dtype(n) is not None]:
        if (pack := _foldable_pack(cast)) is not None:
            _pack_widened(graph, cast, pack)
    return finish(gm)


def check_pack_in_reduce_dtype(gm: fx.GraphModule, plan: Plan) -> None:
    left = [
        n.name for n in gm.graph.nodes
        if cast_dtype(n) is not None and _foldable_pack(n) is not None
    ]
    assert not left, f"gradients cast after their pack: {left}"
