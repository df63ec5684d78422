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

NOTE: an all-to-all's sizes are compared, a gather's are not
    A gather's size is the parameter's, whatever the batch. An all-to-all sends activations:
    the MoE layer's expert dispatch sends equal splits sized by the local token count
    (``dispatch_to_experts``), so EP ranks whose batches differ in shape (each padded to its
    own longest sequence) would send what their peers do not expect to receive. Each rank
    sends what each peer expects, element for element, or all raise. Only static sizes are
    compared: a symbolic size (``dynamic=True``, or splits read from a tensor) may differ
    between ranks by design, and is left out.
"""

from __future__ import annotations

import hashlib
import math

import torch.distributed as dist
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group

from fsdp_compile.errors import CompileUsageError
from fsdp_compile.patterns import is_traced_all_to_all, is_unshard, marker_param_id, op_argument
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


def all_to_all_elements(gm: fx.GraphModule) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]] | None]]:
    """Each group's all-to-alls, in graph order: the elements this rank sends to each rank of
    the group and expects from each, or None where a size is symbolic (NOTE: an all-to-all's
    sizes are compared, a gather's are not)."""
    exchanges: dict[str, list] = {}
    for node in gm.graph.nodes:
        if not is_traced_all_to_all(node):
            continue
        sent = node.args[0].meta.get("example_value", node.args[0].meta.get("val"))
        received_rows, sent_rows = op_argument(node, "output_split_sizes"), op_argument(node, "input_split_sizes")
        of_group = exchanges.setdefault(str(op_argument(node, "group_name")), [])
        if not all(isinstance(size, int) for size in (*sent.shape, *received_rows, *sent_rows)):
            of_group.append(None)
            continue
        row = math.prod(sent.shape[1:])
        of_group.append((tuple(n * row for n in sent_rows), tuple(n * row for n in received_rows)))
    return exchanges


def first_mismatched_exchange(exchanges: list[list]) -> str:
    """The first all-to-all (index in the graph) at which a rank sends another rank other than
    what that rank expects, said with both sizes; "" when none does. ``exchanges[r]`` is rank
    r's ``all_to_all_elements`` of one group."""
    for index, per_rank in enumerate(zip(*exchanges)):
        if any(exchange is None for exchange in per_rank):
            continue
        for source, (sends, _) in enumerate(per_rank):
            for target, (_, expects) in enumerate(per_rank):
                if sends[target] != expects[source]:
                    return (
                        f"all-to-all {index}: rank {source} sends rank {target} {sends[target]} "
                        f"elements, rank {target} expects {expects[source]}"
                    )
    return ""


def check_rank_agreement(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Afterwards (when it returns) every rank of the parameters' group compiled a graph with the
    same sequence of parameter collectives, and in each group its all-to-alls of static sizes
    send each rank what that rank expects. Otherwise every rank raises ``CompileUsageError``
    naming the ranks that differ, instead of hanging in the first mismatched collective.

    Costs one small ``all_gather_object`` per group, before any of the graph's collectives.
    """
    if not dist.is_initialized():
        return gm
    exchanges_by_group = all_to_all_elements(gm)
    groups = {p.sharding.group_name for p in plan.params} | exchanges_by_group.keys()
    # Every rank walks its groups in one global order: two groups never wait on each other.
    for group_name in sorted(groups):
        group = _resolve_process_group(group_name)
        if group.size() == 1:
            continue
        mine = (collective_fingerprint(gm, plan, group_name), exchanges_by_group.get(group_name, []))
        gathered: list = [None] * group.size()
        dist.all_gather_object(gathered, mine, group=group)
        fingerprints = [fingerprint for fingerprint, _ in gathered]
        exchanges = [exchange for _, exchange in gathered]
        counts = [len(exchange) for exchange in exchanges]
        if len(set(fingerprints)) > 1 or len(set(counts)) > 1:
            said = [f"{f}, {n} all-to-alls" if len(set(counts)) > 1 else f for f, n in zip(fingerprints, counts)]
            by_rank = ", ".join(f"rank {r}: {f}" for r, f in enumerate(said))
            raise CompileUsageError(
                f"ranks traced different collectives for graph {plan.graph_name} ({by_rank}): "
                "the forward takes a rank-dependent path (a branch on the rank, on data that "
                "differs between ranks, or modules used on some ranks only). Make every rank "
                "read the same parameters in the same order; every rank raises this error "
                "instead of hanging in the first mismatched collective."
            )
        mismatch = first_mismatched_exchange(exchanges)
        if mismatch:
            raise CompileUsageError(
                f"ranks of group {group_name} would send each other sizes the receivers do not expect in "
                f"graph {plan.graph_name} ({mismatch}): an all-to-all of equal splits, as the MoE layer's "
                "dispatch to its experts, is sized by the local batch, and these ranks' batches "
                "differ in shape (each padded to its own longest sequence, or a shorter last batch). "
                "Give every rank of an expert-parallel group batches of one shape (pad to a fixed "
                "length, drop the last partial batch); every rank raises this error instead of "
                "aborting or hanging in the all-to-all."
            )
    return gm
