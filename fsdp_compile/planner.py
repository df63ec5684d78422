"""Planning: the decisions a ``Plan`` holds, made from a Dynamo graph and the sharding
records ``fully_shard`` left on its parameters.

NOTE: bucket rules
    Which parameters share one all-gather and one reduce-scatter: the bucket plan.

    A bucket is a run of parameters, consecutive in the order the forward first reads them, that
    share a key: their ``fully_shard`` unit, or, when the root was the only unit, the repeated block
    they lie in (``ShardInfo.block``: ``layers.3``, one layer of a stack), plus whether they are freed
    after forward, their process groups, strategy, wire dtype, gradient-reduction dtype and reduce
    op, so a bucket never mixes groups, strategies, dtypes, reduce ops or reshard decisions. A run
    longer than the byte cap is split greedily; a parameter larger than the cap is a bucket of its
    own.

    Parameters kept gathered from forward to backward (the root's own under NOTE: the reshard
    default, in fsdp_compile/api.py) form one bucket per key wherever the forward reads them:
    the embedding at the start, the final norm at the end. Splitting them would save no memory
    where it matters (they are all alive from the end of forward to the start of backward, the
    step's peak) and costs a collective each way: one bucket is what FSDP2 gathers for its root.
    Parameters freed after forward form one bucket per run instead (an embedding freed after its
    lookup is not gathered again with the head).
"""

from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import get_plain_tensors
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor

from fsdp_compile.records import shard_info
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.markers import gradient_reduce_op
from fsdp_compile.patterns import is_unshard, marker_param_id
from fsdp_compile.plan import BackendOptions, BucketPlan, ParamPlan, Plan

__all__ = ["build_plan", "plan_buckets"]


def _source_name(node: fx.Node) -> str:
    """The parameter's dotted path, e.g. ``layers.0.attn.wqkv.weight``.

    Dynamo's source reads ``L['self']._modules['layers']._modules['0']..._parameters['weight']``;
    the quoted keys after the root are the path.
    """
    grapharg = node.meta.get("grapharg")
    if grapharg is None:
        return node.name
    keys = re.findall(r"\['([^']+)'\]", grapharg.source.name)
    return ".".join(keys[1:]) if len(keys) > 1 else grapharg.source.name


def _gathered_inputs(example_inputs: list) -> tuple[int, ...]:
    """The positions of the inputs marked as gathered weights among the joint graph's inputs,
    where AOTAutograd has opened each tensor subclass into its inner tensors (torch's
    ``get_plain_tensors``: a float8 weight's data and scale, NOTE: float8 weights in a block
    call), every inner one a gathered weight's too."""
    gathered, at = [], 0
    for value in example_inputs:
        width = len(get_plain_tensors(value, out=[])) if isinstance(value, torch.Tensor) else 1
        if getattr(value, "_mfsdp_gathered", False):
            gathered.extend(range(at, at + width))
        at += width
    return tuple(gathered)


