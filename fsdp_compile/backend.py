"""The ``mfsdp`` Dynamo backend: one ``CompiledGraph`` drives each graph through its stages.

    Dynamo graph ─ plan ─ Dynamo-stage passes ─> AOTAutograd ─ joint graph ─ joint-stage passes
        ─> min-cut partition ─ forward / backward graphs ─ partitioned-stage passes
        ─> Inductor (compile_fx), or the eager FX runner

A repeated block reaches the backend as one body called once per layer (``invoke_subgraph``;
NOTE: one body per repeated block, in regions.py). AOTAutograd traces and partitions each body
once (``CompiledGraph.partition`` sees the body's joint graph before the outer one), Inductor
compiles it once, and every collective stays in the outer graphs where the passes act; with
``compile_outside_blocks=False`` those outer graphs then run as Python (NOTE: what Inductor
compiles, in compile_bodies.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

from fsdp_compile.compat import body_schema_once, compile_caches_work
from fsdp_compile.compile_bodies import compile_bodies, holds_bodies
from fsdp_compile.debug import GraphDumper, debug_dir, dump_frames
from fsdp_compile.pipeline import Stage, build_pipeline
from fsdp_compile.plan import BackendOptions, Plan
from fsdp_compile.planner import build_plan

__all__ = ["mfsdp_backend", "MfsdpBackend", "CompiledGraph", "register"]

_PACKAGE = Path(__file__).parent
# What decides the code a graph compiles to: the cache key covers these files and the plan,
# not the bench, the dumps or the docs (editing those must not invalidate users' caches).
_COMPILED_CODE_SOURCES = tuple(
    sorted(
        str(p)
        for p in [*(_PACKAGE / "passes").glob("*.py"), *(_PACKAGE / f for f in (
            "backend.py", "bucket_copies.py", "compat.py", "compile_bodies.py", "float8.py",
            "fx_utils.py", "ops.py", "patterns.py", "pipeline.py", "plan.py", "planner.py",
        ))]
    )
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
        # counters a fresh process hands out alike (fsdp_compile.api).
        return (get_hash_for_files(_COMPILED_CODE_SOURCES), self.graph.plan.cache_key())


def _run_graph(gm: fx.GraphModule, example_inputs: Sequence[object], **_: Any):
    """The eager FX runner: the rewritten graph's generated Python, boxed for AOTAutograd."""
    return make_boxed_func(gm.forward)


class CompiledGraph:
    """One graph Dynamo handed the backend, driven through every stage; it keeps the plan and
    the graph each stage produced, for inspection, dumps and tests."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list, options: BackendOptions) -> None:
        self.plan: Plan = build_plan(gm, example_inputs, options)
        self.pipeline = build_pipeline(self.plan)
        root = debug_dir(options.debug_dir)
        self.dumper = GraphDumper(root, self.plan) if root else None
        if root:
            dump_frames(root)
        self.dynamo: fx.GraphModule = gm
        """Dynamo's graph, after the Dynamo-stage passes."""
        self.joint: fx.GraphModule | None = None
        """AOTAutograd's joint graph after the joint-stage passes (None on a cache hit)."""
        self.bodies: dict[str, tuple[fx.GraphModule, fx.GraphModule]] = {}
        """Each repeated block's body, partitioned once: forward and backward graphs, by the
        order AOTAutograd partitioned them (``body0``, ``body1``...)."""
        self.compiled: dict[str, fx.GraphModule] = {}
        """"forward", "backward", "inference": each graph as compiled, after the
        partitioned-stage passes. AOTAutograd may compile the backward lazily, at the first
        backward; a cache hit compiles nothing, and leaves this empty."""
        self.passes: list[dict] = []
        """Every pass run on this graph's stages, in order: pass, seconds, collectives after."""
        self.seconds: dict[str, float] = defaultdict(float)
        """Time spent in each stage of ours: "passes" (all stages), "partitioner" (min-cut,
        bodies included) and "compiler" (Inductor or the eager runner, per graph)."""
        self._example_inputs = example_inputs

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

    def compile(self) -> Callable:
        """Run the Dynamo stage, then hand the graph to AOTAutograd and the compiler."""
        if self.dumper:
            self.dumper.graph("dynamo", self.dynamo)
        self.dynamo = self._run("dynamo", self.dynamo)
        partitioner = _Partitioner(self)
        with body_schema_once():
            if self.plan.options.compiler == "eager":
                return aot_autograd(
                    fw_compiler=self._with_partitioned_passes(_run_graph, "forward"),
                    bw_compiler=self._with_partitioned_passes(_run_graph, "backward"),
                    inference_compiler=self._with_partitioned_passes(_run_graph, "inference"),
                    partition_fn=partitioner,
                )(self.dynamo, self._example_inputs)
            return self._inductor(partitioner)

    def _inductor(self, partitioner: _Partitioner) -> Callable:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        # With compile_outside_blocks=False a graph of repeated blocks gets its bodies compiled
        # and runs the rest as Python (NOTE: what Inductor compiles, in compile_bodies.py).
        whole = self.plan.options.compile_outside_blocks or not holds_bodies(self.dynamo)

        # NOTE: compile caches. A restart loads what Inductor compiled from its FX graph
        # cache (the bodies; the forward and backward too where Inductor compiled them whole,
        # which AOTAutograd's cache then also serves): our partitioner's uuid keys them (the
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
                self._example_inputs,
                inner_compile=self._with_partitioned_passes(compile_fx_inner if whole else compile_bodies),
                config_patches={
                    "custom_partitioner_fn": partitioner,
                    # Inductor's peak-memory reordering would move each gather down to its
                    # wait and undo the planned prefetch; schedule_collectives bounds memory
                    # instead (see docs/design.md, "The order under Inductor").
                    "reorder_for_peak_memory": False,
                    "fx_graph_cache": cached,
                },
            )

    def partition(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        """A joint graph to (forward, backward). AOTAutograd calls this first for each
        repeated block's body (no joint inputs: the body's own joint graph, which holds no
        collective of ours), then for the outer graph, which gets the joint-stage passes."""
        if not joint_inputs:
            forward, backward = self._partition(gm, joint_inputs, **kwargs)
            name = f"body{len(self.bodies)}"
            self.bodies[name] = (forward, backward)
            if self.dumper:
                self.dumper.graph(f"{name}_forward", forward)
                self.dumper.graph(f"{name}_backward", backward)
            return forward, backward
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


class MfsdpBackend:
    """A Dynamo backend object; ``torch.compile(model, backend=MfsdpBackend(compiler="eager"))``.

    Same as ``backend="mfsdp"`` with ``options``, and it keeps every graph it compiled in
    ``self.graphs`` (plans and the graphs of each stage) for inspection and tests.
    """

    def __init__(self, **options: Any) -> None:
        self.options = BackendOptions.parse(options)
        self.graphs: list[CompiledGraph] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        graph = CompiledGraph(gm, example_inputs, self.options)
        self.graphs.append(graph)
        return graph.compile()


def mfsdp_backend(gm: fx.GraphModule, example_inputs: list, *, options: dict | None = None):
    """``torch.compile(model, backend="mfsdp", options={...})`` lands here once per graph."""
    return MfsdpBackend(**(options or {}))(gm, example_inputs)


def register() -> None:
    """Make ``backend="mfsdp"`` resolve where the package was not installed (the
    ``torch_dynamo_backends`` entry point does it for an installed package); idempotent."""
    from torch._dynamo import list_backends, register_backend

    if "mfsdp" not in list_backends(exclude_tags=()):
        register_backend(name="mfsdp")(mfsdp_backend)
