"""Test helpers: real multi-rank runs on gloo, the fake process group, one training loop.

``spawn(fn, world, **kwargs)`` runs ``fn(rank, world, **kwargs)`` in ``world`` fresh processes
joined by gloo on 127.0.0.1 (a free port each time) and returns each rank's return value. A rank
that raises fails the test with its traceback; a run past ``timeout`` is killed, never left
hanging.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_compile.models import Transformer, TransformerConfig, loss_fn, make_batch

STEPS = 5
LOCAL_BATCH = 2
SEQ = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank, world, port, out_dir, fn, kwargs, backend, pg_timeout):
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world, **kwargs)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn,
    world: int,
    timeout: float = 600,
    backend: str = "gloo",
    pg_timeout: float = 120,
    allow_dead_ranks: bool = False,
    **kwargs,
) -> list:
    """Run ``fn(rank, world, **kwargs)`` on ``world`` ranks; return each rank's result.

    ``pg_timeout`` is the process group's collective timeout. With ``allow_dead_ranks`` a rank
    that exits without a result yields None instead of failing the test.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [
            ctx.Process(
                target=_child, args=(r, world, port, out_dir, fn, kwargs, backend, pg_timeout)
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        results, errors = [], []
        for rank in range(world):
            path = os.path.join(out_dir, f"{rank}.pt")
            if not os.path.exists(path) and allow_dead_ranks:
                results.append(None)
                continue
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} produced no result (killed or timed out)")
            record = torch.load(path, weights_only=False)
            if "error" in record:
                errors.append(f"rank {rank} failed:\n{record['error']}")
            else:
                results.append(record["ok"])
        if errors:
            # A rank that failed on its own comes first; its peers only lost their connection.
            errors.sort(key=lambda e: "gloo/transport" in e)
            raise AssertionError("\n".join(errors))
        return results


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0):
    """A process group of ``world`` ranks in this process: collectives trace but move no data."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_model(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


def global_batch(cfg: TransformerConfig, step: int, world: int):
    """The batch all ranks see together: the reference trains on exactly this."""
    parts = [make_batch(cfg, LOCAL_BATCH, SEQ, step, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def train(
    model, forward, batches, *, steps: int = STEPS, lr: float = 1e-2, max_norm: float | None = None,
    clip_grad_norm=torch.nn.utils.clip_grad_norm_,
) -> torch.Tensor:
    """The one training loop: AdamW on ``model``'s parameters, ``forward`` runs each step.

    ``forward`` is the model itself or ``torch.compile(model, ...)``; ``batches(step)`` gives
    (tokens, targets); with ``max_norm`` each step clips with ``clip_grad_norm`` before the
    optimizer. Returns this process's per-step losses.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens, targets = batches(step)
        loss = loss_fn(forward(tokens), targets)
        loss.backward()
        if max_norm is not None:
            clip_grad_norm(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def rank_batches(cfg: TransformerConfig, rank: int):
    return lambda step: make_batch(cfg, LOCAL_BATCH, SEQ, step, rank)


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The global mean of per-rank means (equal local batches): comparable to the reference."""
    values = values.clone()
    dist.all_reduce(values)
    return values / dist.get_world_size()


def reference(cfg: TransformerConfig, world: int, steps: int = STEPS, seed: int = 0, max_norm=None):
    """Single-process, unsharded run on the global batch: (losses, {name: full parameter});
    ``max_norm`` clips with torch's own ``clip_grad_norm_``."""
    model = build_model(cfg, seed)
    losses = train(model, model, lambda step: global_batch(cfg, step, world), steps=steps, max_norm=max_norm)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter unsharded (a collective: all ranks call it)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` (2-norm over the whole tensor).

    A norm, not an element-wise maximum: AdamW divides by sqrt(v), so a weight whose gradient
    is near zero turns last-bit summation-order noise into a visible step; that single element
    says nothing about parity while a 1e-5 bound on the norm still catches any wrong gradient.
    """
    scale = expected.double().norm().clamp_min(1e-30)
    return float((actual.double() - expected.double()).norm() / scale)


def max_param_error(actual: dict, expected: dict) -> tuple[float, str]:
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    return max((relative_error(actual[n], expected[n]), n) for n in expected)


TOLERANCE = 1e-5
"""Relative 2-norm error allowed between sharded fp32 training and the reference."""


def with_meshes(shard_options: dict) -> dict:
    """``fully_shard`` options with ``mesh_shape`` (e.g. ``(2, 2)`` for HSDP) and ``ep_size``
    turned into meshes: tests pass plain numbers to spawned ranks, each rank builds its meshes."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile import expert_mesh

    options = dict(shard_options)
    mesh_shape, ep_size = options.pop("mesh_shape", None), options.pop("ep_size", None)
    if mesh_shape is not None:
        options["mesh"] = init_device_mesh("cpu", mesh_shape)
    if ep_size is not None:
        options["expert_mesh"] = expert_mesh("cpu", ep_size)
    return options


def parity_run(rank, world, *, cfg, modes, mesh_shape=None, ep_size=None, max_norm=None, **shard_options):
    """Train once per mode (``none`` = uncompiled markers, else the mfsdp compiler by name) and
    return each mode's loss and parameter errors against the unsharded reference.

    ``shard_options`` go to ``fully_shard`` (strategy, reshard_after_forward, ...);
    ``mesh_shape`` builds the mesh in the rank (e.g. ``(2, 2)`` for HSDP), ``ep_size`` the
    expert mesh (``fsdp_compile.expert_mesh``); ``max_norm`` clips every step
    (``fsdp_compile.clip_grad_norm_`` here, torch's in the reference).
    """
    from fsdp_compile import MfsdpBackend, clip_grad_norm_, fully_shard

    ref_losses, ref_params = reference(cfg, world, max_norm=max_norm)
    results = {}
    for mode in modes:
        torch._dynamo.reset()
        meshes = with_meshes({**shard_options, "mesh_shape": mesh_shape, "ep_size": ep_size})
        model = fully_shard(build_model(cfg), **meshes)
        forward = model if mode == "none" else torch.compile(model, backend=MfsdpBackend(compiler=mode))
        clip = dict(max_norm=max_norm, clip_grad_norm=clip_grad_norm_)
        losses = mean_over_ranks(train(model, forward, rank_batches(cfg, rank), **clip))
        params = full_parameters(model)
        # An expert-parallel ModuleList holds only this rank's experts: compare what the rank
        # holds ("held" lets the test check that the ranks together hold everything).
        expected = ref_params if ep_size is None else {n: ref_params[n] for n in params}
        error, worst = max_param_error(params, expected)
        results[mode] = {
            "loss_error": relative_error(losses, ref_losses),
            "param_error": error,
            "worst_param": worst,
            "held": sorted(params),
        }
    return results


def assert_parity(results, tolerance: float = TOLERANCE):
    for rank_result in results:
        for mode, r in rank_result.items():
            assert r["loss_error"] < tolerance, (mode, r)
            assert r["param_error"] < tolerance, (mode, r)


def persistent_bytes(model, opt) -> dict[str, int]:
    """Bytes this rank holds between steps, by MemTracker: {"param", "grad", "opt"}.

    Tracked after a step, so the walk sees parameters, their ``.grad`` and the optimizer state
    as they persist.
    """
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        pass
    snapshot = tracker.get_tracker_snapshot("current")
    kinds = {"param": _MemRefType.PARAM, "grad": _MemRefType.GRAD, "opt": _MemRefType.OPT}
    return {
        name: sum(device.get(kind, 0) for device in snapshot.values())
        for name, kind in kinds.items()
    }
