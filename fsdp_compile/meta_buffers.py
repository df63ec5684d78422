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

import copy
import itertools
import types
import weakref

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
    owners = {path: m for path, m in root.named_modules() if _meta_buffers(m) or "_mfsdp_unfilled" in m.__dict__}
    for owner in owners.values():
        owner.__dict__.setdefault("_mfsdp_unfilled", dict.fromkeys(_meta_buffers(owner)))
        if "_apply" not in owner.__dict__:  # an instance attribute: the class stays the user's
            owner._apply = types.MethodType(_noting_apply, owner)
    root._mfsdp_buffer_watch = _Watch(owners) if owners else None


class _Watch:
    """The modules a root's meta init must fill, by path, and the key traced code names them
    by: Dynamo takes constants only into ``_unfilled``, and on torch 2.11 a module is none."""

    def __init__(self, owners: dict[str, nn.Module]) -> None:
        self.owners = owners
        self.key = next(_WATCH_KEYS)
        _WATCHES[self.key] = self

    def __deepcopy__(self, memo: dict) -> _Watch:
        # A copy of the model watches its own owners, under a key of its own.
        return _Watch({path: copy.deepcopy(owner, memo) for path, owner in self.owners.items()})


_WATCHES: weakref.WeakValueDictionary[int, _Watch] = weakref.WeakValueDictionary()
"""Every live watch by its key, a name only: the root owns its watch."""
_WATCH_KEYS = itertools.count()


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
def _unfilled(key: int) -> tuple[tuple[str, bool], ...]:
    """Each noted buffer of the watch ``key`` names that nothing filled, as (its path,
    whether still on meta); the notes go once none is left. Run by Python, also while Dynamo
    traces (its result a constant of the trace)."""
    watch = _WATCHES.get(key)
    owners = {} if watch is None else {p: o for p, o in watch.owners.items() if "_mfsdp_unfilled" in o.__dict__}
    found = tuple(
        (f"{path}.{name}".lstrip("."), owner._buffers[name].is_meta)
        for path, owner in owners.items() for name in _unfilled_names(owner)
    )
    if not found:
        for owner in owners.values():
            del owner.__dict__["_mfsdp_unfilled"]
    return found


def refuse_unfilled_buffers(root: nn.Module) -> None:
    """Refuse a forward while a non-persistent buffer of a meta init holds no values (NOTE:
    non-persistent buffers after a meta init); checked before the forward, on every rank.
    Parameters still on meta are ``refuse_meta_parameters``'s to judge (a step
    ``fsdp_compile.simulate`` traces on meta is no mistake)."""
    watch = root._mfsdp_buffer_watch
    if watch is None:
        return
    param = next(root.parameters(), None)
    if param is not None and param.is_meta:
        return
    unfilled = _unfilled(watch.key)
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
