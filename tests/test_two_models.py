"""Two models sharded and compiled in one process do not interact: each trains at parity with
its own unsharded reference, under options of its own, and dumps into its own folder; and a
model gone leaves nothing of its own in the process."""

from __future__ import annotations

import gc
import tempfile
import warnings
import weakref
from pathlib import Path

import pytest
import torch

from fsdp_compile import MfsdpBackend, fully_shard, region_tables
from fsdp_compile.testing.models import TransformerConfig, loss_fn
from harness import (
    build_model,
    full_parameters,
    make_batch,
    max_param_error,
    mean_over_ranks,
    one_rank_group,
    rank_batches,
    reference,
    relative_error,
    spawn,
)


STEPS = 3
CFG = TransformerConfig()
"""Both models have this structure, so their repeated blocks share a body structure: what a
process-wide table would mix up."""
SETUPS = {
    "a": ({"strategy": "optim_grads_params"}, {"prefetch": 1}, 0),
    "b": ({"strategy": "optim_grads", "reshard_after_forward": None}, {"prefetch": 0, "bucketing": False}, 1),
}
"""Per model: ``fully_shard`` options, backend options, the seed its weights are built from."""


def _two_models(rank: int, world: int, *, folder: str) -> dict:
    models, forwards, optimizers, backends = {}, {}, {}, {}
    for name, (shard_options, backend_options, seed) in SETUPS.items():
        models[name] = fully_shard(build_model(CFG, seed=seed), **shard_options)
        backends[name] = MfsdpBackend(compiler="eager", debug_dir=str(Path(folder) / name), **backend_options)
        forwards[name] = torch.compile(models[name], backend=backends[name], dynamic=False)
        optimizers[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-2)
    batches = rank_batches(CFG, rank)
    losses = {name: [] for name in SETUPS}
    for step in range(STEPS):  # the two models' steps interleaved
        for name in SETUPS:
            tokens, targets = batches(step)
            loss = loss_fn(forwards[name](tokens), targets)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            losses[name].append(loss.detach())
    result = {}
    for name, (_, _, seed) in SETUPS.items():
        ref_losses, ref_params = reference(CFG, world, steps=STEPS, seed=seed)
        params = full_parameters(models[name])
        dumped = {str(p) for p in (Path(folder) / name).glob(f"rank{rank}/graph_*")}
        result[name] = {
            "loss_error": relative_error(mean_over_ranks(torch.stack(losses[name])), ref_losses),
            "param_error": max_param_error(params, ref_params)[0],
            "graphs": {str(g.dumper.folder) for g in backends[name].all_graphs()},
            "dumped": dumped,
        }
    return result


@pytest.mark.multirank
def test_two_models_in_one_process_train_at_parity_each_with_its_options_and_dumps():
    with tempfile.TemporaryDirectory() as folder:
        results = spawn(_two_models, 2, folder=folder)
    for rank_result in results:
        for name, r in rank_result.items():
            assert r["loss_error"] < 1e-5 and r["param_error"] < 1e-5, (name, r)
            # Every graph this model's backend compiled, the bodies' included, dumped into
            # its own folder, and that folder holds nothing else.
            assert r["graphs"] and r["graphs"] == r["dumped"], (name, r["graphs"], r["dumped"])
        a, b = rank_result["a"], rank_result["b"]
        assert not (a["graphs"] & b["graphs"]), (a["graphs"], b["graphs"])


