"""The pass list, built once per compiled graph apart from running it."""

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


class PassFailed(RuntimeError):
    """A pass raised or broke its own postcondition; names the pass and the graph."""


@dataclass(frozen=True)
class Pipeline:
    """The passes for one plan's graph, in order; each stage runs where its graph exists."""

    plan: Plan
    passes: tuple[Pass, ...]

    def run(
        self,
        gm: fx.GraphModule,
        stage: Stage,
        dump: Callable[[str, fx.GraphModule], None] | None = None,
        record: list[dict] | None = None,
    ) -> fx.GraphModule:
        """Run ``stage``'s passes in order, checking each postcondition.

        Each run is appended to ``record`` when given (pass, seconds, collective counts
        afterwards): never to the graph's own ``meta``, which the compile cache hashes, and
        timings differ run to run. ``dump(name, gm)``, when given, sees the graph after every
        pass.
        """
        record = [] if record is None else record
        for p in (p for p in self.passes if p.stage == stage):
            start = time.perf_counter()
            try:
                gm = p.run(gm, self.plan)
                if p.check is not None:
                    p.check(gm, self.plan)
            except UsageError:
                raise  # the user's to fix, and the message already says how
            except Exception as error:
                raise PassFailed(f"pass {p.name!r} failed on graph {self.plan.graph_name}: {error}") from error
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


def build_pipeline(plan: Plan) -> Pipeline:
    """The passes ``plan``'s options ask for, in the order they run."""
    options = plan.options
    dynamo = [
        # First of all: a graph break is refused before any collective (the rank check) runs.
        *([Pass("check_graph_breaks", "dynamo", passes.check_graph_breaks, rewrites=False)] if options.cuda_graph else []),
        Pass("drop_block_probes", "dynamo", passes.drop_block_probes, passes.check_drop_block_probes),
        Pass("dedupe_unshards", "dynamo", passes.dedupe_unshards, passes.check_dedupe_unshards),
        # Its collective runs where every rank compiles this graph (NOTE: the rank check runs
        # where the ranks compile together, in check_rank_agreement.py).
        *([Pass("check_rank_agreement", "dynamo", passes.check_rank_agreement, rewrites=False)] if plan.ranks_in_step else []),
    ]
    joint = [
        Pass("constant_opaque_outputs", "joint", passes.constant_opaque_outputs, passes.check_constant_opaque_outputs),
        Pass("lower_collectives", "joint", passes.lower_collectives, passes.check_lower_collectives),
        Pass("pack_in_reduce_dtype", "joint", passes.pack_in_reduce_dtype, passes.check_pack_in_reduce_dtype),
        Pass("reshard", "joint", passes.reshard, passes.check_reshard),
        Pass("save_block_rng", "joint", passes.save_block_rng, passes.check_save_block_rng),
    ]
    partitioned = [
        Pass("replay_block_rng", "partitioned", passes.replay_block_rng, passes.check_replay_block_rng),
        Pass(
            "keep_only_differentiated_calls", "partitioned", passes.keep_only_differentiated_calls,
            passes.check_keep_only_differentiated_calls,
        ),
        Pass("bucket_collectives", "partitioned", passes.bucket_collectives, passes.check_bucket_collectives),
        Pass("copy_out_flats", "partitioned", passes.copy_out_flats, passes.check_copy_out_flats),
        Pass(
            "separate_gradient_outputs", "partitioned", passes.separate_gradient_outputs,
            passes.check_separate_gradient_outputs,
        ),
        Pass("schedule_collectives", "partitioned", passes.schedule_collectives, passes.check_schedule_collectives),
        *([Pass("check_cuda_graph", "partitioned", passes.check_cuda_graph, rewrites=False)] if options.cuda_graph else []),
    ]
    return Pipeline(plan, tuple(dynamo + joint + partitioned))
