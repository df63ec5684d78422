"""torch FSDP2's ``FSDPModule`` methods on the modules ``fully_shard`` returned.

A script moving from FSDP2 calls them (``model.set_requires_gradient_sync(False)`` in an
accumulation loop, ``model.unshard()`` before generating, ``set_modules_to_forward_prefetch``).
Each name does here what it means here, or raises one ``UsageError`` saying what mfsdp does
instead and what to call, in place of ``nn.Module``'s bare ``AttributeError``:

- ``set_requires_gradient_sync`` and ``reset_iter_state`` (in accumulation.py, beside the
  accumulation state they change) do what FSDP2's do.
- ``set_is_last_backward`` and ``set_unshard_in_backward`` take a bool and change nothing: each
  compiled backward finishes its own reductions, and gathers a parameter only where its
  backward reads it, which is what FSDP2 is told by these.
- Every other ``FSDPModule`` method raises (``MESSAGES`` says why each).
"""

from __future__ import annotations

from torch import nn

from fsdp_compile.errors import UsageError

__all__ = ["FSDP2_METHODS", "MESSAGES"]

_DECIDED_AT_FULLY_SHARD = (
    "mfsdp decides it at fully_shard, before the step is compiled: pass "
    "fully_shard(model, reshard_after_forward=...)"
)
_SCHEDULED = (
    "the backend schedules every gather of the step itself, prefetching across blocks: "
    "torch.compile(model, backend=fsdp_compile.MfsdpBackend(prefetch=N, bucket_mb=...)) sets "
    "how far ahead and how much at once (docs/user_guide.md, the backend's options)"
)
_AVERAGED = (
    "mfsdp averages each gradient over the mesh, as FSDP2 does by default; for another scale, "
    "scale the loss"
)
_OWN_COLLECTIVES = (
    "mfsdp lowers gathers and reductions to torch's functional collectives inside the compiled "
    "step, on the mesh fully_shard got; it takes no custom collective, buffer allocator or group"
)

MESSAGES = {
    "unshard": (
        "mfsdp gathers each parameter where a forward or backward reads it and frees it as the "
        "strategy and reshard_after_forward say; outside a module's call a read returns the "
        "sharded parameter. For the full weights, param.full_tensor() or "
        "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))"
    ),
    "reshard": "mfsdp holds no gathered parameter between calls: there is nothing to free",
    "set_reshard_after_forward": _DECIDED_AT_FULLY_SHARD,
    "set_reshard_after_backward": (
        "mfsdp frees what a backward gathered when that backward ends and gathers again at the "
        "next forward, micro-batches included; to keep parameters from each forward to the end "
        "of its backward, fully_shard(model, strategy='optim_grads') (or "
        "reshard_after_forward=False), and to keep them whole between calls, "
        "strategy='no_shard' (gradients and optimizer state whole too)"
    ),
    "set_requires_all_reduce": (
        "mfsdp has no reduce-scatter-only accumulation: under HSDP, "
        "set_requires_gradient_sync(False) skips every reduction of the micro-batches before "
        "the last, the replicas' all-reduce too, and holds one full-size gradient per parameter "
        "meanwhile (FSDP2's set_requires_all_reduce(False) holds a shard)"
    ),
    "set_modules_to_forward_prefetch": _SCHEDULED,
    "set_modules_to_backward_prefetch": _SCHEDULED,
    "set_post_optim_event": (
        "mfsdp issues each step's gathers inside the compiled step, in stream order after "
        "whatever ran before it (the optimizer step among it): there is no event to pass"
    ),
    "set_reduce_scatter_divide_factor": _AVERAGED,
    "set_gradient_divide_factor": _AVERAGED,
    "set_force_sum_reduction_for_comms": (
        "mfsdp picks each gradient's reduce op itself: ReduceOp.AVG in the collective on NCCL "
        "for fp32/bf16 gradients, a sum and then a division elsewhere (NOTE: averaging in the "
        "collective, fsdp_compile/markers.py); it has no switch to force sum reductions"
    ),
    "set_reduce_scatter_unused_params": (
        "mfsdp's reductions are traced from the step: a parameter no backward reached keeps "
        ".grad None, as in eager (a repeated block's flat reduces zeros for such members), and "
        "ranks whose steps would read different parameters are refused at the step's first "
        "compile (docs/misuse.md, row 17): read the same parameters on every rank"
    ),
    "set_custom_all_gather": _OWN_COLLECTIVES,
    "set_custom_reduce_scatter": _OWN_COLLECTIVES,
    "set_all_reduce_hook": _OWN_COLLECTIVES,
    "set_reduce_scatter_max_input_buffers": _OWN_COLLECTIVES,
    "set_separate_reduce_scatter_group": _OWN_COLLECTIVES,
    "set_allocate_memory_from_process_group_for_comm": _OWN_COLLECTIVES,
    "set_symm_mem_for_comm": _OWN_COLLECTIVES,
}
"""Why each ``FSDPModule`` method mfsdp does not have has no use here, and what to call."""


def _refusal(name: str):
    def refused(self: nn.Module, *args, **kwargs):
        raise UsageError(
            f"{name}() is a method of torch's FSDP2 (FSDPModule) that a module "
            f"fsdp_compile.fully_shard returned has no use for: {MESSAGES[name]}."
        )

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused with what to do instead: {MESSAGES[name]}."
    return refused


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise UsageError(f"{name} takes True or False, got {value!r}.")


def _set_is_last_backward(self: nn.Module, is_last_backward: bool) -> None:
    """Accepted and changes nothing: each compiled backward finishes its own reductions."""
    _check_bool("set_is_last_backward", is_last_backward)


def _set_unshard_in_backward(self: nn.Module, unshard_in_backward: bool) -> None:
    """Accepted and changes nothing: a backward gathers a parameter only where it reads it."""
    _check_bool("set_unshard_in_backward", unshard_in_backward)


FSDP2_METHODS = {
    "set_is_last_backward": _set_is_last_backward,
    "set_unshard_in_backward": _set_unshard_in_backward,
    **{name: _refusal(name) for name in MESSAGES},
}
"""FSDP2's methods a sharded class gets, but the two gathered_reads.py defines."""
