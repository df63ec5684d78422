"""Test helpers: real multi-rank runs on gloo, the fake process group, one training loop.

``spawn(fn, world, **kwargs)`` runs ``fn(rank, world, **kwargs)`` in ``world`` fresh processes
joined by gloo on 127.0.0.1 (a free port each time) and returns each rank's return value. A rank
that raises fails the test with its traceback; a run past ``timeout`` is killed, never left
hanging.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import socket
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_compile.records import gathered_params
from fsdp_compile.testing.models import Transformer, TransformerConfig, loss_fn, make_batch

STEPS = 5
LOCAL_BATCH = 2
SEQ = 16
EP_WORLD, EP = 4, 2
"""Expert-parallel runs: 4 ranks as EP 2 x edp 2."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_HF_FAMILIES = ("llama", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt2", "t5")
"""The HuggingFace families the multirank tests build in their ranks (test_hf_habits.py,
test_regions.py); transformers imports a family's modeling module on first use, 1.2 s for
these."""
_RANK_PRELOAD = [
    "torch", "torch.distributed", "fsdp_compile", "harness", "pytest",
    *(f"transformers.models.{family}.modeling_{family}" for family in _HF_FAMILIES),
]
"""What each rank would import first: the fork server imports it once, its ranks fork from it
(a module that does not import is skipped, as the fork server does)."""


def _rank_context():
    """Ranks start from a fork server that has imported ``_RANK_PRELOAD`` once for the whole
    test run, not from a fresh interpreter each (importing torch and fsdp_compile took 3.5 to
    8.5 s a rank on the 2-core box). The server only imports: it runs no torch op and holds no
    process group or CUDA context a fork could copy (importing torch starts one idle helper
    thread, as it does before DataLoader workers fork)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)
    return ctx


def _child(rank, world, port, out_dir, fn, kwargs, backend, pg_timeout, environ):
    # Forked from the server, not from the test: the environment is the test's as of now.
    os.environ.clear()
    os.environ.update(environ)
    # A rank killed by a signal (a segfault, glibc's abort on a corrupt heap) leaves no
    # traceback of its own: this prints every thread's Python stack to the test's stderr.
    faulthandler.enable(all_threads=True)
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
    ctx = _rank_context()
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        environ = dict(os.environ)
        procs = [
            ctx.Process(
                target=_child, args=(r, world, port, out_dir, fn, kwargs, backend, pg_timeout, environ)
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


@contextlib.contextmanager
def one_rank_group():
    """A real gloo process group of one rank in this process: its collectives compute (a
    reduce-scatter over one rank returns its input), so gradients can be compared bit for bit;
    the fake group's leave their outputs unwritten on torch 2.11."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compile_one_step(model, cfg: TransformerConfig, *, rank: int = 0, dynamic: bool | None = None, **options):
    """The one compiled graph of one training step: ``model`` (already sharded, on the current
    process group) compiled with the eager runner and ``options``, run forward and backward on
    ``rank``'s 2 x 8 batch of step 0. Fails unless the step compiled to exactly one graph."""
    from fsdp_compile import MfsdpBackend

    backend = MfsdpBackend(compiler="eager", **options)
    tokens, targets = make_batch(cfg, 2, 8, 0, rank)
    loss_fn(torch.compile(model, backend=backend, dynamic=dynamic)(tokens), targets).backward()
    (graph,) = backend.graphs
    return graph


def moe_config(*, fused: bool, **overrides) -> TransformerConfig:
    """One MoE block, 4 experts marked expert-parallel, no token dropped (capacity factor 2
    with top-2 of 4: per-rank routing equals the reference's global routing)."""
    return TransformerConfig(
        n_layers=1, n_experts=4, top_k=2, capacity_factor=2.0,
        fused_experts=fused, expert_parallel=True, **overrides,
    )


