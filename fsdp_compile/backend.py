"""The ``mfsdp`` Dynamo backend: one ``CompiledGraph`` drives each graph through its stages.

    Dynamo graph ─ plan ─ Dynamo-stage passes ─> AOTAutograd ─ joint graph ─ joint-stage passes
        ─> min-cut partition ─ forward / backward graphs ─ partitioned-stage passes
        ─> Inductor (compile_fx), or the eager FX runner

A repeated block reaches the backend as one ``fsdp_compile::block_forward`` node per layer
(NOTE: one op per block call, in block_call.py): every collective stays in the step's graphs,
where the passes act, and the block's body is a frame of its own that the same backend compiles
(``MfsdpBackend.frame``), once per structure. With ``compile_outside_blocks=False`` Inductor
compiles the bodies only: the step's graphs run as their Python, as FSDP2 runs the root of a
model whose blocks are compiled.
"""

from __future__ import annotations

import functools
import itertools
import time
import types
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.fx.graph import _BoxedCodeGen

from fsdp_compile.block_call import block_calls_keep_their_buffers, note_traced_grading
from fsdp_compile.block_record import call_record
from fsdp_compile.block_runtime import PendingGraphs
from fsdp_compile.compat import compile_caches_work, missing_gradients_stay_missing, unused_output_grads_freed_in_backward
from fsdp_compile.debug import GraphDumper, debug_dir, frame_dumper
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.passes.check_graph_breaks import graph_break
from fsdp_compile.patterns import is_block_call, named_calls
from fsdp_compile.pipeline import Stage, build_pipeline
from fsdp_compile.plan import BackendOptions, Plan
from fsdp_compile.planner import build_plan
from fsdp_compile.recompile_limit import Recompile, note_compile

__all__ = ["mfsdp_backend", "MfsdpBackend", "CompiledGraph", "register", "compiling_backend"]

_PACKAGE = Path(__file__).parent
# What decides the code a graph compiles to: the cache key covers the package's modules and
# the plan, not its tools (the bench, the test helpers) or the docs, whose edits must not
# invalidate users' caches.
_COMPILED_CODE_SOURCES = tuple(
    sorted(str(p) for p in _PACKAGE.rglob("*.py") if p.relative_to(_PACKAGE).parts[0] not in ("bench", "testing"))
)


class _Partitioner(CustomPartitionerFn):
    """The graph's joint-stage passes and AOTAutograd's min-cut partitioner, as Inductor's
    ``custom_partitioner_fn`` and as ``aot_autograd``'s ``partition_fn`` (the eager runner),
    so both compilers partition the same rewritten graph."""

    def __init__(self, graph: CompiledGraph) -> None:
        self.graph = graph

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        return self.graph.partition(gm, joint_inputs, **kwargs)

    def __reduce__(self):
        # torch 2.13 also hashes config.custom_partitioner_fn itself into the FX graph cache
        # key by pickling it; pickled whole, it would differ in every process. What
        # identifies it is its uuid.
        return (str, (repr(self.uuid()),))

    def uuid(self) -> Any:
        # Stable across processes and ranks: file contents and the plan, whose labels are
        # counters a fresh process hands out alike (fsdp_compile.records).
        return (get_hash_for_files(_COMPILED_CODE_SOURCES), self.graph.plan.cache_key())


def _run_graph(gm: fx.GraphModule, example_inputs: Sequence[object], **_: Any):
    """The eager FX runner: the rewritten graph's generated Python in AOTAutograd's boxed
    calling convention, as torch's ``aot_eager`` runs it.

    The code takes the argument list and clears it, and FX's code drops every value after its
    last use, so an input (a saved activation in the backward, a gathered weight) is freed as
    the graph goes, as Inductor's code frees it. Called unboxed, the caller's list would keep
    every input alive until the graph returned: in the backward, every layer's saved
    activations at once.
    """
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    # The module itself would be a boxed callable too, but through nn.Module.__call__ at
    # every call; the generated function is called directly instead.
    forward = gm.forward

    def run(args: list) -> Any:
        return forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _keeping_block_buffers(compile_graph: Callable) -> Callable:
    """Inductor's graph compiler, lowering the block calls of each graph it compiles so that
    no buffer they read or return is reused (``block_calls_keep_their_buffers``): the step's
    forward, and its backward, which recomputes checkpointed blocks and may compile after
    ``compile`` returned."""

    def compile_keeping(gm: fx.GraphModule, example_inputs: Sequence[object], **kwargs: Any):
        if not any(is_block_call(n) for n in gm.graph.nodes):
            return compile_graph(gm, example_inputs, **kwargs)
        with block_calls_keep_their_buffers():
            return compile_graph(gm, example_inputs, **kwargs)

    return compile_keeping


