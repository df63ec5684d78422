"""Small FX helpers the passes share: inserting ops with fake values, walking chains."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map


def _val(arg: Any) -> Any:
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


def call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    """Insert ``target(*args)`` at the graph's insert point, with ``meta["val"]`` filled.

    Later stages (the min-cut partitioner, Inductor) read sizes and dtypes from
    ``meta["val"]``, so every node a pass adds carries one, computed under the fake mode of its
    inputs.
    """
    node = graph.call_function(target, args)
    vals = tree_map(_val, args)
    fake_mode = next(
        (v.fake_mode for v in vals if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode")),
        None,
    )
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*vals)
    return node


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """Every pass ends here: drop what died, check the graph, regenerate code."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