def build_model(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


def global_batch(cfg: TransformerConfig, step: int, world: int):
    """The batch all ranks see together: the reference trains on exactly this."""
    parts = [make_batch(cfg, LOCAL_BATCH, SEQ, step, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


SUMMATION_ORDER_EPS = 1e-6
"""AdamW's epsilon for a parity run whose kernels sum in an order of their own. AdamW's first
step moves each element by about ``lr * g / (|g| + eps)``: with torch's 1e-8, an element whose
gradient is itself ~1e-8 (a cancellation) steps by a fraction of ``lr`` that fp32 summation
order decides. Measured (test transformer, 2 ranks, Inductor compiling only the block bodies,
``compile_outside_blocks=False``): one element of ``mlp.down.weight`` with gradient -2.31e-8 in
the reference and -2.00e-8 compiled put the weight 7.1e-5 (relative) off, while the losses
agreed to 8.6e-7. Not for float8 runs: there a last-bit difference flips a float8 rounding
in a later cast whatever eps is, and which elements flip depends on it."""


def train(
    model, forward, batches, *, steps: int = STEPS, lr: float = 1e-2, max_norm: float | None = None,
    clip_grad_norm=torch.nn.utils.clip_grad_norm_, criterion=loss_fn, adam_eps: float = 1e-8,
) -> torch.Tensor:
    """The one training loop: AdamW on ``model``'s parameters, ``forward`` runs each step.

    ``forward`` is the model itself or ``torch.compile(model, ...)``; ``batches(step)`` gives
    (inputs, targets) and ``criterion(outputs, targets)`` the loss (the test transformer's by
    default); with ``max_norm`` each step clips with ``clip_grad_norm`` before the optimizer;
    ``adam_eps`` is AdamW's epsilon (torch's default; see ``SUMMATION_ORDER_EPS``).
    Returns this process's per-step losses.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=adam_eps)
    losses = []
    for step in range(steps):
        inputs, targets = batches(step)
        loss = criterion(forward(inputs), targets)
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


def reference(cfg: TransformerConfig, world: int, steps: int = STEPS, seed: int = 0, max_norm=None, adam_eps=1e-8):
    """Single-process, unsharded run on the global batch: (losses, {name: full parameter});
    ``max_norm`` clips with torch's own ``clip_grad_norm_``."""
    model = build_model(cfg, seed)
    losses = train(
        model, model, lambda step: global_batch(cfg, step, world), steps=steps, max_norm=max_norm, adam_eps=adam_eps
    )
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


def shard(model, shard_options: dict):
    """``model`` sharded as ``shard_options`` say, in plain values (``with_meshes``); with
    ``tp_size``, first split by tensor parallelism on a ``(dp, tp)`` mesh over every rank (a
    dense model's MLPs by ``transformer_tensor_parallel``, a MoE's attention outputs by
    ``attention_output_tensor_parallel``, its experts then over an EP group of the "dp"
    ranks), then sharded over "dp"; with ``mesh_shape`` too, HSDP over ``(replicate, dp)``."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile import expert_mesh, fully_shard
    from fsdp_compile.testing.tensor_parallel import attention_output_tensor_parallel, transformer_tensor_parallel

    options = dict(shard_options)
    tp = options.pop("tp_size", None)
    if tp is not None:
        data_shape = options.pop("mesh_shape", (dist.get_world_size() // tp,))
        data_names = ("replicate", "dp")[-len(data_shape):]
        mesh = init_device_mesh("cpu", (*data_shape, tp), mesh_dim_names=(*data_names, "tp"))
        data_mesh = mesh[data_names]
        if "ep_size" in options:
            attention_output_tensor_parallel(model, mesh["tp"])
            options["expert_mesh"] = expert_mesh("cpu", options.pop("ep_size"), dp_mesh=data_mesh)
        else:
            transformer_tensor_parallel(model, mesh["tp"])
        options["mesh"] = data_mesh
    return fully_shard(model, **with_meshes(options))


def data_parallel(rank: int, world: int, shard_options: dict) -> tuple[int, int]:
    """This rank's place among the ranks that see batches of their own, and their number:
    under tensor parallelism (``tp_size``) the ranks of one "tp" group share a batch."""
    tp = shard_options.get("tp_size", 1)
    return rank // tp, world // tp


def parity_run(
    rank, world, *, cfg, modes, mesh_shape=None, ep_size=None, max_norm=None, backend_options=None, adam_eps=1e-8,
    **shard_options,
):
    """Train once per mode (``none`` = uncompiled markers, else the mfsdp compiler by name) and
    return each mode's loss and parameter errors against the unsharded reference.

    ``shard_options`` go to ``fully_shard`` (strategy, reshard_after_forward, ...);
    ``mesh_shape`` builds the mesh in the rank (e.g. ``(2, 2)`` for HSDP), ``ep_size`` the
    expert mesh (``fsdp_compile.expert_mesh``); ``max_norm`` clips every step
    (``fsdp_compile.clip_grad_norm_`` here, torch's in the reference); ``backend_options`` go to
    the compiled modes' backend; ``adam_eps`` is AdamW's epsilon, here and in the reference.
    """
    from fsdp_compile import MfsdpBackend, clip_grad_norm_, fully_shard

    ref_losses, ref_params = reference(cfg, world, max_norm=max_norm, adam_eps=adam_eps)
    results = {}
    for mode in modes:
        torch._dynamo.reset()
        meshes = with_meshes({**shard_options, "mesh_shape": mesh_shape, "ep_size": ep_size})
        model = fully_shard(build_model(cfg), **meshes)
        backend = None if mode == "none" else MfsdpBackend(compiler=mode, **(backend_options or {}))
        forward = model if backend is None else torch.compile(model, backend=backend)
        clip = dict(max_norm=max_norm, clip_grad_norm=clip_grad_norm_)
        losses = mean_over_ranks(train(model, forward, rank_batches(cfg, rank), adam_eps=adam_eps, **clip))
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


# ---- gradient accumulation ------------------------------------------------------------------

MICRO_BATCHES = 3
ACCUMULATION_STEPS = 3


def _micro_batch(cfg, step, micro, rank):
    """Micro-batch ``micro`` of optimizer step ``step`` on ``rank``."""
    return make_batch(cfg, LOCAL_BATCH, SEQ, step * MICRO_BATCHES + micro, rank)


def accumulate_run(rank, world, *, cfg, mode, **shard_options):
    """k micro-batches per optimizer step, sync only on the last, against a reference that
    trains on all ranks' micro-batches of a step as one batch. ``mode``: "none" (uncompiled
    markers) or the mfsdp compiler; ``shard_options`` go to ``shard``."""
    from fsdp_compile import MfsdpBackend
    from fsdp_compile.patterns import count_collectives

    rank, world = data_parallel(rank, world, shard_options)
    reference = build_model(cfg)
    # Micro-batches summed locally, then reduced, against one batch: another summation order
    # (see SUMMATION_ORDER_EPS).
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=SUMMATION_ORDER_EPS)
    ref_losses = []
    for step in range(ACCUMULATION_STEPS):
        parts = [_micro_batch(cfg, step, j, r) for j in range(MICRO_BATCHES) for r in range(world)]
        loss = loss_fn(reference(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts]))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.detach())

    torch._dynamo.reset()
    model = shard(build_model(cfg), shard_options)
    backend = MfsdpBackend(compiler=mode) if mode != "none" else None
    forward = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=SUMMATION_ORDER_EPS)
    losses = []
    for step in range(ACCUMULATION_STEPS):
        total = torch.zeros(())
        for micro in range(MICRO_BATCHES):
            model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)
            tokens, targets = _micro_batch(cfg, step, micro, rank)
            loss = loss_fn(forward(tokens), targets) / MICRO_BATCHES
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    params = full_parameters(model)  # an expert-parallel ModuleList holds this rank's experts
    expected = {n: p.detach() for n, p in reference.named_parameters() if n in params}
    return {
        "loss_error": relative_error(mean_over_ranks(torch.stack(losses)), torch.stack(ref_losses)),
        "param_error": max_param_error(params, expected)[0],
        "backward_collectives": [
            dict(count_collectives(g.backward.graph)) for g in (backend.graphs if backend else [])
        ],
        # What the step reduces: a block's flat parameter once (NOTE: flat parameters).
        "trainable": sum(p.requires_grad for p in gathered_params(model)),
        "reducing_buckets": sum(
            any(plan.param(i).requires_grad for i in bucket.param_ids)
            for plan in ([backend.graphs[-1].plan] if backend else [])
            for bucket in plan.buckets
        ),
    }



# ---- DCP checkpoints: save, then resume under another world size or layout ----------------------

VIRTUAL_RANKS = 4  # the global batch of each step is 4 pieces, split evenly over the ranks
SAVE_AFTER, TOTAL = 2, 4


def _checkpoint_batch(cfg, step, rank, world):
    """This rank's share of the VIRTUAL_RANKS pieces of a step's global batch."""
    pieces = [make_batch(cfg, 2, 8, step, r) for r in range(VIRTUAL_RANKS)]
    share = VIRTUAL_RANKS // world
    mine = pieces[rank * share : (rank + 1) * share]
    return torch.cat([p[0] for p in mine]), torch.cat([p[1] for p in mine])


def _checkpoint_steps(model, forward, opt, cfg, steps, rank, world):
    losses = []
    for step in steps:
        tokens, targets = _checkpoint_batch(cfg, step, rank, world)
        loss = loss_fn(forward(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return mean_over_ranks(torch.stack(losses)) if world > 1 else torch.stack(losses)


def checkpoint_setup(cfg, seed, **shard_options):
    """A sharded model (``shard_options`` to ``shard``), its eager-compiled forward and AdamW;
    ``seed`` picks the initial weights."""
    from fsdp_compile import MfsdpBackend

    model = shard(build_model(cfg, seed=seed), shard_options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, torch.compile(model, backend=MfsdpBackend(compiler="eager")), opt


def checkpoint_save_run(rank, world, *, cfg, path, **shard_options):
    """Train, save model and optimizer with DCP after SAVE_AFTER steps, go on to TOTAL; the
    mean losses after the save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, forward, opt = checkpoint_setup(cfg, seed=0, **shard_options)
    rank, world = data_parallel(rank, world, shard_options)
    _checkpoint_steps(model, forward, opt, cfg, range(SAVE_AFTER), rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _checkpoint_steps(model, forward, opt, cfg, range(SAVE_AFTER, TOTAL), rank, world)


def checkpoint_resume_run(rank, world, *, cfg, path, **shard_options):
    """Start from other weights (only the checkpoint can fix them), load, train from
    SAVE_AFTER to TOTAL; the mean losses, to compare with ``checkpoint_save_run``'s."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, forward, opt = checkpoint_setup(cfg, seed=1, **shard_options)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    # torch's get_state_dict gives a fresh optimizer state for every parameter (a step with
    # zero gradients), while the saved one holds none for a parameter that never had a
    # gradient (``idle_params``): that state is left as initialised. Any other missing key
    # shows in the losses, the resumed run starting from other weights.
    dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank, world = data_parallel(rank, world, shard_options)
    return _checkpoint_steps(model, forward, opt, cfg, range(SAVE_AFTER, TOTAL), rank, world)


def assert_parity(results, tolerance: float = TOLERANCE):
    for rank_result in results:
        for mode, r in rank_result.items():
            assert r["loss_error"] < tolerance, (mode, r)
            assert r["param_error"] < tolerance, (mode, r)


def flat_padding_bytes(model) -> int:
    """Bytes of the padding rows in the flat parameters of ``model``'s blocks, all ranks'
    slots together (NOTE: flat parameters, in fsdp_compile/flat_params.py)."""
    from fsdp_compile import gathered_params, shard_info

    # A flat is this rank's buffer; its ShardInfo has the size of every rank's together.
    return sum(
        (math.prod(shard_info(f).global_shape) - sum(m.param.numel() for m in f._mfsdp_members)) * f.element_size()
        for f in gathered_params(model)
        if hasattr(f, "_mfsdp_members")
    )


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


# ---- float8 (torchao) -----------------------------------------------------------------------

FLOAT8_CFG = TransformerConfig(vocab=67, dim=64, n_layers=2, n_heads=4, hidden=128)
"""The test transformer with every linear but the head (67 rows) in multiples of 16."""


class GatedLayer(torch.nn.Module):
    """A ``frozen`` layer reads its gate under ``torch.no_grad()``, so the gate's weight gets
    no gradient there; the flag is a plain attribute, so layers of both kinds are alike in
    structure (NOTE: parameters without a gradient, in fsdp_compile/block_fakes.py)."""

    def __init__(self, dim: int, frozen: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(dim, dim, bias=False)
        self.gate = torch.nn.Linear(dim, dim, bias=False)
        self.frozen = frozen

    def forward(self, h):
        with torch.no_grad() if self.frozen else contextlib.nullcontext():
            gate = self.gate(h).sigmoid()
        return h + self.a(h) * gate


class TanhLayer(torch.nn.Module):
    """A layer of another structure than ``GatedLayer``'s: beside them, a block of its own kind."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = torch.nn.Linear(dim, dim)

    def forward(self, h):
        return h + torch.tanh(self.w(h))


class GatedStack(torch.nn.Module):
    """Three ``GatedLayer``s (the last a ``TanhLayer`` when ``one_of_a_kind``), each called
    through a non-reentrant ``torch.utils.checkpoint`` when ``checkpointed``; with ``fail``
    set, the forward raises after the second (a micro-batch that fails mid-forward); with
    ``last_idle`` set, the last runs under ``torch.no_grad()`` and its output is dropped (its
    weights get no gradient)."""

    def __init__(self, checkpointed: bool = False, one_of_a_kind: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(GatedLayer(16, frozen=False) for _ in range(3))
        if one_of_a_kind:
            self.layers[2] = TanhLayer(16)
        self.checkpointed = checkpointed
        self.fail = False
        self.last_idle = False

    def forward(self, h):
        for at, layer in enumerate(self.layers):
            if self.last_idle and at == len(self.layers) - 1:
                with torch.no_grad():
                    layer(h)
                break
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False) if self.checkpointed else layer(h)
            if self.fail and at == 1:
                raise RuntimeError("a failing micro-batch")
        return h


def tiny_hf_llama(layers: int):
    """An HF Llama of ``layers`` layers (hidden 32, grouped-query attention), training, no cache."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def counting_aot_eager(compiled: list):
    """A compiler for ``torch.compile``: aot_eager, each graph it gets appended to ``compiled``."""
    from torch._dynamo.backends.debugging import aot_eager

    def counting(gm, example_inputs):
        compiled.append(gm)
        return aot_eager(gm, example_inputs)

    return counting


def train_accumulating(net, batches: torch.Tensor, *, sharded: bool, after_micro=None, after_step=None) -> None:
    """AdamW steps on an HF causal LM, ``batches[step][micro]`` token ids, each step's
    micro-batch losses averaged; ``sharded``: gradient sync only for each step's last.
    ``after_micro(micro, count)`` runs after each backward, ``after_step(step)`` after each
    optimizer step."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in batches:
        for micro, tokens in enumerate(step):
            if sharded:
                net.set_requires_gradient_sync(micro == len(step) - 1)
            net(input_ids=tokens, labels=tokens).loss.div(len(step)).backward()
            if after_micro is not None:
                after_micro(micro, len(step))
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step)


def sync_off_then_on(model, reference, micros, *, forward=None) -> dict[str, torch.Tensor]:
    """The micro-batches ``micros`` on the sharded ``model`` (gradient sync on for the last
    alone), called through ``forward`` if given, and on the unsharded ``reference``, each
    loss a sum: the sharded gradients, full."""
    for at, micro in enumerate(micros):
        model.set_requires_gradient_sync(at == len(micros) - 1)
        (forward or model)(micro).sum().backward()
        reference(micro).sum().backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def give_up_after_a_failing_forward(model, forward, first, second) -> None:
    """A micro-batch sequence given up: ``first`` without sync, then ``second`` with sync on,
    its forward through ``forward`` raising (``model.fail``), then ``reset_iter_state()``.
    Every ``.grad`` is None after it, as before the sequence."""
    import pytest

    model.set_requires_gradient_sync(False)
    forward(first).sum().backward()
    model.set_requires_gradient_sync(True)
    model.fail = True
    with pytest.raises(RuntimeError, match="a failing micro-batch"):
        forward(second)
    model.fail = False
    model.reset_iter_state()
    assert [name for name, p in model.named_parameters() if p.grad is not None] == []


def assert_gradients_match(grads: dict[str, torch.Tensor], reference) -> None:
    for name, p in reference.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-6, atol=1e-7), name


def shard_and_compile_each_block(model: torch.nn.Module, *, compile_blocks: bool = True) -> None:
    """FSDP2's habit on ``model.layers``: ``fully_shard`` each layer, then the model, then
    ``layer.compile()`` each (aot_eager) if ``compile_blocks``."""
    from fsdp_compile import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    for layer in model.layers if compile_blocks else ():
        layer.compile(backend="aot_eager")


def float8_model(cfg: TransformerConfig = FLOAT8_CFG, seed: int = 0, filtered: bool = True):
    """``build_model`` with torchao float8 linears gathered in float8
    (``enable_fsdp_float8_all_gather=True``); ``filtered`` leaves out the linears the float8
    matmul cannot take (a dim not a multiple of 16)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def fits(module, fqn):
        return not filtered or all(size % 16 == 0 for size in module.weight.shape)

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(build_model(cfg, seed), config=config, module_filter_fn=fits)


def per_rank_reference(
    model, cfg: TransformerConfig, world: int, steps: int = STEPS, micro_batches: int = 1,
    rank_seeds: list[int] | None = None, batches=None,
):
    """``model`` (unsharded) trained on each rank's batches in turn, summing the gradients of
    loss / (world * micro_batches): what a data-parallel job computes when each rank's
    activations are cast on their own (float8 scales them by their own amax), or when ranks'
    batches differ in shape. Returns (mean losses, {name: parameter, a float8 weight's fp32
    master}), as ``reference``. ``batches(step, rank)``, when given, is each rank's batch
    (one micro-batch).

    With ``rank_seeds``, each rank's batches draw their random numbers (dropout masks) from
    that rank's own stream, seeded ``rank_seeds[rank]`` before the first step and carried
    across steps, as each rank's process draws from its own generator; the process's own
    generator is left as it was."""
    streams = None if rank_seeds is None else [torch.Generator().manual_seed(s).get_state() for s in rank_seeds]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for rank in range(world):
            with torch.random.fork_rng(enabled=streams is not None, devices=[]):
                if streams is not None:
                    torch.set_rng_state(streams[rank])
                for micro in range(micro_batches):
                    if batches is None:
                        tokens, targets = make_batch(cfg, LOCAL_BATCH, SEQ, step * micro_batches + micro, rank)
                    else:
                        tokens, targets = batches(step, rank)
                    loss = loss_fn(model(tokens), targets) / (world * micro_batches)
                    loss.backward()
                    total += loss.detach()
                if streams is not None:
                    streams[rank] = torch.get_rng_state()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    params = {n: getattr(p, "_tensor", p).detach().clone() for n, p in model.named_parameters()}
    return torch.stack(losses), params
