"""Tensor parallel inside, mfsdp across: the FSDP2 idiom (``parallelize_module`` on a "tp"
mesh dimension, then ``fully_shard`` on "dp") trains at parity with the unsharded model, its
parameters sharded over both dimensions, gathered over "dp" only, the tensor-parallel
collectives kept in the compiled graphs."""

from __future__ import annotations

import contextlib
import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

import fsdp_compile
from fsdp_compile import MfsdpBackend, MixedPrecision, UsageError, fully_shard, shard_info
from fsdp_compile.markers import GATHERING_STRATEGIES, STRATEGIES
from fsdp_compile.node_meta import BUCKET, MEMBERS
from fsdp_compile.patterns import ALL_GATHER, ALL_GATHER_OUT, ALL_REDUCE, REDUCE_SCATTER, is_block_call
from fsdp_compile.testing.models import TransformerConfig, loss_fn
from fsdp_compile.testing.tensor_parallel import (
    attention_output_tensor_parallel,
    hf_llama_sequence_parallel,
    transformer_tensor_parallel,
)
from harness import (
    FLOAT8_CFG,
    build_model,
    fake_process_group,
    float8_model,
    make_batch,
    max_param_error,
    moe_config,
    one_rank_group,
    relative_error,
    spawn,
)

DIM, HIDDEN, VOCAB, LAYERS, STEPS = 16, 32, 64, 2, 3
DP, TP = 2, 2
MAX_NORM = 0.1
"""Below the model's gradient norms (about 1), so clipping scales every step."""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Model(nn.Module):
    """A residual MLP stack whose blocks tensor parallelism splits as Megatron does: ``up``
    by columns, ``down`` by rows (one all-reduce of the block's output over "tp")."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _batch(step: int, dp_rank: int) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s 2 x 8 tokens of the step's global batch; the ranks of
    one tensor-parallel group read the same."""
    tokens = torch.randint(0, VOCAB, (2 * DP, 8), generator=torch.Generator().manual_seed(100 + step))
    return tokens[2 * dp_rank : 2 * dp_rank + 2]


def _loss(forward, tokens: torch.Tensor) -> torch.Tensor:
    logits = forward(tokens)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _reference(max_norm: float | None = None, build=None, loss_of=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsharded model (``build()``, else the residual stack) trained on the global
    batches: its losses and final parameters."""
    torch.manual_seed(0)
    model = build() if build is not None else _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = (loss_of or _loss)(model, torch.cat([_batch(step, r) for r in range(DP)]))
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.detach() for n, p in model.named_parameters()}


class _CheckpointedModel(_Model):
    """The residual stack with each block under ``torch.utils.checkpoint``."""

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(x)


class _SequenceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))

    def forward(self, x):
        return x + self.mlp(x)


class _SequenceModel(_Model):
    """The residual stack with each MLP in a submodule, for Megatron's sequence parallelism as
    torchtitan splits its blocks: the residual stream is this rank's part of the sequence as
    a plain tensor, the MLP gathers it (``PrepareModuleInput``) and reduce-scatters its output
    back onto it (row-parallel with a ``Shard(1)`` DTensor output, which the MLP's
    ``PrepareModuleOutput`` hands back as this rank's plain tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_SequenceBlock() for _ in range(LAYERS))


def _sequence_parallel(model: _SequenceModel, tp_mesh) -> None:
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })  # fmt: skip
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })  # fmt: skip
        parallelize_module(layer.mlp, tp_mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1)))


