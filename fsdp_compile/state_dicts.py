"""A sharded model's state dicts: ``state_dict`` entries pickle and deep-copy as the rows they
hold; a ``load_state_dict`` that would replace a sharded parameter writes its values into it
instead, and a full tensor copied in gives it this rank's rows.

NOTE: entries that pickle
    A repeated block's parameters hold views of its flat buffer (NOTE: flat parameters, in
    flat_params.py) at nonzero offsets, as do tensor-parallel parameters of their rank's rows
    (``api._tensor_parallel_shard``), and torch (2.11-2.13) cannot pickle a DTensor whose
    local tensor starts past its storage's start: its wrapper's ``data_ptr()`` is the offset,
    not 0, so ``Tensor._reduce_ex_internal`` takes it for a dense tensor and reads a storage the
    wrapper does not have ("Attempted to access the data pointer on an invalid python
    storage"): ``torch.save(model.state_dict())`` would stop there, its file half written, and
    ``copy.deepcopy(model.state_dict())`` too. Such ``state_dict()`` entries therefore hold,
    in place of the view, a tensor over storage of its own that aliases the same rows (a
    DLPack round trip: the same memory at offset 0, the buffer kept alive by it). The entry is a
    plain DTensor: ``torch.save`` writes its rows alone and ``deepcopy`` copies them, while
    DCP's in-place load, as any in-place write to an entry, still writes into the model's
    buffer. Dynamo does not know that an entry and its parameter alias: a function the user
    compiles should not write one and read the other. With ``keep_vars=True`` the entries are the
    parameters themselves, as torch's are, and do not pickle. A meta-device model's entries
    stay views (nothing to alias).

NOTE: loading with assign
    FSDP2's loaders replace parameters: ``model.load_state_dict(sharded_sd, assign=True)``
    (Accelerate's ``fsdp2_load_full_state_dict``, torchtune's
    ``load_from_full_model_state_dict``), and ``set_model_state_dict(model, full_sd,
    options=StateDictOptions(full_state_dict=True))``, which assigns whenever the model is
    still on the meta device. A replaced parameter would have lost its sharding record, and a
    repeated block's member its place in the block's flat buffer (NOTE: flat parameters, in
    flat_params.py). So every parameter keeps its object, which optimizers and the compiled
    step hold, and takes the loaded values in its own dtype: a parameter on its own still on
    the meta device adopts the loaded shard itself (no copy unless the dtypes differ); one
    already materialised, and a member of a flat, copies them into its storage. A flat still
    on the meta device is allocated on the loaded values' device once its block's load is
    done (``materialise_loaded_flats``), as ``to_empty`` would allocate it. The
    values must be placed as the parameter is (``model.state_dict()`` shows how); anything
    else is refused, naming the loaders that place them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_compile.errors import UsageError
from fsdp_compile.flat_params import converted_flat, hold_local
from fsdp_compile.records import shard_info

__all__ = ["load_into_shards", "materialise_loaded_flats", "save_picklable_entries"]


def save_picklable_entries(self: nn.Module, destination, prefix, keep_vars) -> None:
    """``nn.Module._save_to_state_dict`` of a module holding sharded parameters: the module's
    own, then each entry whose rows do not fill their storage (a flat's member, a
    tensor-parallel shard cut from its rank's rows) a DTensor over storage of its own
    aliasing them (see NOTE: entries that pickle)."""
    type(self)._mfsdp_base._save_to_state_dict(self, destination, prefix, keep_vars)
    if keep_vars:
        return
    for name in self._parameters:
        entry = destination.get(prefix + name)
        local = entry._local_tensor if isinstance(entry, DTensor) else None
        # The first member of a flat too: saved as a view, it would write the whole flat.
        if local is not None and not local.is_meta and local.untyped_storage().nbytes() != local.nbytes:
            alias = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(local.detach()))
            destination[prefix + name] = DTensor.from_local(
                alias, entry.device_mesh, entry.placements, run_check=False, shape=entry.shape, stride=entry.stride()
            )


def load_into_shards(
    self: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """``nn.Module._load_from_state_dict`` of a module holding sharded parameters: a full
    tensor copied in becomes this rank's rows (NOTE: a full state dict copied in), then the
    module's own load, then each sharded parameter the load replaced (``assign=True``) or
    swapped (``torch.__future__.set_swap_module_params_on_conversion``) is put back, holding
    the loaded values (see NOTE: loading with assign)."""
    held = []
    for name, param in self._parameters.items():
        if shard_info(param) is not None:
            # A swap moves the contents and the attributes to another object: keep both.
            before = DTensor.from_local(
                param._local_tensor, param.device_mesh, param.placements, run_check=False,
                shape=param.shape, stride=param.stride(),
            )
            held.append((name, param, dict(param.__dict__), before))
    if not local_metadata.get("assign_to_params_buffers", False):  # NOTE: a full state dict copied in
        for name, param, _, _ in held:
            full = state_dict.get(prefix + name)
            if isinstance(full, torch.Tensor) and not isinstance(full, DTensor) and full.shape == param.shape:
                state_dict[prefix + name] = _rows_of(full, param)
    type(self)._mfsdp_base._load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    )
    for name, param, attributes, before in held:
        loaded = self._parameters[name]
        swapped = loaded is param and shard_info(param) is None
        if loaded is param and not swapped:
            continue  # copied in place
        values = loaded._local_tensor if _placed_alike(loaded, before) else None
        if swapped:
            torch.utils.swap_tensors(param, nn.Parameter(before, requires_grad=param.requires_grad))
            param.__dict__.update(attributes)
        self._parameters[name] = param
        if values is None:
            given = (
                f"a DTensor of shape {tuple(loaded.shape)} placed {tuple(loaded.placements)}"
                if isinstance(loaded, DTensor) else f"a tensor of shape {tuple(loaded.shape)}, not a DTensor"
            )
            raise UsageError(
                f"load_state_dict(assign=True) gave {prefix}{name} {given}; the sharded model "
                f"holds a DTensor of shape {tuple(before.shape)} placed "
                f"{tuple(before.placements)}. Load DTensors placed as model.state_dict()'s "
                "(distribute_tensor(full, param.device_mesh, param.placements)), or a full "
                "state dict with torch.distributed.checkpoint.state_dict.set_model_state_dict("
                "model, full_sd, options=StateDictOptions(full_state_dict=True))."
            )
        _write(param, values)


# NOTE: a full state dict copied in
#     ``model.load_state_dict(full_sd)`` (an unsharded model's checkpoint, ``torch.load``ed on
#     every rank) copies each value into its parameter. A sharded parameter takes this rank's
#     rows of it, as ``set_model_state_dict(..., StateDictOptions(full_state_dict=True))``
#     takes them (``compute_local_shape_and_global_offset``), with no collective. FSDP2 fails
#     there ("got mixed torch.Tensor and DTensor"). ``assign=True`` replaces parameters with
#     what it is given, which a full tensor cannot be: refused below, with the loaders that
#     place values.


def _rows_of(full: torch.Tensor, param: DTensor) -> DTensor:
    """``full`` as ``param`` places it, holding only this rank's part (NOTE: a full state dict
    copied in)."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
    rows = full[tuple(slice(start, start + size) for size, start in zip(shape, offset))]
    local = param._local_tensor
    return DTensor.from_local(
        rows if local.is_meta else rows.to(local.device), param.device_mesh, param.placements,
        run_check=False, shape=param.shape, stride=param.stride(),
    )


