"""Pass (joint graph): opaque objects reach the backward as constants, not as saved values."""

from __future__ import annotations

import warnings

from torch import fx
from torch._library.fake_class_registry import FakeScriptObject
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile.fx_utils import finish
from fsdp_compile.passes.reshard import RESHARD_AC_GRAPH_ID
from fsdp_compile.plan import Plan


def _opaque_input(node: object) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "placeholder"
        and isinstance(node.meta.get("val"), FakeScriptObject)
    )


def constant_opaque_outputs(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards no output of the joint graph is an opaque input (a ``DeviceMesh``): each is a
    ``get_attr`` of the object itself, tagged for recomputation so the backward reads it again.

    Under ``torch.utils.checkpoint``, a region whose ops save RNG state (scaled-dot-product
    attention does) is traced with the DTensor parameters' ``DeviceMesh`` as an opaque graph
    input, and the gradient DTensors are rebuilt from it, so it appears among the gradient
    outputs. Read from a placeholder, the partitioner saves it for backward, and AOTAutograd's
    runtime (torch 2.13) rejects a saved non-tensor ("expected all tensors_saved_with_vc_check
    to be Tensors"). The mesh is the same object every step, so the backward may hold it as a
    constant: nothing is saved and activation checkpointing composes with sharding.
    ``get_attr`` alone is not enough: untagged, the partitioner would still save it.
    """
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    constants: dict[fx.Node, fx.Node] = {}
    for node in output.all_input_nodes:
        if not _opaque_input(node):
            continue
        name = f"_mfsdp_opaque_{len(constants)}"
        setattr(gm, name, node.meta["val"].real_obj)
        with gm.graph.inserting_before(output), warnings.catch_warnings():
            # FX warns for attributes that are not modules, parameters or buffers; an opaque
            # object is none of those, and the partitioned graphs copy it like any attribute.
            warnings.filterwarnings("ignore", message="Attempted to insert a get_attr")
            constant = gm.graph.get_attr(name)
        # Recomputing a get_attr is reading it again: the partitioner puts one in backward.
        constant.meta = {
            **node.meta,
            "recompute": CheckpointPolicy.MUST_RECOMPUTE,
            "ac_graph_id": RESHARD_AC_GRAPH_ID,
        }
        constants[node] = constant
    if constants:
        output.args = fx.node.map_arg(output.args, lambda n: constants.get(n, n))
    return finish(gm)


def check_constant_opaque_outputs(gm: fx.GraphModule, plan: Plan) -> None:
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    left = [n.name for n in output.all_input_nodes if _opaque_input(n)]
    assert not left, f"opaque inputs still returned: {left}"
