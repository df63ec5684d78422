"""Every user mistake of the foundation gets one clear ValueError before any collective runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import fsdp_compile
from fsdp_compile import MfsdpBackend, UsageError, fully_shard
from fsdp_compile.testing.models import TransformerConfig, loss_fn, make_batch
from harness import build_model, fake_process_group, spawn


@pytest.mark.structure
def test_fully_shard_twice_on_one_module_is_rejected():
    with fake_process_group(2):
        model = fully_shard(nn.Linear(4, 4))
        with pytest.raises(ValueError, match="already called"):
            fully_shard(model)


@pytest.mark.structure
def test_submodules_first_then_root_is_accepted_as_units():
    """FSDP2-style nesting: each call is a unit, tied parameters across units shard once."""
    with fake_process_group(2):
        model = build_model(TransformerConfig())
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model.embed)
        fully_shard(model)
        units = {fsdp_compile.shard_info(p).unit for p in model.parameters()}
        assert len(units) == len(model.layers) + 2  # layers, embedding, root (norm, pos)
        assert model.head._parameters["weight"] is model.embed._parameters["weight"]


@pytest.mark.structure
def test_parameters_on_two_devices_are_rejected():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    with fake_process_group(2):
        with pytest.raises(ValueError, match="several devices"):
            fully_shard(model)


@pytest.mark.structure
def test_no_process_group_and_no_mesh_is_rejected():
    with pytest.raises(ValueError, match="init_process_group"):
        fully_shard(nn.Linear(4, 4))


@pytest.mark.structure
def test_non_floating_parameter_is_rejected():
    model = nn.Linear(4, 4)
    model.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with fake_process_group(2):
        with pytest.raises(ValueError, match="register_buffer"):
            fully_shard(model)


@pytest.mark.structure
def test_unknown_backend_option_is_rejected():
    with pytest.raises(ValueError, match="unknown mfsdp option"):
        MfsdpBackend(bucket_sise=1)
    with fake_process_group(2):
        model = torch.compile(fully_shard(nn.Linear(4, 4)), backend="mfsdp", options={"bogus": 1})
        with pytest.raises(ValueError, match="unknown mfsdp option.*bogus"):
            model(torch.randn(2, 4))


@pytest.mark.structure
def test_compiling_an_unsharded_model_says_to_call_fully_shard():
    """Decision (docs/design.md): an error, not a silent per-rank replica."""
    model = torch.compile(nn.Linear(4, 4), backend="mfsdp", options={"compiler": "eager"})
    with pytest.raises(ValueError, match="fully_shard"):
        model(torch.randn(2, 4))


@pytest.mark.structure
def test_the_mfsdp_backend_behind_a_wrapper_of_yours_says_to_pass_it_itself():
    """A function around the backend hides it from the reads, which then take the compile for
    another backend's and leave each parameter unnamed (NOTE: a block compiled by another
    backend): said with the fix before anything runs, where mfsdp's passes failed inside."""
    backend = MfsdpBackend(compiler="eager")
    with fake_process_group(2):
        model = torch.compile(fully_shard(nn.Linear(4, 4)), backend=lambda gm, inputs: backend(gm, inputs))
        with pytest.raises(ValueError, match='Pass backend="mfsdp" or an MfsdpBackend itself'):
            model(torch.randn(2, 4))


