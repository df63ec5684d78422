"""The bench's emulated link (``--emulate-link``): collectives take their modeled time.

Each check runs in a fresh process: making a process rank 0 of an emulated world replaces a
functional collective's kernel there for good (fsdp_compile/bench/emulated_link.py).
Durations are asserted from below (a sleep never ends early) and loosely from above, so a
loaded machine can only make a check pass more slowly, not fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

_PROBE = textwrap.dedent(
    """
    import dataclasses, json, time
    import torch, torch.distributed as dist
    from fsdp_compile.bench.emulated_link import init_emulated_group
    from fsdp_compile.patterns import CollectiveFacts
    from fsdp_compile.cost_model import NVLINK_GPU, collective_seconds

    # A slow link, so that its durations dwarf the machine's own noise: 1 GB/s, 1 ms a step.
    hardware = dataclasses.replace(NVLINK_GPU, link=1e9, latency=1e-3)
    group = init_emulated_group(hardware, 8)
    shard = torch.ones(2**20)
    out = torch.empty(8 * 2**20)
    modeled = collective_seconds(
        CollectiveFacts(kind="all_gather", group_name="", world=8, nbytes=out.numel() * 4,
                        dtype=torch.float32), hardware)

    def timed(run):
        blocked, start = group.exposed_s, time.perf_counter()
        run()
        return time.perf_counter() - start, group.exposed_s - blocked

    def alone():
        dist.all_gather_into_tensor(out, shard, async_op=True).wait()

    def hidden():
        work = dist.all_gather_into_tensor(out, shard, async_op=True)
        time.sleep(2 * modeled)  # compute longer than the collective
        work.wait()

    def queued():
        dist.all_gather_into_tensor(out, shard, async_op=True)
        dist.all_gather_into_tensor(out, shard, async_op=True).wait()

    def compiled_spelling():  # what a bucketed gather in a compiled graph runs
        result = torch.ops._c10d_functional.all_gather_into_tensor_out(
            shard, 8, group.group_name, out=out)
        torch.ops._c10d_functional.wait_tensor(result)

    results = {name: timed(fn) for name, fn in
               [("alone", alone), ("hidden", hidden), ("queued", queued), ("compiled", compiled_spelling)]}
    print(json.dumps({"modeled": modeled, "gathered_ones": bool((out == 1).all()), **results}))
    """
)


@pytest.mark.structure
def test_a_collective_takes_its_modeled_time_and_compute_hides_it():
    """An all-gather waited on at once blocks for the ring alpha-beta time of its bytes (the
    simulator's model); one overlapped with longer compute blocks for nothing; two issued
    back to back share the link, so the second ends after both; the ``_out`` spelling a
    compiled bucket uses is timed as well. Data: every piece is this rank's shard."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.strip().splitlines()[-1])
    modeled = r["modeled"]
    assert modeled == pytest.approx(7e-3 + 32 * 2**20 * 7 / 8 / 1e9)
    assert r["gathered_ones"]
    for name in ("alone", "compiled"):
        elapsed, exposed = r[name]
        assert elapsed >= modeled and 0.8 * modeled <= exposed <= modeled + 1e-3, (name, r)
    assert r["hidden"][1] < 0.1 * modeled, r
    assert r["queued"][0] >= 2 * modeled, r


@pytest.mark.structure
def test_the_bench_measures_exposed_communication_on_an_emulated_link(tmp_path):
    """``--fake-world 4 --emulate-link ib``: every mode reports the time its step blocked on
    the link, and the census comes from the link itself (a Python group's collectives
    dispatch no op the profiler sees): FSDP2's 5 gathers and 3 reduce-scatters, and for
    mfsdp the same count its compiled graphs hold. ``gather_whole_members`` runs on the link
    (a Python process group, which c10d cannot coalesce for): each member its own collective,
    the same bytes, the same losses."""
    path = tmp_path / "bench.json"
    command = [
        sys.executable, "-m", "fsdp_compile.bench", "--preset", "tiny", "--fake-world", "4",
        "--emulate-link", "ib", "--device", "cpu", "--modes", "fsdp2,mfsdp,mfsdp-gather-whole",
        "--compiler", "eager",
        "--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "3", "--json", str(path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(path.read_text())
    assert document["config"]["emulate_link"] == "ib"
    results = {r["mode"]: r for r in document["results"]}
    for mode, r in results.items():
        assert r["exposed_comm_ms"] is not None and r["exposed_comm_ms"] >= 0, (mode, r)
        assert r["profiled_collectives"]["counted_by"].startswith("emulated link"), r
    fsdp2 = results["fsdp2"]["profiled_collectives"]
    assert (fsdp2["all_gather"], fsdp2["reduce_scatter"]) == (5, 3), fsdp2
    mfsdp = results["mfsdp"]
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert mfsdp["profiled_collectives"][kind] == mfsdp["collectives"][kind], mfsdp
    whole, issued = results["mfsdp-gather-whole"], mfsdp["profiled_collectives"]
    assert whole["profiled_collectives"]["all_gather"] > issued["all_gather"], whole
    assert whole["profiled_collectives"]["all_gather_bytes"] == issued["all_gather_bytes"], whole
    assert (whole["loss_step0"], whole["final_loss"]) == (mfsdp["loss_step0"], mfsdp["final_loss"]), whole


_CUDA_PROBE = textwrap.dedent(
    """
    import dataclasses, json
    import torch, torch.distributed as dist
    from fsdp_compile.bench.emulated_link import init_emulated_group
    from fsdp_compile.patterns import CollectiveFacts
    from fsdp_compile.cost_model import NVLINK_GPU, collective_seconds

    hardware = dataclasses.replace(NVLINK_GPU, link=1e9, latency=1e-3)
    group = init_emulated_group(hardware, 8)
    shard, out = torch.ones(2**20, device="cuda"), torch.empty(8 * 2**20, device="cuda")
    modeled = collective_seconds(
        CollectiveFacts(kind="all_gather", group_name="", world=8, nbytes=out.numel() * 4,
                        dtype=torch.float32), hardware)
    dist.all_gather_into_tensor(out, shard, async_op=True).wait()  # calibrates the sleep
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dist.all_gather_into_tensor(out, shard, async_op=True).wait()
    end.record()
    end.synchronize()
    print(json.dumps({"modeled": modeled, "stream_s": start.elapsed_time(end) / 1e3}))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA link runs on a GPU")
def test_on_cuda_the_compute_stream_waits_the_modeled_time():
    """CUDA: the collective is a sleep kernel on a communication stream and ``wait()`` makes
    the compute stream wait for it; the compute stream sees the modeled duration."""
    done = subprocess.run([sys.executable, "-c", _CUDA_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.9 * r["modeled"] <= r["stream_s"] <= 1.5 * r["modeled"] + 1e-3, r
