"""The pass list, built apart from running it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal

from torch import fx

from fsdp_compile import passes
from fsdp_compile.errors import UsageError
from fsdp_compile.patterns import count_collectives
from fsdp_compile.plan import Plan

Stage = Literal["dynamo", "joint", "partitioned"]
"""Where a pass runs: Dynamo's graph, AOTAutograd's joint graph, or each of the partitioned
forward and backward graphs."""
GraphPass = Callable[[fx.GraphModule, Plan], fx.GraphModule]
Check = Callable[[fx.GraphModule, Plan], None]


@dataclass(frozen=True)
class Pass:
    name: str
    stage: Stage
    run: GraphPass
    check: Check | None = None
    """The pass's postcondition, run after it; None when the pass only inspects."""
    rewrites: bool = True
    """False for passes that only inspect (and raise): nothing new to dump after them."""


def build_pipeline(plan: Plan) -> list[Pass]:
    """The passes for ``plan``'s graph, in order; each stage runs where its graph exists."""
    pipeline = [
        Pass("dedupe_unshards", "dynamo", passes.dedupe_unshards, passes.check_dedupe_unshards),
        Pass("check_rank_agreement", "dynamo", passes.check_rank_agreement, rewrites=False),
        Pass(
            "constant_opaque_outputs",
            "joint",
            passes.constant_opaque_outputs,
            passes.check_constant_opaque_outputs,
        ),
        Pass("lower_collectives", "joint", passes.lower_collectives, passes.check_lower_collectives),
        Pass("reshard", "joint", passes.reshard, passes.check_reshard),
        Pass("bucket_collectives", "partitioned", passes.bucket_collectives, passes.check_bucket_collectives),
        Pass(
            "schedule_collectives",
            "partitioned",
            passes.schedule_collectives,
            passes.check_schedule_collectives,
        ),
    ]
    if plan.options.cuda_graph:
        # First of all: a graph break is refused before any collective (the rank check) runs.
        pipeline.insert(0, Pass("check_graph_breaks", "dynamo", passes.check_graph_breaks, rewrites=False))
        pipeline.append(
            Pass("check_cuda_graph", "partitioned", passes.check_cuda_graph, rewrites=False)
        )
    return pipeline


class PassFailed(RuntimeError):
    """A pass raised or broke its own postcondition; names the pass and the graph."""


def run_passes(
    gm: fx.GraphModule,
    plan: Plan,
    pipeline: list[Pass],
    stage: Stage,
    dump: Callable[[str, fx.GraphModule], None] | None = None,
) -> fx.GraphModule:
    """Run ``stage``'s passes in order, checking each postcondition.

    Each run is recorded in ``gm.meta["mfsdp_passes"]`` (name, seconds, collective counts
    afterwards); ``dump(name, gm)``, when given, sees the graph after every pass.
    """
    record = gm.meta.setdefault("mfsdp_passes", [])
    for p in (p for p in pipeline if p.stage == stage):
        start = time.perf_counter()
        try:
            gm = p.run(gm, plan)
            if p.check is not None:
                p.check(gm, plan)
        except UsageError:
            raise  # the user's to fix, and the message already says how
        except Exception as error:
            raise PassFailed(f"pass {p.name!r} failed on graph {plan.graph_name}: {error}") from error
        record.append(
            {
                "pass": p.name,
                "seconds": time.perf_counter() - start,
                "collectives": dict(count_collectives(gm.graph)),
            }
        )
        if dump is not None and p.rewrites:
            dump(p.name, gm)
    return gm