@pytest.mark.structure
def test_compiling_a_model_sharded_by_fsdp2_names_the_swap():
    """A user moving from FSDP2 keeps torch's ``fully_shard`` and switches the backend: the
    error says the two do not compose and which ``fully_shard`` to call."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    with fake_process_group(2):
        cfg = TransformerConfig()
        model = build_model(cfg)
        for layer in model.layers:
            fsdp2_fully_shard(layer)
        fsdp2_fully_shard(model)
        compiled = torch.compile(model, backend="mfsdp", options={"compiler": "eager"})
        tokens, _ = make_batch(cfg, 2, 8, step=0)
        with pytest.raises(ValueError, match=r"torch\.distributed\.fsdp\.fully_shard \(FSDP2\)"):
            compiled(tokens)


@pytest.mark.structure
def test_usage_errors_are_value_errors():
    assert issubclass(UsageError, ValueError)


def _runs_to_the_end(script: str) -> None:
    """``script`` in a fresh interpreter (nothing this process imported or registered) runs
    to its last line."""
    command = [sys.executable, "-c", script + "print('ok')\n"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.structure
def test_backend_registered_through_entry_point_without_import():
    """torch.compile(backend="mfsdp") resolves in a script that never imports fsdp_compile."""
    script = (
        "import sys, torch\n"
        "assert 'fsdp_compile' not in sys.modules\n"
        "f = torch.compile(lambda x: x.sin() + 1, backend='mfsdp', options={'compiler': 'eager'})\n"
        "x = torch.randn(3)\n"
        "torch.testing.assert_close(f(x), x.sin() + 1)\n"
        "assert 'fsdp_compile' in sys.modules\n"
    )
    _runs_to_the_end(script)


@pytest.mark.structure
def test_importing_changes_nothing_in_torch_and_a_cpu_fully_shard_installs_the_gloo_gather():
    """Importing the package registers no kernel over torch's (torch's functional collectives
    imported first register theirs; the package adds only its own ops); the gloo
    gather (compat.gather_cpu_tensors_one_work_each) is installed by the first fully_shard on
    a CPU mesh, the call that needs it."""
    script = (
        "import torch, torch.distributed, torch.distributed._functional_collectives\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "gather = '_c10d_functional::all_gather_into_tensor'\n"
        "before = torch._C._dispatch_dump(gather)\n"
        "import fsdp_compile\n"
        "assert torch._C._dispatch_dump(gather) == before, 'import registered a kernel'\n"
        "torch.distributed.init_process_group('fake', rank=0, world_size=2, store=FakeStore())\n"
        "fsdp_compile.fully_shard(torch.nn.Linear(4, 4))\n"
        "assert torch._C._dispatch_dump(gather) != before, 'fully_shard on a CPU mesh did not install it'\n"
    )
    _runs_to_the_end(script)


@pytest.mark.structure
def test_a_compile_leaves_nothing_installed_in_torch(tmp_path):
    """Compiling with dumps and Inductor installs nothing that outlives the compile: no Dynamo
    bytecode hook (the frames are written at the compiled graph's first call, from the code
    Dynamo rewrote), and the block call's Inductor lowering as it found it, after the step's
    backward, which Inductor compiles at the first backward."""
    from torch._dynamo.convert_frame import _bytecode_hooks
    from torch._inductor import lowering

    from fsdp_compile.block_call import BLOCK_FORWARD

    hooks, lowered = dict(_bytecode_hooks), lowering.lowerings.get(BLOCK_FORWARD)
    cfg = TransformerConfig(n_layers=2)
    backend = MfsdpBackend(compiler="inductor", debug_dir=str(tmp_path))
    tokens, targets = make_batch(cfg, 2, 8, 0, 0)
    with fake_process_group(2):
        step = torch.compile(fully_shard(build_model(cfg)), backend=backend)
        loss_fn(step(tokens), targets).backward()
    assert dict(_bytecode_hooks) == hooks
    assert not [h for h in _bytecode_hooks.values() if getattr(h, "__module__", "").startswith("fsdp_compile")]
    assert lowering.lowerings.get(BLOCK_FORWARD) is lowered
    # The frame dump found the code Dynamo rewrote, which calls the compiled graph.
    (frame,) = (tmp_path / "rank0" / "frames").glob("forward-*.py")
    assert "__compiled_fn" in frame.read_text(), frame.read_text()


class _RankDependentModel(nn.Module):
    """Reads a different parameter on rank 0 than elsewhere: FSDP would hang on this."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        layer = self.a if torch.distributed.get_rank() == 0 else self.b
        return layer(x).sum()


class _RankDependentEvaluation(_RankDependentModel):
    """Reads ``a`` on every rank while training, a different parameter on rank 0 than elsewhere
    under ``torch.no_grad()``: the two weights are alike, so gloo would exchange the wrong
    rows without a word."""

    def forward(self, x):
        layer = self.a if torch.is_grad_enabled() or torch.distributed.get_rank() == 0 else self.b
        return layer(x).sum()


