"""Meta-device init: build without memory, shard, materialise only this rank's rows. Training
to parity from loaded weights after a meta init is the matrix's ``meta_init`` cell on every
layout (tests/test_matrix.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_compile import fully_shard
from fsdp_compile.testing.models import Transformer, TransformerConfig
from harness import build_model, fake_process_group


def _meta_model(cfg):
    with torch.device("meta"):
        return Transformer(cfg)


@pytest.mark.structure
@pytest.mark.skipif(
    torch.__version__ < "2.13",
    reason="torch < 2.13's MemTracker counts a DTensor at its global size (its wrapper's storage: "
    "a DTensor over 1 MB of rows of a 4 MB tensor counts 5 MB), so it cannot see a shard's peak",
)
def test_materialising_a_meta_model_allocates_about_one_shard():
    """to_empty + init on the sharded model peaks near this rank's shard, not the model."""
    cfg = TransformerConfig(vocab=1024, dim=256, hidden=704, n_heads=4)
    world = 4
    full_bytes = sum(p.numel() * p.element_size() for p in build_model(cfg).parameters())
    with fake_process_group(world):
        model = fully_shard(_meta_model(cfg))
        assert all(p.device.type == "meta" for p in model.parameters())
        tracker = MemTracker()
        with tracker:
            model.to_empty(device="cpu")
            with torch.no_grad():
                for param in model.parameters():
                    param.normal_(std=0.02)  # DTensor: each rank draws only its rows
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    shard_bytes = full_bytes / world
    # Observed 1.09x: one parameter's rows are briefly allocated twice while to_empty swaps it.
    assert peak < 1.2 * shard_bytes, (peak, shard_bytes, full_bytes)