def _parallelized(mesh, data_parallel: str | tuple[str, ...] = "dp", kind: str = "plain", **shard_options) -> _Model:
    """The residual stack split by tensor parallelism, then sharded over ``data_parallel``.
    ``kind``: "plain"; "checkpointed" (each block under activation checkpointing); "meta"
    (built on the meta device, split and sharded there, then materialised and loaded from
    the reference's full state dict); "bf16" (bf16 compute, fp32 reduction);
    "sequence_parallel" (``_SequenceModel`` split by ``_sequence_parallel``)."""
    torch.manual_seed(0)
    with torch.device("meta") if kind == "meta" else contextlib.nullcontext():
        model = {"checkpointed": _CheckpointedModel, "sequence_parallel": _SequenceModel}.get(kind, _Model)()
    if kind == "sequence_parallel":
        _sequence_parallel(model, mesh["tp"])
    for layer in model.layers if kind != "sequence_parallel" else ():
        parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if kind == "bf16":
        shard_options["mp_policy"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fully_shard(model, mesh=mesh[data_parallel], **shard_options)
    if kind == "meta":
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        set_model_state_dict(model, _Model().state_dict(), options=StateDictOptions(full_state_dict=True))
    return model


def _train(rank: int, world: int, *, runs: list[tuple[str, str, str, float | None, int]]) -> dict:
    """Each run: the model's kind (``_parallelized``), strategy, compiler ("none":
    uncompiled), the clipping norm (None: no clipping), and micro-batches per step (the last
    one reducing the sum of all: gradient accumulation)."""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_group = mesh["dp"].get_group()
    results = {}
    for kind, strategy, compiler, max_norm, micro in runs:
        torch._dynamo.reset()
        model = _parallelized(mesh, kind=kind, strategy=strategy)
        forward = model if compiler == "none" else torch.compile(model, backend=MfsdpBackend(compiler=compiler))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            tokens = _batch(step, mesh["dp"].get_local_rank())
            loss = 0
            for at, part in enumerate(tokens.chunk(micro)):
                model.set_requires_gradient_sync(at == micro - 1)
                part_loss = _loss(forward, part) / micro
                part_loss.backward()
                loss = loss + part_loss.detach()
            if max_norm is not None:  # one norm over the 2-D and the 1-D ("dp") gradients
                fsdp_compile.clip_grad_norm_(model.parameters(), max_norm)
            placements_kept = all(p.grad.placements == p.placements for p in model.parameters())
            opt.step()
            opt.zero_grad()
            mean = loss.detach().to(torch.float32, copy=True)
            dist.all_reduce(mean, group=dp_group)
            losses.append(mean / DP)
        results[kind, strategy, compiler, max_norm, micro] = {
            "losses": torch.stack(losses),
            "params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
            "grad_placements_kept": placements_kept,
        }
    return results


@pytest.mark.multirank
def test_tensor_parallel_inside_mfsdp_across_trains_at_parity():
    """dp 2 x tp 2 on 4 gloo ranks: every strategy uncompiled and compiled (eager runner),
    ZeRO-3 with Inductor too, with ``fsdp_compile.clip_grad_norm_`` clipping every step, with
    two micro-batches a step (gradient accumulation, ZeRO-3 and ZeRO-1), with every block
    under activation checkpointing, built on the meta device then loaded, and under
    sequence parallelism with plain tensors between the blocks (``PrepareModuleInput`` and
    ``PrepareModuleOutput`` running in the blocks' body), against the
    unsharded model on the global batch; each gradient lands with its parameter's
    two-dimensional placements. bf16 compute with fp32 reduction: compiled equals
    uncompiled bit for bit, and tracks the fp32 reference (the bound of
    ``test_mixed_precision.py``'s bf16 run)."""
    zero3 = "optim_grads_params"
    runs = [("plain", s, c, None, 1) for s in STRATEGIES for c in ("none", "eager")]
    runs += [("plain", zero3, "inductor", None, 1), ("plain", zero3, "eager", MAX_NORM, 1)]
    runs += [("plain", s, "eager", None, 2) for s in (zero3, "optim")]
    runs += [("checkpointed", zero3, "eager", None, 1), ("meta", zero3, "eager", None, 1)]
    runs += [("bf16", zero3, c, None, 1) for c in ("none", "eager")]
    runs += [("sequence_parallel", zero3, "eager", None, 1)]
    references = {(False, max_norm): _reference(max_norm) for max_norm in (None, MAX_NORM)}
    references[True, None] = _reference(build=_SequenceModel)
    for rank_results in spawn(_train, DP * TP, runs=runs):
        for run, r in rank_results.items():
            ref_losses, ref_params = references[run[0] == "sequence_parallel", run[3]]
            loss_error = relative_error(r["losses"], ref_losses)
            param_error = max(relative_error(r["params"][n], ref_params[n]) for n in ref_params)
            bound = (2e-2, 1e-1) if run[0] == "bf16" else (1e-5, 1e-5)
            assert loss_error < bound[0] and param_error < bound[1], (run, loss_error, param_error)
            assert r["grad_placements_kept"], run
        compiled, uncompiled = rank_results["bf16", zero3, "eager", None, 1], rank_results["bf16", zero3, "none", None, 1]
        assert torch.equal(compiled["losses"], uncompiled["losses"])
        assert all(torch.equal(p, uncompiled["params"][n]) for n, p in compiled["params"].items())


def _groups(graph, *targets) -> list[str]:
    """The group each collective of ``targets`` in ``graph`` runs over, in graph order."""
    return [n.args[-1] for n in graph.graph.nodes if n.target in targets]


@pytest.mark.structure
def test_parameters_are_gathered_over_dp_and_the_tensor_parallel_collectives_stay():
    """Traced on the fake process group: each tensor-parallel parameter is sharded over both
    dimensions and gathered over "dp" only, in the step's graph, the gradients are reduced
    over "dp" only, and the repeated blocks share one compiled body, which holds the
    row-parallel all-reduce over "tp" (its forward) and the column-parallel input's
    gradient all-reduce (its backward)."""
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"].get_group().group_name, mesh["tp"].get_group().group_name
        model = _parallelized(mesh)
        backend = MfsdpBackend(compiler="eager")
        _loss(torch.compile(model, backend=backend), _batch(0, 0)).backward()
    up = model.layers[0].up._parameters["weight"]  # the stored shard, not a gathering read
    assert isinstance(up, DTensor) and up.device_mesh.ndim == 2 and up.to_local().shape == (HIDDEN // TP // DP, DIM)
    assert shard_info(up).group_name == dp and shard_info(up).tensor_parallel is not None
    (graph,) = backend.graphs
    gathers = _groups(graph.forward, ALL_GATHER, ALL_GATHER_OUT) + _groups(graph.backward, ALL_GATHER, ALL_GATHER_OUT)
    assert gathers and set(gathers) == {dp}, gathers
    assert set(_groups(graph.backward, REDUCE_SCATTER)) == {dp}, _groups(graph.backward, REDUCE_SCATTER)
    assert not _groups(graph.forward, ALL_REDUCE) and not _groups(graph.backward, ALL_REDUCE)
    calls = [n for n in graph.forward.graph.nodes if is_block_call(n)]
    assert len(calls) == LAYERS, graph.forward.graph
    ((body,),) = backend.bodies.values()  # one body, compiled once, for both layers
    assert _groups(body.forward, ALL_REDUCE) == [tp] and _groups(body.backward, ALL_REDUCE) == [tp]
    assert not _groups(body.forward, ALL_GATHER, ALL_GATHER_OUT) and not _groups(body.backward, REDUCE_SCATTER)


def _saved_and_loaded(rank: int, world: int, *, path: str) -> tuple[bool, bool]:
    import copy

    model = _parallelized(init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp")))
    state = model.state_dict()
    torch.save(state, f"{path}/rank{rank}.pt")
    loaded, copied = torch.load(f"{path}/rank{rank}.pt"), copy.deepcopy(state)
    past_the_start = any(param.to_local().storage_offset() for param in model.parameters())
    return past_the_start, all(
        torch.equal(loaded[name].to_local(), value.to_local()) and torch.equal(copied[name].to_local(), value.to_local())
        for name, value in state.items()
    )


@pytest.mark.multirank
def test_a_tensor_parallel_state_dict_pickles_on_every_rank(tmp_path):
    """``torch.save(model.state_dict())`` and ``copy.deepcopy`` of it on each rank of dp 2 x
    tp 2, where the second data-parallel rank's rows start past their storage's start: each
    entry gives back its rows (NOTE: entries that pickle, in state_dicts.py). Before, those
    entries raised "Attempted to access the data pointer on an invalid python storage"."""
    results = spawn(_saved_and_loaded, DP * TP, path=str(tmp_path))
    assert any(past_the_start for past_the_start, _ in results), results
    assert all(equal for _, equal in results), results


@pytest.mark.structure
def test_weights_a_block_reads_without_a_gradient_get_no_reduction_and_no_grad():
    """The test transformer split by ``transformer_tensor_parallel``: each block's weights are
    gathered on their own (no flat parameter under tensor parallelism), two of them read only
    under ``torch.no_grad()`` and one never. Those get no gradient: no collective reduces
    zeros for them, and their ``.grad`` stays None, as in the unsharded model. Before, the
    marker's backward was handed zeros: each parameter got a zero gradient (which AdamW
    decays), and the partitioner moved the zeros' reduce-scatter into the forward on some
    ranks and left it in the backward's bucket on others: mismatched collectives, a hang."""
    cfg = TransformerConfig(idle_params=True, hidden=92)
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        model = build_model(cfg)
        transformer_tensor_parallel(model, mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
        backend = MfsdpBackend(compiler="eager")
        tokens, targets = make_batch(cfg, 2, 8, 0, 0)
        loss_fn(torch.compile(model, backend=backend)(tokens), targets).backward()
    (graph,) = backend.graphs
    assert not any(n.target == REDUCE_SCATTER for n in graph.forward.graph.nodes)
    idle = {n for n, _ in model.named_parameters() if n.split(".")[2:3] in (["gate"], ["unread"])}
    assert len(idle) == 3 * cfg.n_layers
    assert {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None} == idle


@pytest.mark.structure
def test_prepare_module_input_runs_in_the_one_body_of_sequence_parallel_blocks():
    """torchtitan's sequence parallelism hands each block a plain tensor, and its MLP's
    ``PrepareModuleInput`` turns it into a DTensor: that hook is tensor parallelism's, so the
    body runs it (it is not recorded for the step), and the layers share one body holding the
    gather of the sequence and the reduce-scatter back."""
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"].get_group().group_name
        model = _parallelized(mesh, kind="sequence_parallel")
        backend = MfsdpBackend(compiler="eager")
        _loss(torch.compile(model, backend=backend), _batch(0, 0)).backward()
    ((body,),) = backend.bodies.values()
    assert _groups(body.forward, ALL_GATHER, ALL_GATHER_OUT) == [tp] and _groups(body.forward, REDUCE_SCATTER) == [tp]


@pytest.mark.structure
def test_layers_split_otherwise_get_bodies_of_their_own():
    """The same weights' placements and hook counts, other hooks: layer 1's ``up`` hands
    ``down`` a DTensor, which ``down`` takes as it is. What the styles' hooks close over is
    part of a block's structure (NOTE: tensor-parallel blocks), so the layers are told apart
    before Dynamo's guards, as for every hook (NOTE: structure before guards): a body each,
    compiled once each."""
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = _Model()
        parallelize_module(model.layers[0], mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel(input_layouts=Shard(-1))}
        parallelize_module(model.layers[1], mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
        backend = MfsdpBackend(compiler="eager")
        _loss(torch.compile(model, backend=backend), _batch(0, 0)).backward()
    assert len(backend.bodies) == 2 and all(len(graphs) == 1 for graphs in backend.bodies.values())


class _MlpOnly(_Block):
    """``_Block`` without its residual."""

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _ReturnsDTensor(_Model):
    """Its layers return what a row-parallel ``down`` with ``use_local_output=False`` gives:
    a DTensor, which the model reads back as a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MlpOnly() for _ in range(LAYERS))

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x).to_local()
        return self.head(x)


@pytest.mark.structure
def test_a_block_returning_a_dtensor_is_one_body_returning_it():
    """A layer whose row-parallel ``down`` keeps its output a DTensor
    (``use_local_output=False``) is one body for all layers, compiled once: the block call
    hands the model the DTensor the block returned (NOTE: DTensors at a block call)."""
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        model = _ReturnsDTensor()
        for layer in model.layers:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel(use_local_output=False)}
            parallelize_module(layer, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
        backend = MfsdpBackend(compiler="eager")
        _loss(torch.compile(model, backend=backend), _batch(0, 0)).backward()
    (graph,) = backend.graphs
    assert sum(is_block_call(n) for n in graph.forward.graph.nodes) == LAYERS
    assert [len(graphs) for graphs in backend.bodies.values()] == [1]


class _ReadsPartialSum(nn.Module):
    """Given a DTensor of partial sums, it reads the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.lin(x.full_tensor())


class _PartialSums(nn.Module):
    def __init__(self, tp_mesh) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ReadsPartialSum() for _ in range(LAYERS))
        self.tp_mesh = tp_mesh

    def forward(self, x):
        for at, layer in enumerate(self.layers):
            x = layer(DTensor.from_local(x, self.tp_mesh, [Partial()], run_check=False) if at else x)
        return x


@pytest.mark.structure
def test_a_block_given_partial_sums_hands_back_the_gradient_eager_does():
    """A body's ``DTensor.from_local`` gives a ``Partial`` input's gradient replicated (as
    eager's does): the block call hands it back so, not as partial sums, which the graph would
    then sum over "tp" once more (tp times the gradient)."""
    with fake_process_group(TP):
        mesh = init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp", "tp"))
        placements = {}
        for compiled in (False, True):
            torch.manual_seed(0)
            model = _PartialSums(mesh["tp"])
            fully_shard(model, mesh=mesh["dp"])
            x = DTensor.from_local(torch.randn(3, DIM, requires_grad=True), mesh["tp"], [Partial()], run_check=False)
            x.register_hook(lambda g, compiled=compiled: placements.__setitem__(compiled, tuple(g.placements)))
            backend = MfsdpBackend(compiler="eager")
            (torch.compile(model, backend=backend) if compiled else model)(x).sum().backward()
    assert placements == {False: (Replicate(),), True: (Replicate(),)}, placements
    (graph,) = backend.graphs
    assert sum(is_block_call(n) for n in graph.forward.graph.nodes) == LAYERS
    assert not _groups(graph.backward, ALL_REDUCE)


@pytest.mark.structure
def test_sequence_parallel_layers_given_a_dtensor_are_one_body_at_the_unsharded_model_s_numbers():
    """Sequence parallelism on HF Llama keeps the residual stream a DTensor between layers:
    each layer is one call of one body, compiled once, which takes the DTensor's local tensor
    and reads it as the DTensor again (NOTE: DTensors at a block call). One gloo rank (dp 1 x
    tp 1, so the numbers are real), the eager runner: the loss and every gradient equal the
    unsharded model's bit for bit."""
    pytest.importorskip("transformers")
    with one_rank_group():
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        reference = _hf_llama()
        model = copy.deepcopy(reference)
        hf_llama_sequence_parallel(model, mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
        backend = MfsdpBackend(compiler="eager")
        loss = _hf_loss(torch.compile(model, backend=backend), _batch(0, 0))
        loss.backward()
        expected = _hf_loss(reference, _batch(0, 0))
        expected.backward()
    (graph,) = backend.graphs
    assert sum(is_block_call(n) for n in graph.forward.graph.nodes) == LAYERS
    assert [len(graphs) for graphs in backend.bodies.values()] == [1]
    assert torch.equal(loss.detach(), expected.detach())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    assert grads.keys() == {n for n, _ in reference.named_parameters()}
    for name, param in reference.named_parameters():
        assert torch.equal(grads[name], param.grad), name


@pytest.mark.structure
@pytest.mark.parametrize("mistake", ["no_mesh", "two_dimensional", "another_mesh"])
def test_tensor_parallel_misuse_is_refused_before_any_collective(mistake):
    """The data-parallel mesh must be given, and be dimensions of the mesh whose other
    dimension tensor parallelism used; tensor parallelism takes one dimension."""
    with fake_process_group(8):
        mesh = init_device_mesh("cpu", (2, DP, TP), mesh_dim_names=("replicate", "dp", "tp"))
        model = _Model()
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if mistake == "two_dimensional":  # a parameter placed on two dimensions by hand
            weight = model.head.weight.detach()
            model.head.weight = nn.Parameter(distribute_tensor(weight, mesh["dp", "tp"], [Shard(0), Shard(1)]))
        options = {
            "no_mesh": {},
            "two_dimensional": {"mesh": mesh["replicate"]},
            "another_mesh": {"mesh": init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))},
        }[mistake]
        expected = {
            "no_mesh": "mesh=mesh\\['dp'\\]",
            "two_dimensional": "head.weight.* 2-D mesh .* over one mesh dimension",
            "another_mesh": "must be distinct dimensions of one mesh",
        }
        with pytest.raises(UsageError, match=expected[mistake]):
            fully_shard(model, **options)


@pytest.mark.structure
def test_an_expert_mesh_crossing_the_tensor_parallel_groups_is_refused_before_any_collective():
    """Expert and tensor parallelism in one model: the expert mesh must hold exactly the
    data-parallel ranks, so no EP group crosses a tensor-parallel one. One over the whole
    world (``expert_mesh(device, ep)``, as without tensor parallelism) is refused with the fix
    (docs/misuse.md, row 47); the one the fix builds shards."""
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        model = build_model(moe_config(fused=False))
        attention_output_tensor_parallel(model, mesh["tp"])
        with pytest.raises(UsageError, match=r"spans ranks \[0, 1, 2, 3\] but the data-parallel mesh \[0, 2\].*dp_mesh=mesh\['dp'\]"):
            fully_shard(model, mesh=mesh["dp"], expert_mesh=fsdp_compile.expert_mesh("cpu", 2))
        experts = fsdp_compile.expert_mesh("cpu", 2, dp_mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"], expert_mesh=experts)
        assert sorted(experts.mesh.flatten().tolist()) == mesh["dp"].mesh.tolist() == [0, 2]
    assert shard_info(model.layers[0].attn.wo._parameters["weight"]).tensor_parallel is not None
    assert model.layers[0].mlp.experts.expert_parallel_group.size == 2


@pytest.mark.multirank
def test_modulelist_experts_beside_tensor_parallel_attention_train_at_parity():
    """dp 2 x tp 2 on 4 gloo ranks: each attention's ``wo`` split over "tp", ModuleList
    experts over an EP group of the data-parallel ranks (``expert_mesh(...,
    dp_mesh=mesh["dp"])``), the rest sharded over "dp", compiled and clipped by
    ``fsdp_compile.clip_grad_norm_`` (the norm over the dp, tp and EP groups at once): at
    parity with the unsharded model on the global batch, the ranks together holding every
    expert. (Stacked experts on this layout, every API: the matrix's ``ep-tp``.)"""
    results = spawn(_modulelist_experts_beside_tensor_parallel, DP * TP)
    for result in results:
        assert result["loss_error"] < 1e-5 and result["param_error"][0] < 1e-5, result
    reference_names = {n for n, _ in build_model(moe_config(fused=False)).named_parameters()}
    assert set().union(*(r["held"] for r in results)) == reference_names


def _modulelist_experts_beside_tensor_parallel(rank: int, world: int) -> dict:
    from harness import full_parameters, global_batch, mean_over_ranks, rank_batches, train

    cfg = moe_config(fused=False)
    reference = build_model(cfg)
    ref_losses = train(reference, reference, lambda step: global_batch(cfg, step, DP), steps=STEPS, max_norm=MAX_NORM)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build_model(cfg)
    attention_output_tensor_parallel(model, mesh["tp"])
    fully_shard(model, mesh=mesh["dp"], expert_mesh=fsdp_compile.expert_mesh("cpu", 2, dp_mesh=mesh["dp"]))
    losses = train(
        model, torch.compile(model, backend="mfsdp"), rank_batches(cfg, mesh["dp"].get_local_rank()), steps=STEPS,
        max_norm=MAX_NORM, clip_grad_norm=fsdp_compile.clip_grad_norm_,
    )
    params = full_parameters(model)
    return {
        "loss_error": relative_error(mean_over_ranks(losses), ref_losses),
        "param_error": max_param_error(params, {n: p.detach() for n, p in reference.named_parameters() if n in params}),
        "held": set(params),
    }


@pytest.mark.structure
def test_fully_shard_before_parallelize_module_is_refused_by_torch_before_any_collective():
    """The FSDP2 order is tensor parallelism first. The other order stops in
    ``parallelize_module`` itself, on every rank and before any collective: torch will not
    move a DTensor (the data-parallel shard) onto another mesh (docs/misuse.md, row 46)."""
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        model = fully_shard(_Model(), mesh=mesh["dp"])
        with pytest.raises(ValueError, match="Cannot distribute a DTensor with device mesh"):
            parallelize_module(model.layers[0], mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _hf_llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).train()


def _hf_layer_plan(config) -> dict:
    """The per-layer part of transformers' own tensor-parallel plan for the model
    (``base_model_tp_plan``: "colwise" / "rowwise" per projection), as torch's styles."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {
        name.removeprefix("layers.*."): styles[style]()
        for name, style in config.base_model_tp_plan.items()
        if name.startswith("layers.*.")
    }


def _hf_loss(forward, tokens: torch.Tensor) -> torch.Tensor:
    return _loss(lambda t: forward(t).logits, tokens)


def _hf_train(rank: int, world: int, *, runs: tuple[tuple[str, str], ...]) -> dict:
    """Each run: the split ("hf_plan": transformers' own plan for the layers;
    "sequence_parallel": ``hf_llama_sequence_parallel``) and the compiler ("none": uncompiled)."""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    results = {}
    for split, compiler in runs:
        torch._dynamo.reset()
        model = _hf_llama()
        if split == "sequence_parallel":
            hf_llama_sequence_parallel(model, mesh["tp"])
        else:
            for layer in model.model.layers:
                parallelize_module(layer, mesh["tp"], _hf_layer_plan(model.config))
        fully_shard(model, mesh=mesh["dp"])
        forward = model if compiler == "none" else torch.compile(model, backend=MfsdpBackend(compiler=compiler))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            loss = _hf_loss(forward, _batch(step, mesh["dp"].get_local_rank()))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=mesh["dp"].get_group())
            losses.append(mean / DP)
        results[split, compiler] = torch.stack(losses), {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return results


@pytest.mark.multirank
def test_hf_llama_with_its_own_tensor_parallel_plan_trains_at_parity():
    """HF Llama (grouped-query attention, 2 key-value heads over tp 2) split by
    transformers' own plan for it, uncompiled and compiled, and with sequence parallelism on
    its norms and residual stream (``SequenceParallel``, ``PrepareModuleInput``), compiled,
    dp 2 x tp 2, against the unsharded model. Parameters within 5e-5: the row-parallel
    projections sum their halves over "tp" in another order than one matmul, which AdamW's
    division by sqrt(v) magnifies (seen: 1.3e-5); a wrong split or reduction is off by far
    more."""
    ref_losses, ref_params = _reference(build=_hf_llama, loss_of=_hf_loss)
    runs = (("hf_plan", "none"), ("hf_plan", "eager"), ("sequence_parallel", "eager"))
    for rank_results in spawn(_hf_train, DP * TP, runs=runs):
        assert set(rank_results) == set(runs)
        for run, (losses, params) in rank_results.items():
            loss_error = relative_error(losses, ref_losses)
            param_error = max(relative_error(params[n], ref_params[n]) for n in ref_params)
            assert loss_error < 1e-5 and param_error < 5e-5, (run, loss_error, param_error)


def _steps(forward, opt, tp: int, steps: range) -> torch.Tensor:
    """Train ``steps`` on the global batches, each data-parallel rank on its equal part (the
    ranks of one tensor-parallel group, ``tp`` consecutive ranks, on the same); the losses
    averaged over the data-parallel ranks."""
    world, losses = dist.get_world_size(), []
    rows = 2 * DP // (world // tp)
    for step in steps:
        tokens = torch.cat([_batch(step, r) for r in range(DP)])[dist.get_rank() // tp * rows :][:rows]
        loss = _loss(forward, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank of a tensor-parallel group holds the same loss
        losses.append(mean / world)
    return torch.stack(losses)


def _checkpoint_layouts(rank: int, world: int, *, path: str) -> dict:
    """Train two steps on dp 2 x tp 2 and save (model and optimizer, DCP); load into dp 4 x tp 1
    and dp 1 x tp 4 and take the third step there, as on the saving layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    results = {}
    for dp, tp in ((2, 2), (4, 1), (1, 4)):
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = _parallelized(mesh)
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if (dp, tp) == (2, 2):
            _steps(forward, opt, tp, range(2))
            model_state, optim_state = get_state_dict(model, opt)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        else:
            model_state, optim_state = get_state_dict(model, opt)  # the layout to load into
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        losses = _steps(forward, opt, tp, range(2, 3))
        results[dp, tp] = losses, {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return results


@pytest.mark.multirank
def test_a_checkpoint_saved_on_dp2_tp2_resumes_on_dp4_tp1_and_dp1_tp4(tmp_path):
    """DCP of the model and AdamW's state saved on dp 2 x tp 2 after two steps, loaded on
    dp 4 x tp 1 and dp 1 x tp 4: the third step's loss and parameters as on the saving
    layout."""
    (results, *_) = spawn(_checkpoint_layouts, 4, path=str(tmp_path / "checkpoint"))
    saved_losses, saved_params = results[2, 2]
    for layout in ((4, 1), (1, 4)):
        losses, params = results[layout]
        param_error = max(relative_error(params[n], saved_params[n]) for n in saved_params)
        assert relative_error(losses, saved_losses) < 1e-5 and param_error < 1e-5, (layout, losses, saved_losses, param_error)


def _hsdp_train(rank: int, world: int, *, strategies: tuple[str, ...]) -> dict:
    mesh = init_device_mesh("cpu", (2, DP, TP), mesh_dim_names=("replicate", "dp", "tp"))
    results = {}
    for strategy in strategies:
        torch._dynamo.reset()
        model = _parallelized(mesh, strategy=strategy, data_parallel=("replicate", "dp"))
        forward = torch.compile(model, backend=MfsdpBackend(compiler="eager"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _steps(forward, opt, TP, range(STEPS))
        results[strategy] = losses, {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return results


@pytest.mark.multirank
def test_hsdp_with_tensor_parallel_inside_trains_at_parity():
    """replicate 2 x dp 2 x tp 2 on 8 gloo ranks, ``fully_shard`` on the (replicate, dp)
    mesh, every sharded strategy compiled: parameters replicated over "replicate", sharded
    over "dp" and "tp", against the unsharded model on the global batch."""
    ref_losses, ref_params = _reference()
    for rank_results in spawn(_hsdp_train, 2 * DP * TP, strategies=tuple(sorted(GATHERING_STRATEGIES))):
        for strategy, (losses, params) in rank_results.items():
            param_error = max(relative_error(params[n], ref_params[n]) for n in ref_params)
            assert relative_error(losses, ref_losses) < 1e-5 and param_error < 1e-5, (strategy, param_error)


@pytest.mark.structure
def test_rows_cut_unevenly_by_tp_then_over_three_dp_ranks_are_refused():
    """13 rows over tp 2, then over dp 3: torch's ``_StridedShard`` would describe other rows
    than each rank holds, and a checkpoint would misplace them (FSDP2's limit too). Over dp 2
    the layout is exact, and such a parameter is sharded."""
    for dp, refused in ((3, True), (2, False)):
        with fake_process_group(dp * TP):
            mesh = init_device_mesh("cpu", (dp, TP), mesh_dim_names=("dp", "tp"))
            model = nn.Sequential(nn.Linear(4, 13), nn.ReLU(), nn.Linear(13, 4))
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            if refused:
                with pytest.raises(UsageError, match="'0.weight' has 13 rows, which tensor parallelism cuts unevenly"):
                    fully_shard(model, mesh=mesh["dp"])
            else:
                fully_shard(model, mesh=mesh["dp"])
                assert shard_info(model[0]._parameters["weight"]).tensor_parallel is not None


def _float8_transformer(mesh, *, float8_styles: bool = False, sharded: bool = True) -> nn.Module:
    """The float8 test transformer (``FLOAT8_CFG``: every linear but the head float8) with its
    MLPs split over "tp", sharded over "dp" unless ``sharded`` is False."""
    model = float8_model(FLOAT8_CFG)
    transformer_tensor_parallel(model, mesh["tp"], float8_styles=float8_styles)
    return fully_shard(model, mesh=mesh["dp"]) if sharded else model


@pytest.mark.structure
def test_float8_weights_under_tensor_parallelism_are_gathered_in_float8_over_dp():
    """A float8 linear split by tensor parallelism: its piece is gathered over "dp" in float8
    (bytes as uint8), and its scale is the whole weight's, the max over "dp" then over "tp"
    (NOTE: float8 gathers). A bucket's maxes are reduced once per group: the one over "tp"
    (its tensor-parallel weights') never merged with the one over "dp"."""
    pytest.importorskip("torchao")
    with fake_process_group(DP * TP):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        dp, tp = (mesh[d].get_group().group_name for d in ("dp", "tp"))
        model = _float8_transformer(mesh)
        gate = model.layers[0].mlp.gate._parameters["weight"]
        assert shard_info(gate).float8 is not None and shard_info(gate).tensor_parallel is not None
        assert isinstance(gate, DTensor) and gate.to_local().dtype == torch.float32  # the master's shard
        backend = MfsdpBackend(compiler="eager")
        tokens, targets = make_batch(FLOAT8_CFG, 2, 8, 0, 0)
        loss_fn(torch.compile(model, backend=backend)(tokens), targets).backward()
    (graph,) = backend.graphs
    tensor_parallel_float8 = {p.param_id for p in graph.plan.params if p.sharding.float8 and p.sharding.tensor_parallel}
    assert len(tensor_parallel_float8) == 2 * FLOAT8_CFG.n_layers  # gate and down
    for gm in (graph.forward, graph.backward):
        gathers = [n for n in gm.graph.nodes if n.target in (ALL_GATHER, ALL_GATHER_OUT)]
        assert {n.args[-1] for n in gathers} == {dp}
        float8_gathers = [n for n in gathers if tensor_parallel_float8 & set(n.meta[MEMBERS])]
        assert float8_gathers and all(n.args[0].meta["val"].dtype == torch.uint8 for n in float8_gathers)
    # The weights' maxes (the activations' float8 casts add maxes over "tp" of their own, in
    # no bucket): one per float8 bucket and group, in the forward; the backward's re-gathers
    # reuse the forward's scales.
    maxes = {
        gm: [n for n in gm.graph.nodes if n.target == ALL_REDUCE and n.args[1] == "max" and BUCKET in n.meta]
        for gm in (graph.forward, graph.backward)
    }
    by_group = {g: [n.meta[MEMBERS] for n in maxes[graph.forward] if n.args[-1] == g] for g in (dp, tp)}
    assert len(by_group[dp]) == len(by_group[tp]) == FLOAT8_CFG.n_layers and not maxes[graph.backward], by_group
    assert all(set(over_tp) == set(over_dp) & tensor_parallel_float8 for over_dp, over_tp in zip(*by_group.values()))


@pytest.mark.structure
def test_float8_under_tensor_parallelism_with_an_uneven_split_is_refused_before_any_collective():
    """The head's 67 rows split over tp 2 (34 rows on one rank, 33 on the other) beside
    float8 weights: the "tp" ranks would plan their steps apart, and the float8 maxes over
    "tp" could pair up wrong (NOTE: float8 gathers), so every rank refuses alike. The same
    uneven split without float8 shards."""
    pytest.importorskip("torchao")
    for float8 in (True, False):
        with fake_process_group(DP * TP):
            mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
            model = float8_model(FLOAT8_CFG) if float8 else build_model(FLOAT8_CFG)
            transformer_tensor_parallel(model, mesh["tp"])
            parallelize_module(model, mesh["tp"], {"head": ColwiseParallel(output_layouts=Replicate())})
            if float8:
                says = "'head.weight' has 67 entries on dim 0, which tensor parallelism splits unevenly over 2 ranks, and 'layers.0.mlp.gate.weight' is a float8 weight"
                with pytest.raises(UsageError, match=says):
                    fully_shard(model, mesh=mesh["dp"])
            else:
                fully_shard(model, mesh=mesh["dp"])


@pytest.mark.structure
def test_expert_mesh_over_dp_puts_consecutive_dp_ranks_in_one_ep_group():
    """dp 4 x tp 2 (8 ranks), EP 2: each EP group is two consecutive ranks of this rank's
    data-parallel group (inside one node where they fit), as ``expert_mesh`` groups the
    world's consecutive ranks without tensor parallelism; no group crosses "tp". HSDP's
    replicate 2 x dp 2 x tp 2 reads its two data-parallel dimensions in row-major order: the
    same ranks, the same groups (flattened into one dimension, they are refused)."""
    for rank, ep, edp in ((0, [0, 2], [0, 4]), (5, [5, 7], [1, 5])):
        for shape, names, data in (((4, 2), ("dp", "tp"), "dp"), ((2, 2, 2), ("replicate", "dp", "tp"), ("replicate", "dp"))):
            with fake_process_group(8, rank=rank):
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
                experts = fsdp_compile.expert_mesh("cpu", 2, dp_mesh=mesh[data])
                assert experts.mesh_dim_names == ("ep", "edp")
                assert (experts["ep"].mesh.tolist(), experts["edp"].mesh.tolist()) == (ep, edp), shape
                if len(shape) == 3:  # the same ranks flattened into one dimension are refused, naming the fix
                    with pytest.raises(UsageError, match=r"not made of dimensions of its mesh.*mesh\['replicate', 'dp'\]"):
                        fsdp_compile.expert_mesh("cpu", 2, dp_mesh=mesh[data]._flatten("dp_flat"))


@pytest.mark.multirank
def test_float8_weights_under_tensor_parallelism_give_the_gradients_of_the_model_without_mfsdp():
    """On 4 gloo ranks (dp 2 x tp 2), one step on one batch: with torch's styles the float8
    linears' gradients are the unsharded float8 model's; with torchao's float8 styles (whose
    row-parallel output gradient is cast to float8 before it crosses "tp") the same model
    split over "tp" alone, without mfsdp; and HF Llama in float8 under sequence parallelism
    (torchtitan's recipe), against the same split without mfsdp. Uncompiled, and compiled:
    HF Llama by the default backend (Inductor, as users compile), the test transformer's two
    splits by the eager runner (the same graphs; Inductor costs 25 s more on 2 cores, and
    its float8 code has tests of its own, test_float8.py)."""
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    results = spawn(_float8_gradients, DP * TP)
    for result in results:
        for case, (loss_error, (worst, name)) in result.items():
            assert loss_error < 1e-6 and worst < 1e-5, (case, loss_error, worst, name)


def _float8_gradients(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    tokens, targets = make_batch(FLOAT8_CFG, 2, 8, 0, 0)  # one batch on every rank
    errors = {}
    splits = {
        "torch_styles": (partial(_float8_transformer, mesh), lambda: float8_model(FLOAT8_CFG)),
        "float8_styles": (
            partial(_float8_transformer, mesh, float8_styles=True),
            partial(_float8_transformer, mesh, float8_styles=True, sharded=False),
        ),
        "hf_llama_sequence_parallel": (partial(_float8_hf_llama, mesh), partial(_float8_hf_llama, mesh, sharded=False)),
    }
    for split, (build, build_reference) in splits.items():
        if split == "hf_llama_sequence_parallel":
            loss_of = partial(_hf_loss, tokens=_batch(0, 0))
        else:
            loss_of = lambda forward: loss_fn(forward(tokens), targets)  # noqa: E731
        reference = build_reference()
        ref_loss = loss_of(reference)
        ref_loss.backward()
        for compiled in (False, True):
            torch._dynamo.reset()
            model = build()
            backend = "mfsdp" if split == "hf_llama_sequence_parallel" else MfsdpBackend(compiler="eager")
            forward = torch.compile(model, backend=backend) if compiled else model
            loss = loss_of(forward)
            loss.backward()
            grads, ref_grads = _full_grads(model), _full_grads(reference)
            assert {n for n, g in grads.items() if g is None} == {n for n, g in ref_grads.items() if g is None}
            errors[f"{split} compiled={compiled}"] = (
                relative_error(loss.detach(), ref_loss.detach()),
                max_param_error(*({n: g for n, g in d.items() if g is not None} for d in (grads, ref_grads))),
            )
    return errors


def _float8_hf_llama(mesh, sharded: bool = True) -> nn.Module:
    """HF Llama (hidden 64, so every split piece is a multiple of 16) with every linear but
    the head float8, split by ``hf_llama_sequence_parallel``, sharded over "dp" unless
    ``sharded`` is False."""
    import transformers
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).train()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "lm_head")
    hf_llama_sequence_parallel(model, mesh["tp"])
    return fully_shard(model, mesh=mesh["dp"]) if sharded else model


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (a collective over a DTensor's mesh)."""
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
