"""The plan: every decision the passes act on, made once per compiled graph and frozen.

Data only: ``fsdp_compile.planner`` builds it from a Dynamo graph and the parameters'
sharding records.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch

from fsdp_compile.records import ShardInfo
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.markers import GATHERING_STRATEGIES, SCATTERING_STRATEGIES, GradReduceOp

__all__ = ["BackendOptions", "BucketPlan", "ParamPlan", "Plan", "dtype_name"]

Compiler = Literal["inductor", "eager"]


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """What ``torch.compile(..., backend="mfsdp", options={...})`` accepts."""

    compiler: Compiler = "inductor"
    """"inductor" generates kernels; "eager" runs the rewritten FX graphs as Python (debugging, CPU tests)."""
    cuda_graph: bool = False
    """Refuse, at compile time, anything a CUDA graph cannot capture (see docs/cuda_graphs.md)."""
    debug_dir: str | None = None
    """Write per-graph dumps here (see fsdp_compile.debug); $MFSDP_DEBUG_DIR does the same."""
    bucketing: bool = True
    """One all-gather and one reduce-scatter per bucket (NOTE: bucket rules, in fsdp_compile/planner.py); False: per parameter."""
    bucket_mb: float | None = None
    """Cap on a bucket's gathered size in MiB; None: a whole unit (or block) per bucket."""
    prefetch: int = 1
    """Buckets whose all-gather is issued before the current bucket's compute starts; 0: none."""
    max_inflight_bytes: int | None = None
    """Bound on gathered bytes alive at once; prefetch is shortened to keep under it. None: no bound."""
    regional: bool = True
    """Compile each repeated block's body once, as a frame of its own called by one op per
    layer (fsdp_compile/regions.py, block_call.py); False: trace every layer inline and
    compile the whole graph (compile time grows with depth; Inductor may fuse across blocks)."""
    compile_outside_blocks: bool = True
    """With ``regional`` and Inductor: Inductor compiles the step's graphs too (embedding,
    final norm, head, loss, the collectives and their copies around the blocks' calls), which
    may fuse that code and lets a restart load them from the AOTAutograd cache; False: only
    the blocks' bodies are compiled and the step's graphs run as Python, as FSDP2 runs a
    compiled model's root (NOTE: what Inductor compiles, in fsdp_compile/backend.py). A graph
    without repeated blocks is compiled whole either way."""
    gather_whole_members: bool = False
    """Gather each repeated block's flat member by member, each whole in one buffer, so the
    block reads views of it: no copy-out after the gather (NOTE: members gathered whole, in
    fsdp_compile/whole_gathers.py). Off by default until measured on GPUs."""
    compile_cache: bool = True
    """Read and write torch's AOTAutograd and Inductor caches (a restart loads the compiled
    graphs instead of compiling them); False, or a ``debug_dir``: compile afresh, so every
    stage's graph exists to be dumped and inspected."""
    mode: str | None = None
    """``torch.compile``'s ``mode`` ("max-autotune", ...): its Inductor settings for every graph
    Inductor compiles, bodies included, but Inductor's CUDA graphs: mfsdp captures a whole step
    in one (``capture_step``; NOTE: torch.compile's mode, in fsdp_compile/backend.py)."""

    @classmethod
    def parse(cls, options: dict | None) -> BackendOptions:
        options = dict(options or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise CompileUsageError(
                f"unknown mfsdp option(s) {unknown}; the backend accepts {sorted(known)}."
            )
        compiler = options.get("compiler", cls.compiler)
        if compiler not in ("inductor", "eager"):
            raise CompileUsageError(
                f"options['compiler'] must be 'inductor' or 'eager', got {compiler!r}."
            )
        if not isinstance(options.get("debug_dir") or "", (str, os.PathLike)):
            raise CompileUsageError(
                f"options['debug_dir'] must be a path, got {options['debug_dir']!r}."
            )
        if options.get("debug_dir") is not None:
            options["debug_dir"] = os.fspath(options["debug_dir"])
        if not isinstance(options.get("cuda_graph", False), bool):
            raise CompileUsageError(
                f"options['cuda_graph'] must be True or False, got {options['cuda_graph']!r}."
            )
        _check_schedule_options(options)
        if options.get("mode") is not None:
            _check_mode(options["mode"], compiler)
        return cls(**options)

    @property
    def inductor_config(self) -> dict:
        """Inductor's settings for ``mode`` (NOTE: torch.compile's mode)."""
        from torch._inductor import list_mode_options

        settings = list_mode_options(self.mode) if self.mode is not None else {}
        return {name: value for name, value in settings.items() if name != _CUDA_GRAPHS}

    @property
    def bucket_cap_bytes(self) -> int | None:
        return None if self.bucket_mb is None else int(self.bucket_mb * 2**20)


def _check_schedule_options(options: dict) -> None:
    for flag in ("bucketing", "regional", "compile_outside_blocks", "gather_whole_members", "compile_cache"):
        if not isinstance(options.get(flag, True), bool):
            raise CompileUsageError(f"options[{flag!r}] must be True or False, got {options[flag]!r}.")
    checks = {
        "bucket_mb": (lambda v: v is None or (_is_number(v) and v > 0), "a positive number of MiB or None"),
        "prefetch": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
        "max_inflight_bytes": (
            lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
            "a positive int (bytes) or None",
        ),
    }
    for name, (valid, expected) in checks.items():
        if name in options and not valid(options[name]):
            raise CompileUsageError(f"options[{name!r}] must be {expected}, got {options[name]!r}.")


_CUDA_GRAPHS = "triton.cudagraphs"
"""The one Inductor setting of a mode mfsdp leaves out (NOTE: torch.compile's mode)."""


def _check_mode(mode: object, compiler: str) -> None:
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    if mode not in modes:
        raise CompileUsageError(f"mode must be one of {sorted(modes)}, got {mode!r}.")
    if compiler == "eager" and mode != "default":
        raise CompileUsageError(
            f"mode={mode!r} sets how Inductor compiles, and options['compiler'] is 'eager', which "
            "compiles nothing with Inductor: drop one of them."
        )
    if modes[mode].get(_CUDA_GRAPHS):
        applied = [name for name in modes[mode] if name != _CUDA_GRAPHS]
        warnings.warn(
            f"mode={mode!r}: mfsdp applies its Inductor settings ({', '.join(applied) or 'none'}) "
            "but not its CUDA graphs, which would be one per graph, split at the collectives; "
            "capture the whole step in one CUDA graph with fsdp_compile.capture_step(train_step, "
            "...) (docs/cuda_graphs.md).",
            stacklevel=2,
        )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class ParamPlan:
    """One sharded parameter as this graph reads it: the record ``fully_shard`` left on the
    parameter (``sharding``, the same object, not a copy) and what the graph adds to it."""

    sharding: ShardInfo
    """What ``fully_shard`` decided: owner unit, groups, strategy, dtypes, float8."""
    fqn: str
    """Attribute path this graph reads it from (Dynamo's source name)."""
    shard_rows: int
    """Rows this rank holds (dim 0); may be 0 when dim 0 is smaller than the world."""
    dtype: torch.dtype
    """Storage dtype: of the shard, the optimizer state and ``.grad``."""
    rank: int
    """This rank's index in the shard group (``optim`` keeps these rows of the all-reduced gradient)."""
    requires_grad: bool
    """False for frozen parameters: gathered, never reduce-scattered."""
    reduce_op: GradReduceOp = "sum"
    """How its gradient's collectives reduce: "avg", or "sum" and a division by ``grad_divisor`` (``markers.gradient_reduce_op``)."""

    @property
    def param_id(self) -> int:
        """Key the graph's markers carry for this parameter."""
        return self.sharding.param_id

    @property
    def gathers(self) -> bool:
        """Stored sharded and all-gathered for use (all strategies but ``no_shard``)."""
        return self.sharding.strategy in GATHERING_STRATEGIES

    @property
    def scatters(self) -> bool:
        """Gradient reduce-scattered (ZeRO-2/3); else all-reduced."""
        return self.sharding.strategy in SCATTERING_STRATEGIES

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype its all-gather moves: float8 for a float8 weight (see NOTE: float8
        gathers, in fsdp_compile/float8.py), else ``param_dtype``."""
        float8 = self.sharding.float8
        return float8.dtype if float8 is not None else self.sharding.param_dtype

    @property
    def padded_rows(self) -> int:
        return -(-self.sharding.global_shape[0] // self.sharding.world)

    @property
    def gathered_bytes(self) -> int:
        numel = self.padded_rows * self.sharding.world
        for size in self.sharding.global_shape[1:]:
            numel *= size
        return numel * self.wire_dtype.itemsize

    def to_dict(self) -> dict:
        """The flat record ``plan.json`` holds (fsdp_compile/schemas/plan.schema.json)."""
        s = self.sharding
        return {
            "param_id": s.param_id,
            "fqn": self.fqn,
            "unit": s.unit,
            "global_shape": list(s.global_shape),
            "shard_rows": self.shard_rows,
            "dtype": dtype_name(self.dtype),
            "param_dtype": dtype_name(s.param_dtype),
            "reduce_dtype": dtype_name(s.reduce_dtype),
            "float8_dtype": dtype_name(s.float8.dtype) if s.float8 is not None else "",
            "strategy": s.strategy,
            "group_name": s.group_name,
            "world": s.world,
            "rank": self.rank,
            "replicate_group_name": s.replicate_group_name,
            "replicate_world": s.replicate_world,
            "grad_divisor": s.grad_divisor,
            "requires_grad": self.requires_grad,
            "reduce_op": self.reduce_op,
            "reshard_after_forward": s.reshard_after_forward,
            "members": list(s.members),
        }


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """One all-gather (and, for its trainable members, one reduce-scatter) per graph; which
    parameters it groups: NOTE: bucket rules, in fsdp_compile/planner.py."""

    index: int
    """Position in the forward's first-read order; the key graphs tag their collectives with."""
    name: str
    """The members' common module path (``layers.3``), or ``<root>`` when they share none."""
    param_ids: tuple[int, ...]
    """Members, in first-read order; their shards lie in this order in the bucket buffer."""
    group_name: str
    reshard_after_forward: bool
    """Freed after forward and gathered again in backward; False: kept gathered from its
    forward use to its backward use (see NOTE: the reshard default, in fsdp_compile/api.py)."""
    param_dtype: torch.dtype
    """Dtype of the all-gather: the members' wire dtype, or ``uint8`` when float8 weights
    and others share it (each member's bytes packed as they are)."""
    reduce_dtype: torch.dtype
    """Dtype of the reduce-scatter."""
    gathered_bytes: int
    """Bytes of the gathered bucket (padded rows of every member, all ranks)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything the passes decide from: read-only once built."""

    graph_name: str
    """Dynamo's name for the frame's graph (several when the model has graph breaks)."""
    options: BackendOptions
    """Backend options this graph was compiled with."""
    params: tuple[ParamPlan, ...] = field(default=())
    """Sharded parameters the graph reads, in placeholder order."""
    buckets: tuple[BucketPlan, ...] = field(default=())
    """Parameters grouped per collective, in the forward's first-read order (``plan_buckets``)."""
    gathered_inputs: tuple[int, ...] = field(default=())
    """A repeated block's body (NOTE: one op per block call, in fsdp_compile/block_call.py):
    the positions of its joint graph's inputs that are gathered weights (a float8 weight's
    data and scale each), which ``reshard`` keeps the body from saving in any other form than
    as the input itself."""
    ranks_in_step: bool = True
    """Every rank compiles this graph at the same call: its backend's first compile of the
    frame in its grad mode, which every rank makes when the step first runs and at the first
    evaluation under ``torch.no_grad()``. A recompile for new shapes may be one rank's alone
    (its batch padded to a longer sequence, a shorter last batch), while the others run their
    graphs: it must not add a collective of its own (NOTE: the rank check runs where the
    ranks compile together, in check_rank_agreement.py)."""

    # Passes look a parameter up per marker node: dicts, built on first use (the dataclass
    # is frozen, so they cannot go stale).
    @functools.cached_property
    def _params_by_id(self) -> dict[int, ParamPlan]:
        return {p.param_id: p for p in self.params}

    @functools.cached_property
    def _buckets_by_param(self) -> dict[int, BucketPlan]:
        return {i: bucket for bucket in self.buckets for i in bucket.param_ids}

    def bucket_of(self, param_id: int) -> BucketPlan:
        try:
            return self._buckets_by_param[param_id]
        except KeyError:
            raise KeyError(f"parameter {param_id} is in no bucket of plan {self.graph_name}") from None

    def param(self, param_id: int) -> ParamPlan:
        try:
            return self._params_by_id[param_id]
        except KeyError:
            raise KeyError(f"no parameter with param_id={param_id} in plan {self.graph_name}") from None

    @property
    def trainable(self) -> tuple[ParamPlan, ...]:
        return tuple(p for p in self.params if p.requires_grad)

    @property
    def tensor_parallel_groups(self) -> frozenset[str]:
        """The groups tensor parallelism placed the graph's parameters on: the collectives
        DTensor traced into the graph on them are tensor parallelism's, not ours."""
        reads = (p.sharding.tensor_parallel for p in self.params)
        return frozenset(read.group_name for read in reads if read is not None)

    def to_json(self) -> str:
        record = {
            "graph_name": self.graph_name,
            "options": asdict(self.options),
            "params": [p.to_dict() for p in self.params],
            "buckets": [asdict(b) for b in self.buckets],
            "gathered_inputs": list(self.gathered_inputs),
            "ranks_in_step": self.ranks_in_step,
        }
        return json.dumps(record, indent=2, default=dtype_name)

    def cache_key(self) -> str:
        """What of the plan decides the compiled code: everything but where dumps go. The rank
        stays in: the compiled backward returns this rank's ``DeviceMesh`` (its coordinates
        included) as a constant for the DTensor gradients, so one rank must never load
        another's graphs, however alike their shards."""
        return repr(replace(self, options=replace(self.options, debug_dir=None)))


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how dumps and reports write a dtype."""
    return str(dtype).removeprefix("torch.")
