"""The simulator: three schedules of the same graphs, ordered as overlap and memory say."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_compile.passes import collective_groups
from fsdp_compile.schedule import NVLINK_GPU
from fsdp_compile.simulate import _graphs, peak_memory, simulate, trace_step

SHAPE = dict(vocab=1024, dim=256, n_layers=3, n_heads=4, hidden=704, max_seq=256)
# Communication comparable to this small model's compute (an H100 link would be all latency).
LINK = dataclasses.replace(NVLINK_GPU, name="fast link", link=1e12, latency=1e-7)


@pytest.fixture(scope="module")
def graphs():
    return trace_step(SHAPE, 8, batch=2, seq=64)


def test_overlap_hides_communication_and_prefetch_costs_memory(graphs):
    """Prefetching schedules expose less communication and finish sooner than waiting at every
    issue, and hold at least as much memory; ours (prefetch 1) equals FSDP2's rules on these
    per-block units."""
    sim = simulate(graphs, LINK)
    none, fsdp2, ours = (sim.schedules[s] for s in ("no_overlap", "fsdp2", "ours"))
    assert sim.world == 8
    assert ours.exposed_comm_seconds < 0.5 * none.exposed_comm_seconds
    assert ours.step_seconds < none.step_seconds
    assert ours.peak_bytes >= none.peak_bytes > 0
    assert ours == fsdp2


def test_no_overlap_schedule_waits_right_after_each_collective(graphs):
    (graph,) = graphs
    for _, gm in _graphs(graph, "no_overlap"):
        for group in collective_groups(gm, graph.plan):
            assert group.collective.next is group.wait[0], group.collective.name
        assert peak_memory(gm) > 0
