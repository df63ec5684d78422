"""Capture a whole training step (forward, backward, optimizer step) as one CUDA graph.

The compiled step is capturable by construction: collectives are functional ops on the
graph (no host-side use counters, no ``record_stream``, no storage frees), gathered
parameters live in ordinary allocations, and ``options={"cuda_graph": True}`` refuses at
compile time anything capture cannot handle. See docs/cuda_graphs.md.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_compile.errors import UsageError
from fsdp_compile.hf import inputs_unread

__all__ = ["capture_step", "CapturedStep"]


def _check_inputs(static_inputs: tuple) -> None:
    if not torch.cuda.is_available():
        raise UsageError("capture_step needs a CUDA device; on CPU call the step directly.")
    for leaf in tree_flatten(static_inputs)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cuda":
            raise UsageError(
                f"capture_step got a {leaf.device} tensor input; replays copy new inputs into "
                "device buffers, so pass CUDA tensors (e.g. batch.cuda(non_blocking=True))."
            )


class CapturedStep:
    """A training step captured once and replayed.

    Calling it copies the new inputs into the static input buffers, replays the graph and
    returns the static outputs (overwritten by the next call: clone what you keep). Call
    :meth:`teardown` (or leave the ``with`` block) before ``destroy_process_group``: the graph
    holds NCCL work that must not outlive its communicator.
    """

    def __init__(self, train_step: Callable[..., Any], static_inputs: tuple, warmup_steps: int):
        self._static_inputs = static_inputs
        self.warmup_outputs: list[Any] = []
        # Warm-up runs real steps (compilation, optimizer state, NCCL communicators) on a side
        # stream, as capture requires; they train on the example inputs.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # Replays bring values capture never saw: an HF model decides nothing from them, in
        # the warm-up either, whose compiled step the capture records (fsdp_compile/hf.py).
        with inputs_unread():
            with torch.cuda.stream(side):
                for _ in range(warmup_steps):
                    self.warmup_outputs.append(_detach_clone(train_step(*static_inputs)))
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            # The warm-up's freed blocks stay cached for its stream, where the graph's private
            # pool cannot use them: without this an 8B step ran out of memory on an 80 GB card
            # with 22-40 GiB reserved and unused.
            torch.cuda.empty_cache()
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._static_outputs = train_step(*static_inputs)

    def __call__(self, *inputs: Any) -> Any:
        if self._graph is None:
            raise UsageError("this captured step was torn down; capture it again.")
        tree_map(_copy_into, self._static_inputs, inputs)
        self._graph.replay()
        return self._static_outputs

    def teardown(self) -> None:
        """Release the graph and its memory pool; safe to call twice."""
        if self._graph is not None:
            torch.cuda.synchronize()
            self._graph.reset()
        self._graph = None
        self._static_outputs = None

    def __enter__(self) -> CapturedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


def _copy_into(static: Any, new: Any) -> None:
    if isinstance(static, torch.Tensor):
        if new.shape != static.shape or new.dtype != static.dtype:
            raise UsageError(
                f"captured step expects inputs of shape {tuple(static.shape)} and dtype "
                f"{static.dtype}, got {tuple(new.shape)} {new.dtype}: capture once per shape."
            )
        static.copy_(new, non_blocking=True)


def _detach_clone(outputs: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, outputs)


def capture_step(
    train_step: Callable[..., Any], *static_inputs: Any, warmup_steps: int = 1
) -> CapturedStep:
    """Warm up, then capture ``train_step(*static_inputs)`` whole into one CUDA graph.

    ``train_step`` runs forward, backward and the optimizer step and returns what you want to
    read (e.g. the loss); use a capturable optimizer (``torch.optim.AdamW(...,
    capturable=True)``) and start the step with ``opt.zero_grad(set_to_none=True)``. The
    ``warmup_steps`` (at least 1) are real training steps on ``static_inputs``; their outputs
    are kept in ``.warmup_outputs``.
    """
    if warmup_steps < 1:
        raise UsageError(
            "capture_step needs warmup_steps >= 1: the first call compiles the step and "
            "creates the optimizer state, which must not happen during capture."
        )
    _check_inputs(static_inputs)
    return CapturedStep(train_step, static_inputs, warmup_steps)
