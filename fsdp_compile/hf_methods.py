"""HF's ``PreTrainedModel`` methods on the sharded class (and PEFT's ``PeftModel``'s):
``save_pretrained`` writes full tensors or refuses, before any collective; ``generate``
keeps the ranks in step; ``resize_token_embeddings`` is refused, naming the order that works.

A sharded model's ``state_dict()`` holds this rank's rows of each parameter, as DTensors, which
safetensors cannot write (under FSDP2 too), and called on rank 0 alone, as with DDP
(``if rank == 0: model.save_pretrained(path)``), nothing can gather them: any collective would
wait for ranks that never join. The fix is the full state dict, gathered by every rank and
written by one; ``save_pretrained`` without it says so, before any collective or file.

As fsdp_compile/hf.py, nothing here imports transformers or PEFT: they are looked for among the
modules already imported.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compile.errors import UsageError

__all__ = ["hf_methods"]


# The classes whose save_pretrained writes the model's state dict with safetensors, by module.
_SAVING_CLASSES = (("transformers.modeling_utils", "PreTrainedModel"), ("peft.peft_model", "PeftModel"))


def hf_methods(base: type) -> dict:
    """The HF methods a sharded subclass of ``base`` overrides: none unless ``base`` is an HF
    model class (or PEFT's), and none of those ``base`` defines itself (a class of the user's
    that gathers the full state dict in its own ``save_pretrained`` keeps it)."""
    methods = {}
    for module, name in _SAVING_CLASSES:
        owner = getattr(sys.modules.get(module), name, None)
        if owner is not None and issubclass(base, owner) and base.save_pretrained is owner.save_pretrained:
            methods["save_pretrained"] = _save_pretrained
            break
    generating = getattr(sys.modules.get("transformers.generation.utils"), "GenerationMixin", None)
    if generating is not None and issubclass(base, generating) and _takes_synced_gpus(base.generate):
        methods["generate"] = _generate_in_step(base.generate)
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if pretrained is not None and issubclass(base, pretrained):
        if base.resize_token_embeddings is pretrained.resize_token_embeddings:
            methods["resize_token_embeddings"] = _resize_token_embeddings
    return methods


def _takes_synced_gpus(generate) -> bool:
    parameters = inspect.signature(generate).parameters.values()
    return any(p.name == "synced_gpus" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _generate_in_step(generate):
    """``generate`` (HF's, or a class's own that passes its keywords on), every rank stepping
    until all are done (``synced_gpus=True``) unless the call says otherwise, as HF does for a
    model FSDP2 shards: each step's forward gathers the weights from every rank, and a rank
    whose sequences ended first (an EOS) stopped joining, so the others waited in their
    gathers until the process group timed out. Its signature and docstring are ``generate``'s."""

    signature = inspect.signature(generate)

    @functools.wraps(generate)
    def generate_in_step(self: nn.Module, *args, **kwargs):
        given = signature.bind_partial(self, *args, **kwargs).arguments
        unsaid = kwargs.get("synced_gpus", given.get("synced_gpus")) is None
        if unsaid and dist.is_initialized() and dist.get_world_size() > 1:
            kwargs["synced_gpus"] = True
        return generate(self, *args, **kwargs)

    return generate_in_step


def _resize_token_embeddings(self: nn.Module, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
    """HF's, where it keeps the size; a resize is refused, naming the order that works."""
    rows = self.get_input_embeddings().weight.shape[0]
    size = rows if new_num_tokens is None else new_num_tokens
    if pad_to_multiple_of is not None:
        size = math.ceil(size / pad_to_multiple_of) * pad_to_multiple_of
    if size != rows:
        raise UsageError(
            f"resize_token_embeddings({new_num_tokens}) was called on a sharded model: its "
            "embedding (and tied head) hold this rank's rows only, and HF's resize would mix "
            "them with full tensors. Resize first, then shard: model.resize_token_embeddings(n); "
            "fsdp_compile.fully_shard(model)."
        )
    return type(self)._mfsdp_base.resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of, mean_resizing)


def _save_pretrained(self: nn.Module, *args, **kwargs):
    save_pretrained = type(self)._mfsdp_base.save_pretrained
    bound = inspect.signature(save_pretrained).bind(self, *args, **kwargs)
    state_dict = bound.arguments.get("state_dict", bound.kwargs.get("state_dict"))  # PEFT's: a keyword
    if state_dict is None or any(isinstance(value, DTensor) for value in state_dict.values()):
        given = "no state_dict" if state_dict is None else "a state_dict holding DTensors"
        raise UsageError(
            f"save_pretrained was given {given}: this rank holds only its rows of each sharded "
            "parameter, which safetensors cannot write. Call it on every rank with the full "
            "state dict, written by one: full = torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
            "cpu_offload=True)); model.save_pretrained(path, state_dict=full, "
            "is_main_process=dist.get_rank() == 0). On rank 0 alone it cannot work: the gather "
            "needs every rank."
        )
    return save_pretrained(self, *args, **kwargs)
