"""The planned collective order survives Inductor: read from the code it generates."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.testing.models import TransformerConfig, make_batch
from fsdp_compile.patterns import is_collective, is_wait
from harness import build_model, fake_process_group

pytestmark = pytest.mark.structure

_ISSUE = re.compile(r"_c10d_functional\.(all_gather_into_tensor|all_gather_into_tensor_out|reduce_scatter_tensor)\.default\(")
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\(")


def _code_events(code: str) -> list[str]:
    """"issue" / "wait" per collective call of a generated module, in code order."""
    events = []
    for line in code.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if _ISSUE.search(line):
            events.append("issue")
        elif _WAIT.search(line):
            events.append("wait")
    return events


def _graph_events(gm) -> list[str]:
    return ["issue" if is_collective(n) else "wait" for n in gm.graph.nodes if is_collective(n) or is_wait(n)]


def _gathers_ahead(events: list[str]) -> list[int]:
    """For each issue, how many issues came before it that were not yet waited on."""
    ahead, open_ = [], 0
    for event in events:
        if event == "issue":
            ahead.append(open_)
            open_ += 1
        else:
            open_ -= 1
    return ahead


def test_inductor_code_issues_collectives_in_the_planned_order():
    """With the Inductor compiler the generated forward and backward call every collective and
    wait in the scheduled graph's order, so every planned prefetch survives. Without
    options["compiler"]'s config patch, Inductor's peak-memory reordering put every wait right
    after its gather; with the gather issued after the glue between two blocks (before
    schedule_collectives issued it where that glue starts), Inductor's fusion of the glue with
    the next block's first use pulled the previous wait in front of the final norm's gather."""
    cfg = TransformerConfig(n_layers=2)
    with fake_process_group(8):
        model = fully_shard(build_model(cfg))
        # compile_cache=False: the test reads the compiled graphs, which a cache hit never builds.
        backend = MfsdpBackend(compiler="inductor", compile_cache=False)
        tokens, _ = make_batch(cfg, 2, 8, 0)
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            _, (forward_code, backward_code) = run_and_get_code(torch.compile(model, backend=backend), tokens)
    (graph,) = backend.graphs
    planned_forward, planned_backward = (_graph_events(graph.compiled[r]) for r in ("forward", "backward"))
    assert _code_events(backward_code) == planned_backward
    assert _code_events(forward_code) == planned_forward
    assert planned_forward.count("issue") == len(graph.plan.buckets)
    planned_ahead = _gathers_ahead(planned_forward)
    assert planned_ahead[1:] == [1] * (len(planned_ahead) - 1)  # prefetch 1
