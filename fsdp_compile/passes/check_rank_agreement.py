"""Pass (Dynamo graph): all ranks are about to run the same collectives, or all raise.

NOTE: the rank check runs where the ranks compile together
    The check is a collective at compile time, so every rank of the group must run it at the
    same point of the program, before any of the graph's collectives. A backend's first
    compile of a frame in a grad mode is such a point: the step's first call, the first
    evaluation under ``torch.no_grad()``, compile on every rank, and a grad mode is the
    program's, not a batch's. A recompile in the same grad mode often is not: a rank whose
    batch came padded to a longer sequence, or whose last batch is shorter, compiles its
    frame again alone, while the others run the graphs they have, and its check would meet
    their first gather (gloo aborts on the size mismatch; NCCL hangs or reads the wrong
    bytes). So the pipeline runs it only for a plan with ``ranks_in_step``. A recompile for
    shapes gathers what the compile it follows did, in the same order (ranks already differ
    in detail, and ``schedule_collectives`` orders by what they share; NOTE: the planned
    order). Not checked, so: a path that differs between ranks only after a recompile in the
    same grad mode (a turn of gradient sync, ``model.eval()`` with gradients on), and a frame
    after a graph break that one rank reaches alone.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group

from fsdp_compile.errors import CompileUsageError
from fsdp_compile.patterns import is_unshard, marker_param_id
from fsdp_compile.plan import Plan


def collective_fingerprint(gm: fx.GraphModule, plan: Plan, group_name: str) -> str:
    """A digest of the graph's parameter gathers on ``group_name``, in order: what every rank
    of that group must agree on (ranks of one group may belong to different other groups, as
    expert parallelism's edp groups).

    Only the collectives count: ranks may legitimately trace different activation shapes (a
    shorter last batch), and that changes no collective. Backward collectives follow from the
    forward's gathers, so the forward sequence suffices.
    """
    sequence = []
    for node in gm.graph.nodes:
        if is_unshard(node):
            param = plan.param(marker_param_id(node))
            if param.sharding.group_name != group_name:
                continue
            sequence.append((param.param_id, param.sharding.global_shape, group_name, param.sharding.param_dtype))
    return hashlib.sha256(repr(sequence).encode()).hexdigest()[:16]


def check_rank_agreement(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards (when it returns) every rank of the parameters' group compiled a graph with the
    same sequence of parameter collectives. Otherwise every rank raises ``CompileUsageError``
    naming the ranks that differ, instead of hanging in the first mismatched collective.

    Costs one small ``all_gather_object`` per compiled graph, before any of its collectives.
    """
    groups = {p.sharding.group_name for p in plan.params}
    if not groups or not dist.is_initialized():
        return gm
    for group_name in sorted(groups):
        group = _resolve_process_group(group_name)
        if group.size() == 1:
            continue
        mine = collective_fingerprint(gm, plan, group_name)
        fingerprints: list[str] = [""] * group.size()
        dist.all_gather_object(fingerprints, mine, group=group)
        if len(set(fingerprints)) > 1:
            by_rank = ", ".join(f"rank {r}: {f}" for r, f in enumerate(fingerprints))
            raise CompileUsageError(
                f"ranks traced different collectives for graph {plan.graph_name} ({by_rank}): "
                "the forward takes a rank-dependent path (a branch on the rank, on data that "
                "differs between ranks, or modules used on some ranks only). Make every rank "
                "read the same parameters in the same order; every rank raises this error "
                "instead of hanging in the first mismatched collective."
            )
    return gm
