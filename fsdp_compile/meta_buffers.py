"""Non-persistent buffers of a model built on the meta device: what must fill them.

NOTE: non-persistent buffers after a meta init
    A non-persistent buffer (HF's rotary ``inv_freq``, Gemma's ``embed_scale``, BERT's
    ``position_ids``) is in no state dict, so loading the weights never fills it. Built on
    meta, it holds no values; ``to_empty`` gives it memory and no values either. A model whose
    owner does not compute it again trains on whatever that memory held (seen: 9.7e32 and
    zeros for HF Llama's ``inv_freq`` on the CPU, positions lost), and so does FSDP2. A
    buffer ``set_model_state_dict`` leaves on meta fails inside the first forward, after
    collectives have started, naming neither the buffer nor the fix.

    So ``fully_shard`` notes each non-persistent buffer still on meta, and its owner notes
    the tensor ``_apply`` (``to_empty``, and any cast after it) makes of it, with that
    tensor's version. Before the first forward (``outermost_unit``), on every rank and before
    any collective, a noted buffer that is still on meta, or still that tensor at that version
    (neither written in place, HF's ``init.copy_``, nor replaced, torchtitan's
    ``self.freqs_cis = ...``), is refused with the fix. Once all are filled the notes go.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from fsdp_compile.errors import UsageError
from fsdp_compile.records import built_class_name

__all__ = ["watch_meta_buffers", "refuse_unfilled_buffers"]


def _meta_buffers(owner: nn.Module) -> list[str]:
    return [n for n, b in owner._buffers.items() if n in owner._non_persistent_buffers_set and b is not None and b.is_meta]


def watch_meta_buffers(root: nn.Module) -> None:
    """Note on ``root`` the modules under it that own a non-persistent buffer on meta, and
    make each note what ``_apply`` materialises it as (NOTE: non-persistent buffers after a
    meta init)."""
    owners = tuple(m for m in root.modules() if _meta_buffers(m) or "_mfsdp_unfilled" in m.__dict__)
    for owner in owners:
        owner.__dict__.setdefault("_mfsdp_unfilled", dict.fromkeys(_meta_buffers(owner)))
        if "_apply" not in owner.__dict__:  # an instance attribute: the class stays the user's
            owner._apply = types.MethodType(_noting_apply, owner)
    root._mfsdp_buffer_owners = owners


def _noting_apply(self: nn.Module, fn, recurse: bool = True):
    """The class's ``_apply``, then each unfilled buffer's new tensor and its version."""
    unfilled = _unfilled_names(self)  # none once the notes are gone
    result = type(self)._apply(self, fn, recurse)
    for name in unfilled:
        buffer = self._buffers.get(name)
        self._mfsdp_unfilled[name] = None if buffer is None or buffer.is_meta else (buffer, buffer._version)
    return result


def _unfilled_names(owner: nn.Module) -> list[str]:
    """``owner``'s noted buffers that nothing filled: still on meta where noted on meta, else
    still the tensor noted, at its version."""
    unfilled = []
    for name, note in (owner.__dict__.get("_mfsdp_unfilled") or {}).items():
        buffer = owner._buffers.get(name)
        if buffer is not None and (buffer.is_meta if note is None else buffer is note[0] and buffer._version == note[1]):
            unfilled.append(name)
    return unfilled


@torch._dynamo.assume_constant_result
def _unfilled(root: nn.Module) -> tuple[tuple[str, bool], ...]:
    """Each noted buffer under ``root`` that nothing filled, as (its path, whether still on
    meta); the notes go once none is left. Run by Python, also while Dynamo traces a function
    of the user's (its result a constant of the trace)."""
    owners = [owner for owner in root._mfsdp_buffer_owners if "_mfsdp_unfilled" in owner.__dict__]
    unfilled = [(owner, name) for owner in owners for name in _unfilled_names(owner)]
    paths = {module: f"{path}." if path else "" for path, module in root.named_modules()} if unfilled else {}
    found = tuple((paths[owner] + name, owner._buffers[name].is_meta) for owner, name in unfilled if owner in paths)
    if not found:  # an owner no longer in the model counts for nothing
        for owner in owners:
            del owner.__dict__["_mfsdp_unfilled"]
    return found


def refuse_unfilled_buffers(root: nn.Module) -> None:
    """Refuse a forward while a non-persistent buffer of a meta init holds no values (NOTE:
    non-persistent buffers after a meta init); checked before the forward, on every rank.
    Parameters still on meta are ``refuse_meta_parameters``'s to judge (a step
    ``fsdp_compile.simulate`` traces on meta is no mistake)."""
    if not root._mfsdp_buffer_owners:
        return
    param = next(root.parameters(), None)
    if param is not None and param.is_meta:
        return
    unfilled = _unfilled(root)
    if not unfilled:
        return
    on_meta = [path for path, meta in unfilled if meta]
    empty = [path for path, meta in unfilled if not meta]
    said = []
    if empty:
        said.append(f"{', '.join(empty)} were materialised by to_empty, which gives them no values")
    if on_meta:
        said.append(f"{', '.join(on_meta)} are still on the meta device")
    raise UsageError(
        f"the non-persistent buffers of this {built_class_name(root)} {' and '.join(said)}; they "
        "are in no state dict, so loading the weights does not fill them. Compute them on "
        "their device before the first forward: for an HF model, call "
        "model.to_empty(device=...), then model.init_weights() (HF's _init_weights computes "
        "them), then load the weights; for a model of yours, as its __init__ does "
        "(docs/user_guide.md, \"meta-device init\")."
    )
