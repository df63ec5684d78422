"""The MoE and tensor-parallel examples run under torchrun as documented and learn: CPU always,
GPUs when present."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import free_port

EXAMPLES = Path(__file__).parents[1] / "examples"


def _torchrun(nproc: int, *args: str, cpu: bool, logs: Path, example: str = "train_tiny_moe.py") -> dict:
    # Each rank writes its own stdout and stderr under `logs`, so a rank that dies says why in
    # the failure instead of being cut from torchrun's merged tail.
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
        str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "--log-dir", str(logs), "--redirects", "3", str(EXAMPLES / example), *args,
    ]
    # The example takes the GPUs when it sees them; hiding them runs the CPU (gloo) path.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if cpu else None
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    rank_stderr = {path.parent.name: path.read_text()[-1500:] for path in sorted(logs.rglob("stderr.log"))}
    assert done.returncode == 0, (done.stderr[-1500:], rank_stderr)
    (rank0_stdout,) = (path for path in logs.rglob("stdout.log") if path.parent.name == "0")
    return json.loads(rank0_stdout.read_text().strip().splitlines()[-1])


@pytest.mark.multirank
def test_moe_example_trains_on_4_cpu_ranks(tmp_path):
    """EP 2 x edp 2 on gloo, compiled with the eager runner: the loss falls."""
    result = _torchrun(4, "--steps", "6", cpu=True, logs=tmp_path)
    assert result["world"] == 4 and result["run"]["ep"] == 2
    assert result["last_loss"] < result["first_loss"], result


@pytest.mark.multirank
def test_tensor_parallel_example_trains_on_4_cpu_ranks(tmp_path):
    """dp 2 x tp 2 on gloo, compiled with the eager runner: the loss falls."""
    result = _torchrun(4, "--steps", "6", cpu=True, logs=tmp_path, example="train_tp.py")
    assert result["world"] == 4 and result["tp"] == 2
    assert result["last_loss"] < result["first_loss"], result


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (EP 2, one rank per GPU)")
def test_moe_example_trains_on_gpus(tmp_path):
    result = _torchrun(torch.cuda.device_count(), "--steps", "6", cpu=False, logs=tmp_path)
    assert result["compiler"] == "inductor"
    assert result["last_loss"] < result["first_loss"], result
