"""Faults: a rank that dies mid-training leaves the others with an error, not a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch

from fsdp_compile import MfsdpBackend, fully_shard
from fsdp_compile.testing.models import TransformerConfig, loss_fn, make_batch
from harness import build_model, spawn

pytestmark = pytest.mark.multirank

PG_TIMEOUT = 15


def _rank_one_dies(rank, world):
    """Both ranks train one compiled step; then rank 1 exits and rank 0 tries another."""
    cfg = TransformerConfig()
    model = fully_shard(build_model(cfg))
    forward = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
    tokens, targets = make_batch(cfg, 2, 8, 0, rank)
    loss_fn(forward(tokens), targets).backward()
    torch.distributed.barrier()
    if rank == 1:
        os._exit(1)  # a crash: no clean shutdown, no goodbye to the peers
    time.sleep(1)
    start = time.monotonic()
    try:
        loss_fn(forward(tokens), targets).backward()
    except Exception as error:  # whatever the backend reports, it must come, and come soon
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_surviving_rank_errors_within_the_process_group_timeout():
    result, dead = spawn(_rank_one_dies, 2, timeout=PG_TIMEOUT * 4, pg_timeout=PG_TIMEOUT, allow_dead_ranks=True)
    assert dead is None  # rank 1 really died
    assert result["error"] is not None, "the surviving rank finished a step with a dead peer"
    assert result["seconds"] < PG_TIMEOUT + 10, result


def _environment(rank, world):
    return os.environ.get("MFSDP_TEST_SPAWN_ENV"), os.environ.get("MFSDP_TEST_SPAWN_UNSET")


def test_ranks_see_the_environment_of_the_test_as_of_the_spawn(monkeypatch):
    """Ranks fork from the harness's fork server, started with the environment of the first
    spawn; each must still see the test's environment as it is when it spawns."""
    monkeypatch.setenv("MFSDP_TEST_SPAWN_ENV", "set by this test")
    spawn(_environment, 1)  # the server may start here, with the variable set
    monkeypatch.delenv("MFSDP_TEST_SPAWN_ENV")
    monkeypatch.setenv("MFSDP_TEST_SPAWN_UNSET", "set later")
    assert spawn(_environment, 2) == [(None, "set later")] * 2