def _with_block_calls(compiled: Callable, calls: tuple) -> Callable:
    """``compiled``, first noting which weights its calls' backward grades (``note_traced_grading``)
    and dropping the calls' autograd graphs no backward can take any more (``PendingGraphs.sweep``:
    a forward whose loss was dropped undifferentiated, as in a validation pass with gradients
    on, would otherwise hold its activations into this step)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if (owner := calls[0].backend()) is not None:
            owner.pending.sweep()
        note_traced_grading(calls)
        return compiled(*args, **kwargs)

    # What AOTAutograd's callable carries (``serialize``, ``zero_grad``...) stays readable.
    return functools.update_wrapper(run, compiled, assigned=(), updated=("__dict__",))


class CompiledGraph:
    """One graph Dynamo handed the backend, driven through every stage; it keeps the plan and
    the graph each stage produced, for inspection, dumps and tests."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list, options: BackendOptions, ranks_in_step: bool) -> None:
        self.plan: Plan = build_plan(gm, example_inputs, options, ranks_in_step)
        self.calls = tuple(map(call_record, named_calls(gm)))
        """The block calls this graph names, kept by the graph too: one kept for inspection
        (the simulator, ``explain``) reads them after its backend is gone."""
        self.pipeline = build_pipeline(self.plan)
        root = debug_dir(options.debug_dir)
        self.dumper = GraphDumper(root, self.plan) if root else None
        self._dump_frame = frame_dumper(root) if root else None
        """Wraps the compiled graph to write its frame at the first call (dumps only)."""
        self.dynamo: fx.GraphModule = gm
        """Dynamo's graph, after the Dynamo-stage passes."""
        self.joint: fx.GraphModule | None = None
        """AOTAutograd's joint graph after the joint-stage passes (None on a cache hit)."""
        self.compiled: dict[str, fx.GraphModule] = {}
        """"forward", "backward", "inference": each graph as compiled, after the
        partitioned-stage passes. AOTAutograd may compile the backward lazily, at the first
        backward; a cache hit compiles nothing, and leaves this empty."""
        self.passes: list[dict] = []
        """Every pass run on this graph's stages, in order: pass, seconds, collectives after."""
        self.seconds: dict[str, float] = defaultdict(float)
        """Time spent in each stage of ours: "passes" (all stages), "partitioner" (min-cut,
        bodies included) and "compiler" (Inductor or the eager runner, per graph)."""

    @property
    def forward(self) -> fx.GraphModule:
        return self._compiled("forward")

    @property
    def backward(self) -> fx.GraphModule:
        return self._compiled("backward")

    def _compiled(self, role: str) -> fx.GraphModule:
        if role not in self.compiled:
            raise LookupError(
                f"graph {self.plan.graph_name} has no compiled {role} graph yet: it is compiled "
                "at the first call (a backward at the first backward), and not at all when it "
                "came from the compile cache (options={'compile_cache': False} compiles afresh)."
            )
        return self.compiled[role]

    def _run(self, stage: Stage, gm: fx.GraphModule) -> fx.GraphModule:
        start = time.perf_counter()
        # Partitioned graphs are dumped once, as compiled (the passes of both graphs would
        # interleave under one name).
        dump = self.dumper.graph if self.dumper and stage != "partitioned" else None
        gm = self.pipeline.run(gm, stage, dump, self.passes)
        self.seconds["passes"] += time.perf_counter() - start
        return gm

    def _partition(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        start = time.perf_counter()
        forward, backward = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.seconds["partitioner"] += time.perf_counter() - start
        return forward, backward

    def compile(self, example_inputs: list) -> Callable:
        """Run the Dynamo stage, then hand the graph to AOTAutograd and the compiler. The
        example inputs are the step's real tensors, parameters included: kept past this call
        (the compiled step holds this object until its lazy backward compiles, and Dynamo
        keeps the compiled step in the user's module globals) they would hold a dropped
        model's memory for the life of the process."""
        compiled = self._compile_stages(example_inputs)
        if self.calls:
            compiled = _with_block_calls(compiled, self.calls)
        return self._dump_frame(compiled) if self._dump_frame else compiled

    def _compile_stages(self, example_inputs: list) -> Callable:
        if self.dumper:
            self.dumper.graph("dynamo", self.dynamo)
        self.dynamo = self._run("dynamo", self.dynamo)
        partitioner = _Partitioner(self)
        options = self.plan.options
        # NOTE: what Inductor compiles. With compile_outside_blocks=False the step's graphs
        # run as their Python and Inductor compiles the blocks' bodies only (frames of their
        # own, see block_call.py): compile time spent per layer is Dynamo's and AOTAutograd's
        # alone, at the price of the unfused code around the blocks and of the AOTAutograd
        # cache for the step, which stores only what Inductor compiled.
        if options.compiler == "eager" or (
            not options.compile_outside_blocks and any(is_block_call(n) for n in self.dynamo.graph.nodes)
        ):
            return aot_autograd(
                fw_compiler=self._with_partitioned_passes(_run_graph, "forward"),
                bw_compiler=self._with_partitioned_passes(_run_graph, "backward"),
                inference_compiler=self._with_partitioned_passes(_run_graph, "inference"),
                partition_fn=partitioner,
            )(self.dynamo, example_inputs)
        return self._inductor(partitioner, example_inputs)

    def _inductor(self, partitioner: _Partitioner, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        # NOTE: compile caches. A restart loads what Inductor compiled from its FX graph
        # cache, and the graph whole from AOTAutograd's: our partitioner's uuid keys them (the
        # files that decide the compiled code, and the plan, rank included). On an
        # AOTAutograd hit neither the partitioner nor the partitioned-stage passes run, so
        # `compiled` stays empty.
        # Dumps and inspection need every stage, hence no cache with a debug_dir or
        # compile_cache=False. torch 2.13 keys a graph of DTensors per process and loads it
        # without its opaque constants (the gradients' DeviceMesh): compat.py fixes both.
        cached = self.plan.options.compile_cache and self.dumper is None
        with (
            torch._functorch.config.patch(enable_autograd_cache=cached),
            compile_caches_work(),
        ):
            return compile_fx(
                self.dynamo,
                example_inputs,
                inner_compile=self._with_partitioned_passes(_keeping_block_buffers(compile_fx_inner)),
                config_patches={
                    **self.plan.options.inductor_config,  # NOTE: torch.compile's mode
                    "custom_partitioner_fn": partitioner,
                    # Inductor's peak-memory reordering would move each gather down to its
                    # wait and undo the planned prefetch; schedule_collectives bounds memory
                    # instead (see docs/design.md, "The order under Inductor").
                    "reorder_for_peak_memory": False,
                    "fx_graph_cache": cached,
                },
            )

    def partition(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        """A joint graph to (forward, backward), after the joint-stage passes."""
        if self.dumper:
            self.dumper.graph("joint", gm)
        self.joint = self._run("joint", gm)
        return self._partition(self.joint, joint_inputs, **kwargs)

    def _with_partitioned_passes(self, compile_graph, role: str | None = None):
        """Wrap a graph compiler so the partitioned stage runs on every graph it receives:
        forward and backward after partitioning, and the single graph of inference calls.
        ``role`` names the graph; None reads it from Inductor's ``is_backward`` /
        ``is_inference`` arguments."""

        def compile_with_passes(gm: fx.GraphModule, example_inputs: Sequence[object], **kwargs: Any):
            gm = self._run("partitioned", gm)
            graph_role = role or (
                "backward" if kwargs.get("is_backward") else
                "inference" if kwargs.get("is_inference") else "forward"
            )
            self.compiled[graph_role] = gm
            if self.dumper is not None:
                self.dumper.compiled(graph_role, gm)
            start = time.perf_counter()
            # A backward is compiled (or loaded) at the first backward, after compile() returned.
            with compile_caches_work():
                compiled = compile_graph(gm, example_inputs, **kwargs)
            self.seconds["compiler"] += time.perf_counter() - start
            return compiled

        return compile_with_passes


_BACKEND_SERIALS = itertools.count()


class MfsdpBackend:
    """A Dynamo backend object; ``torch.compile(model, backend=MfsdpBackend(compiler="eager"))``.

    Same as ``backend="mfsdp"`` with ``options``, and it keeps every graph it compiled for
    inspection and tests: ``graphs``, the step's (plans and the graphs of each stage), and
    ``bodies``, each repeated block's body by name (one per block structure), compiled at its
    first call.
    """

    def __init__(self, **options: Any) -> None:
        self.options = BackendOptions.parse(options)
        self.graphs: list[CompiledGraph] = []
        self.bodies: dict[str, list[CompiledGraph]] = defaultdict(list)
        self.calls: list = []
        """The repeated blocks' calls this backend's traces named (``block_record.BlockCall``):
        owned here, they live as long as the graphs that name them."""
        self.meta_runs: dict[tuple, dict] = {}
        """The block calls' fake runs while its graphs run on the meta device (the
        simulator's step), one per structure and input layout (``block_fakes.fake_run``)."""
        self.pending = PendingGraphs()
        """The autograd graphs of the block calls whose backward has not run yet."""
        self._serial = next(_BACKEND_SERIALS)
        self.body_names: dict[tuple, str] = {}
        """The name of each body this backend compiles, by its blocks' ``region_body.structure``
        (NOTE: structure before guards, in region_body.py): ``_region_0``, ``_region_1``..."""
        self._frames: dict[str, Callable] = {}
        self.unfakeable: set[str] = set()
        """The bodies (by name) whose block's Python could not run on fake tensors (a
        data-dependent op): their calls are traced inline (NOTE: a block fake tensors cannot
        run, in block_fakes.py)."""
        self._said: set[tuple[str, str]] = set()
        """What this backend said once: the frames whose graph break it said (NOTE: a graph
        break is said), an HF model traced inline (fsdp_compile/hf.py)."""
        self.recompiles: dict[str, dict[int, Recompile]] = defaultdict(dict)
        """Per frame this backend compiled, by Dynamo's count of that frame's compiles, what
        that compile was for (NOTE: the recompile limit is said)."""

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **given: Any):
        if given:  # torch.compile(model, backend=MfsdpBackend(), mode=... or options=...)
            raise CompileUsageError(
                f"torch.compile passed {' and '.join(sorted(given))} to an MfsdpBackend object, "
                "which takes them itself: MfsdpBackend(mode=..., **options)."
            )
        return unused_output_grads_freed_in_backward(self._compile(self.graphs, gm, example_inputs))

    def says_first(self, said: tuple[str, str]) -> bool:
        """Whether ``said`` is new to this backend, which keeps it from now on."""
        new = said not in self._said
        self._said.add(said)
        return new

    def all_graphs(self) -> list[CompiledGraph]:
        """Every graph this backend compiled: the step's, then the bodies'."""
        return [*self.graphs, *(g for bodies in self.bodies.values() for g in bodies)]

    def _compile(self, graphs: list[CompiledGraph], gm: fx.GraphModule, example_inputs: list):
        owner = compiling_backend() or self
        if not self.options.cuda_graph:  # refused there, by the pipeline's check
            _say_graph_break(gm, owner)
        ranks_in_step = note_compile(owner.recompiles, f"_of_backend{owner._serial}", gm, example_inputs)
        graph = CompiledGraph(gm, example_inputs, self.options, ranks_in_step=ranks_in_step)
        graphs.append(graph)
        with missing_gradients_stay_missing():
            return graph.compile(example_inputs)

    def frame(self, name: str, body: Callable) -> Callable:
        """``body`` (a repeated block's, NOTE: one op per block call) compiled by this backend
        as a frame of its own: a code object per body and backend, so each has its own Dynamo
        cache and recompile budget."""
        if name not in self._frames:
            code = body.__code__.replace(co_name=f"{name}_of_backend{self._serial}")
            function = types.FunctionType(code, body.__globals__, code.co_name)
            self._frames[name] = torch.compile(function, backend=functools.partial(self._compile, self.bodies[name]))
        return self._frames[name]


def compiling_backend() -> MfsdpBackend | None:
    """The mfsdp backend Dynamo is tracing the current frame for; None when Dynamo is not
    tracing, or traces for another backend (run, not traced, from a function Dynamo calls).

    ``backend="mfsdp"`` compiles each graph with a new backend object; the blocks' bodies,
    compiled later, need one that lasts: one per ``torch.compile`` call, kept on the object
    that call made to hold the backend and its options (so two models compiled apart never
    share their bodies' frames, graphs or dumps)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    if torch._guards.TracingContext.try_get() is None:
        return None
    outermost = backend = InstructionTranslator.current_tx().output.compiler_fn
    holder = None
    # Dynamo wraps the backend (WrapBackendDebug, then torch.compile's wrapper of a backend
    # and its options).
    while backend is not None and not isinstance(backend, MfsdpBackend):
        if backend is mfsdp_backend:
            holder = holder or outermost  # torch._dynamo.optimize("mfsdp"): no options
            if getattr(holder, "_mfsdp_backend", None) is None:
                holder._mfsdp_backend = _asked_by_torch_compile(**(getattr(holder, "kwargs", None) or {}))
            return holder._mfsdp_backend
        holder = backend if getattr(backend, "kwargs", None) is not None else holder
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
    return backend


# NOTE: a graph break is said
#     A break costs mfsdp more than it costs plain torch.compile, which says nothing: the plan
#     (bucketing, prefetch, the repeated blocks' compiled bodies) covers one graph, and what
#     runs in Python between graphs gathers each parameter it reads on its own; a repeated
#     block called there runs uncompiled (HF's activation_checkpointing_enable(offload=True)
#     did that to every layer, unsaid: torch's save_on_cpu, around each checkpoint, is not
#     traced). So each frame that breaks is said once per torch.compile call: the lasting
#     backend keeps which it said, as Python's own once-only filter forgets whenever a compile
#     enters warnings.catch_warnings.


def _say_graph_break(gm: fx.GraphModule, owner: MfsdpBackend) -> None:
    """Warn of the break around ``gm``, once per break for ``owner`` (NOTE: a graph break is
    said)."""
    found = graph_break(gm)
    if found is None or not owner.says_first(found[0]):
        return
    sentence = found[1]
    warnings.warn(
        f"mfsdp: the step is not one graph. {sentence} What runs there gathers each parameter it "
        "reads on its own, with no prefetch or bucketing, and a repeated block called there runs "
        "uncompiled: the graphs are what mfsdp's plan covers.",
        stacklevel=3,
    )


# NOTE: torch.compile's mode
#     ``torch.compile(model, backend="mfsdp", mode=...)`` hands the backend the mode (torch
#     passes a backend other than Inductor either ``mode`` or ``options``). mfsdp compiles
#     with Inductor, so it applies the mode's Inductor settings (``list_mode_options``:
#     ``max_autotune``, ``coordinate_descent_tuning``) to every graph it compiles, the
#     bodies included, and says once that it leaves out the mode's CUDA graphs: one per
#     graph, between the step's collectives, where mfsdp captures the whole step in one
#     (``capture_step``). ``MfsdpBackend(mode=...)`` and ``options={"mode": ...}`` do the same.


def mfsdp_backend(gm: fx.GraphModule, example_inputs: list, *, options: dict | None = None, mode: str | None = None):
    """``torch.compile(model, backend="mfsdp", options={...})`` (or ``mode=...``) lands here
    once per graph."""
    return _asked_by_torch_compile(options, mode)(gm, example_inputs)


def _asked_by_torch_compile(options: dict | None = None, mode: str | None = None) -> MfsdpBackend:
    """The backend ``torch.compile(..., backend="mfsdp")`` asks for with its ``options`` or
    its ``mode`` (NOTE: torch.compile's mode)."""
    return MfsdpBackend(**(options or {}), **({} if mode is None else {"mode": mode}))


def register() -> None:
    """Make ``backend="mfsdp"`` resolve where the package was not installed (the
    ``torch_dynamo_backends`` entry point does it for an installed package); idempotent."""
    from torch._dynamo import list_backends, register_backend

    if "mfsdp" not in list_backends(exclude_tags=()):
        register_backend(name="mfsdp")(mfsdp_backend)
