"""fsdp_compile: fully sharded data parallelism done by the compiler.

``fully_shard(model)`` shards parameters as DTensors; ``torch.compile(model, backend="mfsdp")``
places the all-gathers and reduce-scatters on the traced graph.
"""

from fsdp_compile.api import fully_shard
from fsdp_compile.accumulation import set_requires_gradient_sync
from fsdp_compile.records import MixedPrecision, gathered_params, is_fully_sharded, shard_info
from fsdp_compile.capture import CapturedStep, capture_step
from fsdp_compile.clip import clip_grad_norm_
from fsdp_compile.backend import CompiledGraph, MfsdpBackend, mfsdp_backend, register
from fsdp_compile.errors import UsageError
from fsdp_compile.expert_parallel import expert_mesh
from fsdp_compile.explain import Explanation, explain
from fsdp_compile.cost_model import Hardware
from fsdp_compile.plan import BackendOptions, Plan

__all__ = [
    "fully_shard",
    "MixedPrecision",
    "set_requires_gradient_sync",
    "is_fully_sharded",
    "shard_info",
    "gathered_params",
    "expert_mesh",
    "clip_grad_norm_",
    "mfsdp_backend",
    "register",
    "capture_step",
    "CapturedStep",
    "MfsdpBackend",
    "CompiledGraph",
    "BackendOptions",
    "Plan",
    "UsageError",
    "explain",
    "Explanation",
    "Hardware",
]
