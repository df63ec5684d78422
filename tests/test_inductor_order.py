"""The planned collective order is the order that runs: read from the code Inductor generates
(the default), or from the ops the step calls (``compile_outside_blocks=False``, where the graph
around the compiled block bodies runs as Python; NOTE: what Inductor compiles)."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

from fsdp_compile import MfsdpBackend, MixedPrecision, fully_shard
from fsdp_compile.testing.models import TransformerConfig, loss_fn, make_batch
from fsdp_compile.passes import gather_lifetimes
from fsdp_compile.patterns import is_collective, is_wait
from harness import build_model, fake_process_group

pytestmark = pytest.mark.structure

_ISSUE = re.compile(r"_c10d_functional\.(all_gather_into_tensor|all_gather_into_tensor_out|reduce_scatter_tensor)\.default\(")
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\(")


def _code_events(code: str) -> list[str]:
    """"issue" / "wait" per collective call of a generated module, in code order."""
    events = []
    for line in code.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if _ISSUE.search(line):
            events.append("issue")
        elif _WAIT.search(line):
            events.append("wait")
    return events


def _graph_events(gm) -> list[str]:
    return ["issue" if is_collective(n) else "wait" for n in gm.graph.nodes if is_collective(n) or is_wait(n)]


def _check_planned(graph, forward_events: list[str], backward_events: list[str]) -> None:
    planned_forward, planned_backward = (_graph_events(graph.compiled[r]) for r in ("forward", "backward"))
    assert backward_events == planned_backward
    assert forward_events == planned_forward
    assert planned_forward.count("issue") == len(graph.plan.buckets)
    # Prefetch 1: each gather but the first is in flight while the bucket before it computes.
    lifetimes = gather_lifetimes(graph.compiled["forward"], graph.plan)
    assert all(t.issue < earlier.first_use for earlier, t in zip(lifetimes, lifetimes[1:])), lifetimes


def _called_events(run) -> list[str]:
    """"issue" / "wait" per functional collective op ``run()`` calls, in call order (from the
    profiler: the compiled step's own calls, whatever runs them). An op called inside another
    is the outer one's work, not a call of the step's: on CPU the gather runs its ``_out``
    variant (compat.gather_cpu_tensors_one_work_each)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    calls = sorted(
        (e.time_range.start, e.name) for e in prof.events() if _is_functional(e) and not _inside_functional(e)
    )
    return ["wait" if name.endswith("wait_tensor") else "issue" for _, name in calls]


def _is_functional(event) -> bool:
    return event.name.startswith("_c10d_functional::")


def _inside_functional(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_functional(parent):
            return True
        parent = parent.cpu_parent
    return False


def test_the_graph_around_the_bodies_runs_collectives_in_the_planned_order():
    """With ``compile_outside_blocks=False`` Inductor compiles the block bodies only and the
    rest of each graph runs as its Python, ATen call by ATen call: the collectives and waits the forward and the backward
    call are the scheduled graphs', in their order (prefetch distance 1 in the forward)."""
    cfg = TransformerConfig(n_layers=2)
    with fake_process_group(8):
        model = fully_shard(build_model(cfg))
        backend = MfsdpBackend(compiler="inductor", compile_cache=False, compile_outside_blocks=False)
        tokens, targets = make_batch(cfg, 2, 8, 0)
        step = torch.compile(model, backend=backend)
        loss = torch.nn.functional.cross_entropy(step(tokens).flatten(0, 1), targets.flatten())  # compiles
        loss.backward()
        losses = []
        forward_events = _called_events(
            lambda: losses.append(torch.nn.functional.cross_entropy(step(tokens).flatten(0, 1), targets.flatten()))
        )
        backward_events = _called_events(losses[0].backward)
    (graph,) = backend.graphs
    _check_planned(graph, forward_events, backward_events)


def test_inductor_code_issues_collectives_in_the_planned_order():
    """By default Inductor compiles the whole graph, and the generated
    forward and backward call every collective and wait in the scheduled graph's order, so
    every planned prefetch survives. Without
    options["compiler"]'s config patch, Inductor's peak-memory reordering put every wait right
    after its gather; with the gather issued after the glue between two blocks (before
    schedule_collectives issued it where that glue starts), Inductor's fusion of the glue with
    the next block's first use pulled the previous wait in front of the final norm's gather."""
    cfg = TransformerConfig(n_layers=2)
    with fake_process_group(8):
        model = fully_shard(build_model(cfg))
        # compile_cache=False: the test reads the compiled graphs, which a cache hit never builds.
        backend = MfsdpBackend(compiler="inductor", compile_cache=False)
        tokens, _ = make_batch(cfg, 2, 8, 0)
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            _, codes = run_and_get_code(torch.compile(model, backend=backend), tokens)
    # The step's forward and backward; the block's body (compiled too) calls no collective.
    forward_code, backward_code = (code for code in codes if _ISSUE.search(code))
    (graph,) = backend.graphs
    _check_planned(graph, _code_events(forward_code), _code_events(backward_code))


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-fp32"])
def test_inductor_code_packs_one_gradient_bucket_at_a_time(mixed):
    """Each reduce-scatter is waited on before the next bucket's gradients are packed, so one
    packed bucket is alive at a time, as in FSDP2 (schedule_collectives). A pack whose view
    Inductor's joint-graph passes had removed went untagged, stayed behind the next wait,
    and two fp32 packs were alive: 1.1 GB more peak for the Mixtral preset on an H100."""
    cfg = TransformerConfig(n_layers=3)
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    with fake_process_group(8):
        model = fully_shard(build_model(cfg), mp_policy=policy)
        backend = MfsdpBackend(compiler="inductor", compile_cache=False)
        tokens, targets = make_batch(cfg, 2, 8, 0)
        step = torch.compile(model, backend=backend)
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            _, codes = run_and_get_code(lambda: loss_fn(step(tokens), targets).backward())
    (backward_code,) = (code for code in codes if "reduce_scatter_tensor.default(" in code)
    packs, late = _packs_and_those_made_while_a_reduce_scatter_is_open(backward_code)
    assert packs >= cfg.n_layers and late == 0


_BUFFER_ISSUED = re.compile(r"(buf\d+) = torch\.ops\._c10d_functional\.reduce_scatter_tensor\.default\(")
_BUFFER_WAITED = re.compile(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)")


def _packs_and_those_made_while_a_reduce_scatter_is_open(code: str) -> tuple[int, int]:
    """Gradient packs the code makes, and those made while an earlier reduce-scatter is not
    yet waited on (its packed input is then alive beside the new one)."""
    packs, late, open_ = 0, 0, set()
    for line in code.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if issued := _BUFFER_ISSUED.search(line):
            open_.add(issued.group(1))
        elif waited := _BUFFER_WAITED.search(line):
            open_.discard(waited.group(1))
        elif "fsdp_compile.pack_for_reduce_scatter.default(" in line:
            packs += 1
            late += bool(open_)
    return packs, late


@pytest.mark.parametrize("given", ["mode", "options"])
def test_torch_compile_s_mode_tunes_every_inductor_compile_but_its_cuda_graphs(given, monkeypatch, tmp_path):
    """``torch.compile(model, backend="mfsdp", mode="max-autotune")``: before, the backend
    failed with "mfsdp_backend() got an unexpected keyword argument 'mode'". Now each graph
    Inductor compiles, the step's forward and backward and the block's body, compiles under the
    mode's settings, less its CUDA graphs, which is said with the fix (capture_step). Inductor
    is then run without the tuning itself: what is checked is that the settings reach it."""
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import config as inductor_config

    compiled_under = []
    real_inner = compile_fx_module.compile_fx_inner

    def recording_inner(gm, example_inputs, **kwargs):
        compiled_under.append(
            (inductor_config.max_autotune, inductor_config.coordinate_descent_tuning, inductor_config.triton.cudagraphs)
        )
        with inductor_config.patch(max_autotune=False, coordinate_descent_tuning=False):
            return real_inner(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx_inner", recording_inner)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # every graph compiled, none loaded
    cfg = TransformerConfig(n_layers=2)
    with fake_process_group(2):
        model = fully_shard(build_model(cfg))
        tokens, targets = make_batch(cfg, 2, 8, 0)
        with pytest.warns(UserWarning, match=r"mode='max-autotune'.*not its CUDA graphs.*capture_step"):
            if given == "mode":
                step = torch.compile(model, backend="mfsdp", mode="max-autotune")
            else:
                step = torch.compile(model, backend=MfsdpBackend(mode="max-autotune"))
            loss_fn(step(tokens), targets).backward()
    # The step's forward and backward and the body's forward and backward.
    assert len(compiled_under) == 4, compiled_under
    assert set(compiled_under) == {(True, True, False)}, compiled_under