def _placed_alike(loaded: object, before: DTensor) -> bool:
    return (
        isinstance(loaded, DTensor)
        and loaded.device_mesh == before.device_mesh
        and loaded.placements == before.placements
        and loaded.shape == before.shape
        and loaded._local_tensor.shape == before._local_tensor.shape
    )


def _write(param: nn.Parameter, values: torch.Tensor) -> None:
    """``param`` (its object kept) holds ``values``, this rank's loaded rows."""
    flat = getattr(param, "_mfsdp_flat", None)
    local = param._local_tensor
    if flat is not None and flat.is_meta:
        param._mfsdp_loaded = values  # until its block's load is done
    elif flat is not None or not local.is_meta:
        local.copy_(values)
    else:
        hold_local(param, values.to(dtype=param.dtype).contiguous())


def materialise_loaded_flats(block: nn.Module, incompatible_keys) -> None:
    """A repeated block's load post-hook: each flat still on the meta device whose members
    were loaded is materialised on the values' device and takes them (see NOTE: loading
    with assign)."""
    for name, flat in list(block._mfsdp_region_flats.items()):
        members = [member.param for member in flat._mfsdp_members]
        loaded = [param.__dict__.pop("_mfsdp_loaded", None) for param in members]
        if all(values is None for values in loaded):
            continue
        if any(values is None for values in loaded):
            left = [n for n, values in zip(flat._mfsdp.members, loaded) if values is None]
            raise UsageError(
                f"the load gave values to some parameters of {flat._mfsdp.fqn.rpartition('.')[0]}, "
                f"still on the meta device, but not to {', '.join(left)}: a block's parameters "
                "share one buffer, "
                "materialised together. Load them all, or call model.to_empty(device=...) "
                "before loading."
            )
        device = loaded[0].device
        flat = block._mfsdp_region_flats[name] = converted_flat(
            flat, members, lambda t: torch.empty_like(t, device=device)
        )
        with torch.no_grad():
            for param, values in zip(members, loaded):
                param._local_tensor.copy_(values)
