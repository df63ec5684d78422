"""The ``mfsdp`` Dynamo backend: plan, rewrite, partition, compile.

    Dynamo graph ──dedupe_unshards──> aot_autograd ──joint graph──> lower_collectives -> reshard
        -> min-cut partition ──forward / backward graphs──> Inductor, or the eager FX runner
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

from fsdp_compile.debug import GraphDumper, debug_dir, dump_frames
from fsdp_compile.pipeline import build_pipeline, run_passes
from fsdp_compile.plan import BackendOptions, Plan, build_plan

__all__ = ["mfsdp_backend", "MfsdpBackend", "MfsdpPartitioner", "CompiledGraph"]


class MfsdpPartitioner(CustomPartitionerFn):
    """Runs the joint-graph passes, then AOTAutograd's min-cut partitioner.

    Used as Inductor's ``custom_partitioner_fn`` (after Inductor's own joint passes) and as
    ``aot_autograd``'s ``partition_fn`` for the eager runner, so both compilers partition the
    same rewritten graph.
    """

    def __init__(self, plan: Plan, dumper: GraphDumper | None = None) -> None:
        self.plan = plan
        self.dumper = dumper
        self.pipeline = build_pipeline(plan)
        self.partitioned: tuple[fx.GraphModule, fx.GraphModule] | None = None

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        dump = self.dumper.graph if self.dumper else None
        if dump:
            dump("joint", gm)
        gm = run_passes(gm, self.plan, self.pipeline, "joint", dump)
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.partitioned = (fw, bw)
        return fw, bw

    def uuid(self) -> Any:
        # Compiled artifacts depend on this package's passes and on the plan (groups, sizes).
        sources = tuple(sorted(str(p) for p in Path(__file__).parent.rglob("*.py")))
        return (get_hash_for_files(sources), repr(self.plan))


def _run_graph(gm: fx.GraphModule, example_inputs: Sequence[object], **_: Any):
    """The eager FX runner: the rewritten graph's generated Python, boxed for AOTAutograd."""
    return make_boxed_func(gm.forward)


def _with_partitioned_passes(
    compile_graph, plan: Plan, dumper: GraphDumper | None, compiled: dict, role=None
):
    """Wrap a graph compiler so the "partitioned" stage runs on every graph it receives:
    forward and backward after partitioning, and the single graph of inference calls
    (which AOTAutograd compiles without a partitioner). ``role`` names the graph for dumps;
    None reads it from Inductor's ``is_backward`` / ``is_inference`` arguments. Each graph,
    after its passes, is kept in ``compiled[role]`` (AOTAutograd compiles a copy of the
    partitioner's backward, so the partitioner's own is not what runs)."""
    pipeline = build_pipeline(plan)

    def compile_with_passes(gm: fx.GraphModule, example_inputs: Sequence[object], **kwargs: Any):
        gm = run_passes(gm, plan, pipeline, "partitioned")
        graph_role = role or (
            "backward" if kwargs.get("is_backward") else
            "inference" if kwargs.get("is_inference") else "forward"
        )
        compiled[graph_role] = gm
        if dumper is not None:
            dumper.compiled(graph_role, gm)
        return compile_graph(gm, example_inputs, **kwargs)

    return compile_with_passes


@dataclass
class CompiledGraph:
    """One graph the backend compiled: its plan and the graphs each stage produced."""

    plan: Plan
    dynamo: fx.GraphModule
    """The Dynamo graph after the Dynamo-stage passes."""
    partitioner: MfsdpPartitioner
    compiled: dict[str, fx.GraphModule]
    """"forward", "backward", "inference": each graph as compiled, after the partitioned-stage
    passes (bucketing, scheduling)."""

    @property
    def forward(self) -> fx.GraphModule:
        """The partitioned forward graph as compiled (once the graph has been compiled)."""
        return self.compiled.get("forward", self.partitioner.partitioned[0])

    @property
    def backward(self) -> fx.GraphModule:
        """The backward graph as compiled (once backward has run: AOTAutograd may compile it
        lazily); until then the partitioner's, before the partitioned-stage passes."""
        return self.compiled.get("backward", self.partitioner.partitioned[1])


class MfsdpBackend:
    """A Dynamo backend object; ``torch.compile(model, backend=MfsdpBackend(compiler="eager"))``.

    Same as ``backend="mfsdp"`` with ``options``, and it keeps every graph it compiled in
    ``self.graphs`` (plans and partitioned graphs) for inspection and tests.
    """

    def __init__(self, **options: Any) -> None:
        self.options = BackendOptions.parse(options)
        self.graphs: list[CompiledGraph] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        plan = build_plan(gm, example_inputs, self.options)
        root = debug_dir(self.options.debug_dir)
        dumper = GraphDumper(root, plan) if root else None
        if dumper:
            dump_frames(root)
            dumper.graph("dynamo", gm)
        gm = run_passes(gm, plan, build_pipeline(plan), "dynamo", dumper and dumper.graph)
        partitioner = MfsdpPartitioner(plan, dumper)
        graphs: dict[str, fx.GraphModule] = {}
        self.graphs.append(CompiledGraph(plan, gm, partitioner, graphs))
        if self.options.compiler == "eager":
            compiled = aot_autograd(
                fw_compiler=_with_partitioned_passes(_run_graph, plan, dumper, graphs, "forward"),
                bw_compiler=_with_partitioned_passes(_run_graph, plan, dumper, graphs, "backward"),
                inference_compiler=_with_partitioned_passes(
                    _run_graph, plan, dumper, graphs, "inference"
                ),
                partition_fn=partitioner,
            )
            return compiled(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        return compile_fx(
            gm,
            example_inputs,
            inner_compile=_with_partitioned_passes(compile_fx_inner, plan, dumper, graphs),
            # Inductor's peak-memory reordering would move each gather down to its wait and
            # undo the planned prefetch; schedule_collectives bounds memory instead (see
            # docs/design.md, "The order under Inductor").
            config_patches={"custom_partitioner_fn": partitioner, "reorder_for_peak_memory": False},
        )


def mfsdp_backend(gm: fx.GraphModule, example_inputs: list, *, options: dict | None = None):
    """``torch.compile(model, backend="mfsdp", options={...})`` lands here once per graph."""
    return MfsdpBackend(**(options or {}))(gm, example_inputs)


def _register() -> None:
    """Make ``backend="mfsdp"`` resolve once ``fsdp_compile`` is imported.

    When Dynamo itself imports this package through the ``torch_dynamo_backends`` entry point,
    it registers the name right after the import, so registering here too would be a duplicate.
    """
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    loading_entry_point = _BACKENDS.get("mfsdp") is not None
    if "mfsdp" not in _COMPILER_FNS and not loading_entry_point:
        register_backend(name="mfsdp")(mfsdp_backend)
