"""The plan: every decision the passes act on, made once per compiled graph and frozen."""

from __future__ import annotations

import json
import re
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch
from torch import fx, nn
from torch.distributed.distributed_c10d import _resolve_process_group

from fsdp_compile.api import shard_info
from fsdp_compile.buckets import BucketPlan, plan_buckets
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.ops import GATHERING_STRATEGIES, SCATTERING_STRATEGIES
from fsdp_compile.patterns import is_unshard, marker_param_id

__all__ = ["ParamPlan", "Plan", "BackendOptions", "build_plan"]

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
    """One all-gather and one reduce-scatter per bucket (see fsdp_compile.buckets); False: per parameter."""
    bucket_mb: float | None = None
    """Cap on a bucket's gathered size in MiB; None: a whole unit (or block) per bucket."""
    prefetch: int = 1
    """Buckets whose all-gather is issued before the current bucket's compute starts; 0: none."""
    max_inflight_bytes: int | None = None
    """Bound on gathered bytes alive at once; prefetch is shortened to keep under it. None: no bound."""
    regional: bool = True
    """Compile each repeated block's body once (fsdp_compile/regions.py); False: inline every
    body and compile the whole graph (slower to compile, may fuse across blocks)."""
    compile_cache: bool = True
    """Read and write torch's AOTAutograd and Inductor caches (a restart loads the compiled
    graphs instead of compiling them); False, or a ``debug_dir``: compile afresh, so every
    stage's graph exists to be dumped and inspected."""

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
        return cls(**options)

    @property
    def bucket_cap_bytes(self) -> int | None:
        return None if self.bucket_mb is None else int(self.bucket_mb * 2**20)