@pytest.mark.structure
def test_one_model_accumulating_leaves_the_other_s_step_and_gradients_as_they_were():
    """Gradient accumulation is each parameter's own state: while ``a`` accumulates with sync
    off, ``b``'s compiled step runs without recompiling and gives the gradients of ``b``
    trained alone, bit for bit."""
    tokens, targets = make_batch(CFG, 2, 8, 0, 0)

    def b_gradients(forward, model) -> list[torch.Tensor | None]:
        loss_fn(forward(tokens), targets).backward()
        grads = [None if p.grad is None else p.grad.full_tensor().clone() for p in model.parameters()]
        model.zero_grad()
        return grads

    with one_rank_group():
        alone = fully_shard(build_model(CFG, seed=1))
        expected = b_gradients(torch.compile(alone, backend=MfsdpBackend(compiler="eager")), alone)
        a = fully_shard(build_model(CFG, seed=0))
        b = fully_shard(build_model(CFG, seed=1))
        a_forward = torch.compile(a, backend=MfsdpBackend(compiler="eager"))
        b_backend = MfsdpBackend(compiler="eager")
        b_forward = torch.compile(b, backend=b_backend)
        b_gradients(b_forward, b)
        compiled = len(b_backend.all_graphs())
        a.set_requires_gradient_sync(False)
        loss_fn(a_forward(tokens), targets).backward()
        got = b_gradients(b_forward, b)
        assert len(b_backend.all_graphs()) == compiled
        assert any(e is not None for e in expected)
        assert all(g is e or torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.structure
@pytest.mark.parametrize("compiled", [False, True])
def test_a_model_once_gone_leaves_nothing_the_process_holds(compiled: bool):
    """What the process keeps of a sharded model only names what the model owns (its blocks,
    the recipes they gather with): after two steps and ``del``, the model and its backend are
    collected, and no table names its blocks or their recipes. Eagerly, that is all of it; a
    compiled step's graphs stay in the process as long as Dynamo keeps its compiled code
    (in the globals of the model's module, even after ``torch._dynamo.reset()``), and the
    recipes its block calls were traced with with them."""
    # A structure no other test's block shares, nor the other case's: a compiled step's recipes
    # stay with Dynamo's code, and an equal recipe is shared.
    cfg = TransformerConfig(dim=36, hidden=74 if compiled else 70)
    tokens, targets = make_batch(cfg, 2, 8, 0, 0)

    def train_and_drop() -> tuple[weakref.ref, weakref.ref, list[int], list[str]]:
        model = fully_shard(build_model(cfg))
        backend = MfsdpBackend(compiler="eager")
        step = torch.compile(model, backend=backend) if compiled else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            loss_fn(step(tokens), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        blocks = [block._mfsdp_region_key for block in model.layers]
        recipes = [block._mfsdp_recipe.key for block in model.layers]
        return weakref.ref(model), weakref.ref(backend), blocks, recipes

    with one_rank_group():
        model, backend, blocks, recipes = train_and_drop()
        torch._dynamo.reset()
        gc.collect()
        assert model() is None and backend() is None
        assert not set(blocks) & set(region_tables.BLOCKS), blocks
        if not compiled:
            assert not set(recipes) & set(region_tables.RECIPES), recipes


@pytest.mark.structure
def test_the_compile_that_reaches_dynamo_s_recompile_limit_says_so_with_the_fix():
    """Each model's step is a compile of its own of the same forward, and Dynamo runs a frame
    uncompiled past its recompile limit: the compile that reaches it warns, once, naming the
    frame and the fixes; the model compiled then still trains compiled."""
    tokens, targets = make_batch(CFG, 2, 8, 0, 0)
    with one_rank_group(), torch._dynamo.config.patch(recompile_limit=2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backends = []
            for seed in range(2):
                backends.append(MfsdpBackend(compiler="eager"))
                model = fully_shard(build_model(CFG, seed=seed))
                loss_fn(torch.compile(model, backend=backends[-1])(tokens), targets).backward()
    said = [str(w.message) for w in caught if "recompile_limit" in str(w.message)]
    assert len(said) == 1 and "forward" in said[0] and "torch.compiler.reset()" in said[0], said
    assert "compiled it 1 time. The other 1 was other torch.compile calls'" in said[0], said
    assert all(len(b.graphs) == 1 for b in backends)


@pytest.mark.structure
def test_an_optimizer_step_at_the_recompile_limit_is_said_as_one_that_gathers_nothing():
    """A train step compiled whole, its LR scheduler stepped outside: each new float learning
    rate is a guard of the optimizer's frame, which reaches the recompile limit. Its warning
    said the frame would gather each parameter at each read and could hang the ranks (a
    helper: neither holds for a frame that gathers nothing); it now says it runs as eagerly
    and names the tensor learning rate (one gloo rank)."""
    tokens, targets = make_batch(CFG, 2, 8, 0, 0)
    with one_rank_group(), torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fully_shard(build_model(CFG))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))

        @torch.compile(backend=MfsdpBackend(compiler="eager"))
        def optimizer_step():
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(3):
            loss_fn(model(tokens), targets).backward()
            optimizer_step()
            scheduler.step()
    said = [str(w.message) for w in caught if "recompile_limit" in str(w.message)]
    assert said and all("gathers no parameter" in s and "lr=torch.tensor" in s for s in said), said
    assert not [s for s in said if "gathering each parameter" in s or "hangs" in s], said
