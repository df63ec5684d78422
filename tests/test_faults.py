"""Faults: a rank that dies mid-training leaves the others with an error, not a hang; a rank
that hangs is killed and reported by the harness."""

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


def _rank_one_hangs(rank, world, *, pid_file):
    """Rank 1 writes its pid and hangs (no error, no exit); rank 0 returns."""
    if rank == 1:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    return rank


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, killed and not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_a_hung_rank_is_killed_and_reported(tmp_path):
    """The harness waits ``timeout`` for a rank, then kills it (SIGKILL) and fails the test
    naming it, instead of hanging the suite."""
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 produced no result \(killed or timed out\)"):
        spawn(_rank_one_hangs, 2, timeout=5, pid_file=str(pid_file))
    assert time.monotonic() - start < 60
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid), f"rank 1 (pid {pid}) still runs"


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