def _check_schedule_options(options: dict) -> None:
    for flag in ("bucketing", "regional", "compile_cache"):
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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class ParamPlan:
    """One sharded parameter as this graph uses it."""

    param_id: int
    """Key the graph's markers carry for this parameter."""
    fqn: str
    """Attribute path the graph reads it from (Dynamo's source name)."""
    unit: str
    """The fully_shard call that owns it."""
    global_shape: tuple[int, ...]
    """Unsharded shape."""
    shard_rows: int
    """Rows this rank holds (dim 0); may be 0 when dim 0 is smaller than the world."""
    dtype: str
    """Storage dtype: of the shard, the optimizer state and ``.grad``."""
    param_dtype: str
    """Dtype on the wire and in the compute (mixed precision)."""
    reduce_dtype: str
    """Dtype of the gradient reduce-scatter."""
    float8_dtype: str = ""
    """A float8 weight's gather dtype (see NOTE: float8 gathers, in fsdp_compile/float8.py);
    "" for every other parameter."""
    strategy: str
    """Sharding strategy (``fully_shard(strategy=...)``): decides the collectives."""
    group_name: str
    """Process group of its all-gather and gradient reduction (the mesh's shard dimension)."""
    world: int
    """Ranks in that group."""
    rank: int
    """This rank's index in that group (``optim`` keeps these rows of the all-reduced gradient)."""
    replicate_group_name: str
    """HSDP: group the reduced gradient is then all-reduced over; "" without one."""
    replicate_world: int
    """Ranks in the replicate group (1 without one)."""
    grad_divisor: int
    """The summed gradient is divided by this: ``world * replicate_world``, or for expert
    parameters (reduced over edp) the whole data-parallel world."""
    requires_grad: bool
    """False for frozen parameters: gathered, never reduce-scattered."""
    reshard_after_forward: bool
    """True: the backward gathers again; False: the forward saves the gathered tensor."""

    @property
    def gathers(self) -> bool:
        """Stored sharded and all-gathered for use (all strategies but ``no_shard``)."""
        return self.strategy in GATHERING_STRATEGIES

    @property
    def scatters(self) -> bool:
        """Gradient reduce-scattered (ZeRO-2/3); else all-reduced."""
        return self.strategy in SCATTERING_STRATEGIES

    @property
    def wire_dtype(self) -> str:
        """The dtype its all-gather moves: float8 for a float8 weight, else ``param_dtype``."""
        return self.float8_dtype or self.param_dtype

    @property
    def padded_rows(self) -> int:
        return -(-self.global_shape[0] // self.world)

    @property
    def gathered_bytes(self) -> int:
        numel = self.padded_rows * self.world
        for size in self.global_shape[1:]:
            numel *= size
        return numel * getattr(torch, self.wire_dtype).itemsize


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
    """Parameters grouped per collective, in the forward's first-read order (fsdp_compile.buckets)."""

    def bucket_of(self, param_id: int) -> BucketPlan:
        for bucket in self.buckets:
            if param_id in bucket.param_ids:
                return bucket
        raise KeyError(f"parameter {param_id} is in no bucket of plan {self.graph_name}")

    def param(self, param_id: int) -> ParamPlan:
        for param in self.params:
            if param.param_id == param_id:
                return param
        raise KeyError(f"no parameter with param_id={param_id} in plan {self.graph_name}")

    @property
    def trainable(self) -> tuple[ParamPlan, ...]:
        return tuple(p for p in self.params if p.requires_grad)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def cache_key(self) -> str:
        """What of the plan decides the compiled code: everything but where dumps go. The rank
        stays in: the compiled backward returns this rank's ``DeviceMesh`` (its coordinates
        included) as a constant for the DTensor gradients, so one rank must never load
        another's graphs, however alike their shards."""
        return repr(replace(self, options=replace(self.options, debug_dir=None)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _source_name(node: fx.Node) -> str:
    """The parameter's dotted path, e.g. ``layers.0.attn.wqkv.weight``.

    Dynamo's source reads ``L['self']._modules['layers']._modules['0']..._parameters['weight']``;
    the quoted keys after the root are the path.
    """
    grapharg = node.meta.get("grapharg")
    if grapharg is None:
        return node.name
    keys = re.findall(r"\['([^']+)'\]", grapharg.source.name)
    return ".".join(keys[1:]) if len(keys) > 1 else grapharg.source.name


def build_plan(gm: fx.GraphModule, example_inputs: list, options: BackendOptions) -> Plan:
    """Read the sharded parameters a Dynamo graph takes as inputs into a ``Plan``.

    Raises ``CompileUsageError`` for a plain ``nn.Parameter`` among the inputs: the model (or
    part of it) was never given to ``fully_shard``, and running it would silently train an
    unsharded replica per rank.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = []
    for node, value in zip(placeholders, example_inputs):
        info = shard_info(value)
        if info is None:
            if isinstance(value, nn.Parameter):
                raise CompileUsageError(
                    f"parameter {_source_name(node)} was not sharded: call "
                    "fsdp_compile.fully_shard(model) before torch.compile(model, backend='mfsdp')."
                )
            continue
        local = value.to_local()
        params.append(
            ParamPlan(
                param_id=info.param_id,
                fqn=_source_name(node),
                unit=info.unit,
                global_shape=info.global_shape,
                shard_rows=local.shape[0],
                dtype=_dtype_name(local.dtype),
                param_dtype=_dtype_name(info.param_dtype),
                reduce_dtype=_dtype_name(info.reduce_dtype),
                float8_dtype=_dtype_name(info.float8.dtype) if info.float8 else "",
                strategy=info.strategy,
                group_name=info.group_name,
                world=info.world,
                rank=_resolve_process_group(info.group_name).rank(),
                replicate_group_name=info.replicate_group_name,
                replicate_world=info.replicate_world,
                grad_divisor=info.grad_divisor,
                requires_grad=value.requires_grad,
                reshard_after_forward=info.reshard_after_forward,
            )
        )
    graph_name = gm.meta.get("dynamo_compile_id", None) or getattr(gm, "_mfsdp_name", "graph")
    read_order = [marker_param_id(n) for n in gm.graph.nodes if is_unshard(n)]
    buckets = plan_buckets(
        params, read_order, enabled=options.bucketing, cap_bytes=options.bucket_cap_bytes
    )
    return Plan(graph_name=str(graph_name), options=options, params=tuple(params), buckets=buckets)