def _compile_rank_dependent(rank, world, evaluation=False):
    torch.manual_seed(0)
    module = _RankDependentEvaluation() if evaluation else _RankDependentModel()
    model = torch.compile(fully_shard(module), backend=MfsdpBackend(compiler="eager"))
    try:
        model(torch.randn(2, 4)).backward()
        if evaluation:  # a recompile every rank makes: the first in its grad mode
            with torch.no_grad():
                model(torch.randn(2, 4))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("evaluation", [False, True], ids=["first-step", "first-evaluation"])
def test_ranks_tracing_different_collectives_all_raise(evaluation):
    """A rank-dependent branch is found at compile time, before any collective, on every rank:
    at the step's first compile, and at the first compile under ``torch.no_grad()`` after
    training steps that agreed (the ranks recompile together there; a recompile for one rank's
    own shapes runs no check, test_recompile.py)."""
    messages = spawn(_compile_rank_dependent, 2, evaluation=evaluation)
    for message in messages:
        assert "ranks traced different collectives" in message, message


def _compile_uneven_batches(rank, world):
    cfg = TransformerConfig()
    model = fully_shard(build_model(cfg))
    tokens, targets = make_batch(cfg, 2 - rank, 8, 0, rank)  # a shorter last batch on rank 1
    loss = loss_fn(torch.compile(model, backend=MfsdpBackend(compiler="eager"))(tokens), targets)
    loss.backward()
    return float(loss)


@pytest.mark.multirank
def test_different_batch_sizes_are_not_a_mismatch():
    """Only collectives are compared: activation shapes may differ between ranks."""
    losses = spawn(_compile_uneven_batches, 2)
    assert all(loss > 0 for loss in losses)


def _compile_expert_parallel_ragged(rank, world, n_layers):
    """Expert parallelism over both ranks, each rank's batch padded to its own length."""
    from dataclasses import replace

    from fsdp_compile import expert_mesh
    from harness import moe_config

    cfg = replace(moe_config(fused=True), n_layers=n_layers)
    model = fully_shard(build_model(cfg), expert_mesh=expert_mesh("cpu", world))
    tokens, targets = make_batch(cfg, 2, 8 + 2 * rank, 0, rank)
    try:
        loss_fn(torch.compile(model, backend=MfsdpBackend(compiler="eager"))(tokens), targets).backward()
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("n_layers", [1, 2], ids=["one-layer", "repeated-blocks"])
def test_expert_parallel_ranks_routing_different_token_counts_all_raise(n_layers):
    """The MoE layer sizes its all-to-all from the local token count: EP ranks whose batches
    differ in shape would send splits the receivers do not expect (gloo aborts, NCCL hangs or
    reads the wrong bytes). The first compile finds it on every rank, before any collective,
    and names the fix: in the step's graph for one layer, in the blocks' body (its first
    compile, at the step's first call) for repeated layers."""
    messages = spawn(_compile_expert_parallel_ragged, 2, n_layers=n_layers)
    for message in messages:
        assert "all-to-all" in message and "one shape" in message, message


@pytest.mark.structure
def test_an_all_to_all_is_refused_only_where_a_rank_is_sent_what_it_does_not_expect():
    """Each rank's (sent to each rank, expected from each rank) elements per all-to-all: ranks
    may send each other different sizes (explicit splits) as long as each receives what it is
    sent; symbolic sizes are not compared."""
    from fsdp_compile.passes.check_rank_agreement import first_mismatched_exchange

    equal = [[((4, 4), (4, 4))], [((4, 4), (4, 4))]]
    ragged_but_matching = [[((2, 3), (2, 5))], [((5, 1), (3, 1))]]
    assert first_mismatched_exchange(equal) == first_mismatched_exchange(ragged_but_matching) == ""
    assert first_mismatched_exchange([[None], [((9, 9), (9, 9))]]) == ""
    padded_apart = [[((4, 4), (4, 4)), ((4, 4), (4, 4))], [((4, 4), (4, 4)), ((5, 5), (5, 5))]]
    said = first_mismatched_exchange(padded_apart)
    assert said == "all-to-all 1: rank 0 sends rank 1 4 elements, rank 1 expects 5", said
