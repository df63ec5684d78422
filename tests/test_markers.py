"""The uncompiled markers: the eager baseline and its failure modes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_compile.markers
from fsdp_compile import fully_shard
from harness import fake_process_group

pytestmark = pytest.mark.structure


def test_failing_gather_raises_instead_of_returning_the_shard(monkeypatch):
    """An AttributeError inside the property would make Python fall back to
    nn.Module.__getattr__ and silently return the shard; it must surface instead."""

    def broken(*args, **kwargs):
        raise AttributeError("no such collective")

    monkeypatch.setattr(fsdp_compile.markers, "gathered", broken)
    with fake_process_group(2):
        layer = fully_shard(nn.Linear(4, 4))
        with pytest.raises(RuntimeError, match="gathering .*weight failed: no such collective"):
            layer(torch.randn(2, 4))