def build_plan(gm: fx.GraphModule, example_inputs: list, options: BackendOptions, ranks_in_step: bool) -> Plan:
    """Read the sharded parameters a Dynamo graph takes as inputs into a ``Plan``
    (``ranks_in_step``: see ``Plan``).

    Raises ``CompileUsageError`` for a plain ``nn.Parameter`` among the inputs: the model (or
    part of it) was never given to ``fully_shard``, and running it would silently train an
    unsharded replica per rank.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = []
    # A repeated block's body (a frame of its own, NOTE: one op per block call) takes its
    # gathered weights as inputs marked so.
    gathered = _gathered_inputs(example_inputs)
    for node, value in zip(placeholders, example_inputs):
        info = shard_info(value)
        if info is None:
            if isinstance(value, nn.Parameter):
                raise CompileUsageError(
                    f"parameter {_source_name(node)} was not sharded by fsdp_compile: call "
                    "fsdp_compile.fully_shard(model) before torch.compile(model, backend='mfsdp'). "
                    "A model sharded by torch.distributed.fsdp.fully_shard (FSDP2) gathers its "
                    "parameters in eager hooks, which mfsdp does not compose with: shard it with "
                    "fsdp_compile.fully_shard instead, or keep FSDP2 and compile its blocks with "
                    "backend='inductor'."
                )
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        params.append(
            ParamPlan(
                sharding=info,
                fqn=_source_name(node),
                shard_rows=local.shape[0],
                dtype=local.dtype,
                rank=_resolve_process_group(info.group_name).rank(),
                requires_grad=value.requires_grad,
                reduce_op=gradient_reduce_op(info.group_name, info.replicate_group_name, info.grad_divisor, info.reduce_dtype),
            )
        )
    graph_name = gm.meta.get("dynamo_compile_id", None) or getattr(gm, "_mfsdp_name", "graph")
    read_order = [marker_param_id(n) for n in gm.graph.nodes if is_unshard(n)]
    if -1 in read_order:  # NOTE: a block compiled by another backend, in gathered_reads.py
        raise CompileUsageError(
            "the mfsdp backend was reached through a wrapper fsdp_compile cannot see through (a "
            "function or object of yours around it), so the model's reads took it for another "
            "backend and left their parameters unnamed. Pass backend=\"mfsdp\" or an MfsdpBackend "
            "itself to torch.compile."
        )
    buckets = plan_buckets(
        params, read_order, enabled=options.bucketing, cap_bytes=options.bucket_cap_bytes
    )
    return Plan(
        graph_name=str(graph_name), options=options, params=tuple(params), buckets=buckets, gathered_inputs=gathered,
        ranks_in_step=ranks_in_step,
    )


def _common_path(fqns: Sequence[str]) -> str:
    parts = [fqn.split(".")[:-1] for fqn in fqns]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common) or "<root>"


def _gather_dtype(run: Sequence[ParamPlan]) -> torch.dtype:
    dtypes = {p.wire_dtype for p in run}
    return dtypes.pop() if len(dtypes) == 1 else torch.uint8


def plan_buckets(
    params: Sequence[ParamPlan],
    read_order: Sequence[int],
    *,
    enabled: bool,
    cap_bytes: int | None,
) -> tuple[BucketPlan, ...]:
    """Group ``params`` into buckets (NOTE: bucket rules, in this module's docstring).

    ``read_order`` lists ``param_id``s as the forward first reads them; parameters it misses
    follow in plan order. ``enabled=False`` gives one bucket per parameter (the unbucketed
    schedule); ``cap_bytes=None`` leaves runs unsplit.
    """
    by_id = {p.param_id: p for p in params}
    ordered = [by_id[i] for i in dict.fromkeys(read_order) if i in by_id]
    ordered += [p for p in params if p.param_id not in set(read_order)]
    one_unit = len({p.sharding.unit for p in params}) == 1

    def key(p: ParamPlan) -> tuple:
        # The strategy and replicate group decide which collectives a member has at all.
        s = p.sharding
        return (
            s.block if one_unit else s.unit,
            s.reshard_after_forward,
            s.group_name,
            s.replicate_group_name,
            s.strategy,
            # The compute dtype, not the wire's: a float8 weight shares its unit's bucket
            # (bytes packed byte-exactly, see NOTE: bucket layout in bucket_collectives).
            s.param_dtype,
            s.reduce_dtype,
            p.reduce_op,  # one reduce-scatter reduces its members one way
        )

    def fits(run: list[ParamPlan] | None, param: ParamPlan) -> bool:
        return run is not None and (
            cap_bytes is None or sum(p.gathered_bytes for p in run) + param.gathered_bytes <= cap_bytes
        )

    runs: list[list[ParamPlan]] = []
    kept: dict[tuple, list[ParamPlan]] = {}  # the open bucket of each key kept gathered
    for param in ordered:
        last = runs[-1] if runs else None
        if not param.sharding.reshard_after_forward:
            last = kept.get(key(param))
        if enabled and fits(last, param) and key(last[0]) == key(param):
            last.append(param)
        else:
            runs.append([param])
            if not param.sharding.reshard_after_forward:
                kept[key(param)] = runs[-1]
    return tuple(
        BucketPlan(
            index=i,
            name=_common_path([p.fqn for p in run]),
            param_ids=tuple(p.param_id for p in run),
            group_name=run[0].sharding.group_name,
            reshard_after_forward=run[0].sharding.reshard_after_forward,
            param_dtype=_gather_dtype(run),
            reduce_dtype=run[0].sharding.reduce_dtype,
            gathered_bytes=sum(p.gathered_bytes for p in run),
        )
        for i, run in enumerate(runs)
    )
