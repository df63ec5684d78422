"""``explain(model, *example_inputs)``: a short account of what mfsdp does to a model."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_compile.records import shard_info
from fsdp_compile.backend import CompiledGraph, MfsdpBackend
from fsdp_compile.cost_model import NVLINK_GPU, Hardware, collective_schedule, estimate_timeline, with_bodies

__all__ = ["explain", "Explanation"]


@dataclass(frozen=True, kw_only=True)
class Explanation:
    """What ``explain`` found; ``str()`` is the printed summary."""

    managed: int
    """Sharded parameters (tied ones counted once)."""
    managed_bytes: int
    excluded: dict[str, str]
    """Parameter name -> why it is not sharded like the rest (frozen, tied, not managed)."""
    buckets: int
    """Buckets in the plans (one all-gather, and one reduce-scatter, each per graph)."""
    collectives: dict[str, int]
    """Per training step, by graph and kind, e.g. {"forward all_gather": 31, ...}: every
    collective but tensor parallelism's (ours over the data-parallel mesh, and the user's)."""
    bytes_per_step: dict[str, int]
    groups: dict[str, int]
    """The groups ``collectives`` run on -> their ranks."""
    tensor_parallel: dict[str, int]
    """The collectives DTensor traced for tensor-parallel layers, per training step, by graph
    and kind (on ``tensor_parallel_groups``); empty without tensor parallelism."""
    tensor_parallel_bytes: dict[str, int]
    tensor_parallel_groups: dict[str, int]
    """The tensor-parallel groups -> their ranks."""
    step_seconds: float
    exposed_comm_seconds: float
    exposed_tensor_parallel_seconds: float
    """The part of ``exposed_comm_seconds`` spent waiting on tensor-parallel collectives."""
    hardware: Hardware
    graphs: int

    def __str__(self) -> str:
        lines = [
            f"mfsdp: {self.managed} sharded parameters, {self.managed_bytes / 2**20:.2f} MiB "
            f"unsharded, in {self.graphs} compiled graph(s)",
        ]
        if self.excluded:
            lines.append("special parameters:")
            lines += [f"  {name}: {why}" for name, why in sorted(self.excluded.items())]
        lines.append(f"buckets: {self.buckets}")
        lines += _listing("collectives per step", self.collectives, self.bytes_per_step, self.groups)
        if self.tensor_parallel:
            lines += _listing(
                "tensor-parallel collectives per step",
                self.tensor_parallel, self.tensor_parallel_bytes, self.tensor_parallel_groups,
            )
        exposed = self.exposed_comm_seconds / max(self.step_seconds, 1e-12)
        lines.append(
            f"estimated step on {self.hardware.name}: {self.step_seconds * 1e3:.3f} ms, "
            f"exposed communication {self.exposed_comm_seconds * 1e3:.3f} ms ({exposed:.0%})"
            + (f", {self.exposed_tensor_parallel_seconds * 1e3:.3f} ms of it tensor-parallel" if self.tensor_parallel else "")
        )
        return "\n".join(lines)


def _listing(title: str, counts: dict[str, int], moved: dict[str, int], groups: dict[str, int]) -> list[str]:
    """``title``, the groups the collectives run on, then one line per graph and kind."""
    on = ", ".join(f"{name} ({world} ranks)" for name, world in sorted(groups.items()))
    lines = [f"{title}" + (f", on group{'s' if len(groups) > 1 else ''} {on}:" if groups else ":")]
    return lines + [
        f"  {kind}: {count} ({moved.get(kind, 0) / 2**20:.2f} MiB)" for kind, count in sorted(counts.items())
    ]


def _special_parameters(model: nn.Module) -> dict[str, str]:
    names = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append((name, param))
    special = {}
    for entries in names.values():
        name, param = entries[0]
        if shard_info(param) is None:
            special[name] = "not sharded: fully_shard was not called on its module"
        elif not param.requires_grad:
            special[name] = "frozen: gathered in forward, never reduce-scattered"
        if len(entries) > 1:
            others = ", ".join(n for n, _ in entries[1:])
            special[name] = f"tied with {others}: sharded once, one gather, gradients summed"
    return special


# Explanation's fields for the collectives that are not tensor parallelism's, and for those.
_TALLIES = {
    False: ("collectives", "bytes_per_step", "groups"),
    True: ("tensor_parallel", "tensor_parallel_bytes", "tensor_parallel_groups"),
}


def _tally(graphs: list[CompiledGraph]) -> dict[str, dict]:
    """Count, bytes and groups of the training graphs' collectives, tensor parallelism's (on
    a group its parameters were placed on) apart from the others (``_TALLIES``)."""
    tallies = {name: defaultdict(int) for names in _TALLIES.values() for name in names}
    for graph in graphs:
        if "backward" not in graph.compiled:
            continue  # a graph without gradients (inference): no backward to count
        for role, gm in (("forward", graph.forward), ("backward", graph.backward)):
            # A block's own collectives are its compiled body's, once per call.
            for c in (c for g in with_bodies(gm) for c in collective_schedule(g, graph.plan, role)):
                counts, moved, groups = (tallies[n] for n in _TALLIES[c.group in graph.plan.tensor_parallel_groups])
                counts[f"{role} {c.kind}"] += 1
                moved[f"{role} {c.kind}"] += c.bytes
                groups[c.group] = c.world
    return {name: dict(tally) for name, tally in tallies.items()}


def explain(
    model: nn.Module, *example_inputs, hardware: Hardware = NVLINK_GPU, **options
) -> Explanation:
    """Compile ``model`` with mfsdp (eager compiler), run one forward, and summarise.

    The forward runs real all-gathers: call it on every rank, like any collective. Estimates
    use the cost model of ``fsdp_compile.cost_model`` for ``hardware``. Under tensor
    parallelism the collectives DTensor traced on the "tp" group are listed, and timed, apart
    from the rest.
    """
    backend = MfsdpBackend(compiler="eager", **options)
    # Compile the backward now, with its passes (AOTAutograd otherwise waits for a backward).
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        torch.compile(model, backend=backend)(*example_inputs)
    tallies = _tally(backend.graphs)
    step = exposed = exposed_tp = 0.0
    params, buckets = {}, 0
    for graph in backend.graphs:
        buckets += len(graph.plan.buckets)
        params.update({p.param_id: p for p in graph.plan.params})
        if "backward" not in graph.compiled:
            continue  # a graph without gradients (inference): no backward to count
        for role, gm in (("forward", graph.forward), ("backward", graph.backward)):
            timeline = estimate_timeline(gm, role, hardware)
            step += timeline.step_seconds
            exposed += timeline.exposed_comm_seconds
            exposed_tp += sum(timeline.exposed_by_group.get(g, 0.0) for g in graph.plan.tensor_parallel_groups)
    # A repeated block's parameters are read as one flat parameter (NOTE: flat parameters, in
    # flat_params.py): the parameters the graphs read are its members.
    managed = [
        p for p in dict.fromkeys(model.parameters())
        if shard_info(p) is not None and shard_info(getattr(p, "_mfsdp_flat", p)).param_id in params
    ]
    managed_bytes = sum(torch.Size(shard_info(p).global_shape).numel() * p.dtype.itemsize for p in managed)
    return Explanation(
        managed=len(managed),
        managed_bytes=managed_bytes,
        excluded=_special_parameters(model),
        buckets=buckets,
        **tallies,
        step_seconds=step,
        exposed_comm_seconds=exposed,
        exposed_tensor_parallel_seconds=exposed_tp,
        hardware=hardware,
        graphs=len(backend.graphs),
    )
