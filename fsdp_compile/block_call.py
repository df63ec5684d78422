"""A repeated block's call in the compiled step: one opaque op, whose body is a frame of its own.

NOTE: one op per block call
    Dynamo and AOTAutograd trace every call a whole-step graph makes, and torch's regional
    compilation (``nested_compile_region``, ``invoke_subgraph``) still pays per call: Dynamo
    checks each call's reuse against the body's guards in Python, AOTAutograd runs the
    higher-order op's autograd rule per call. On the CPU proxy that was about 55 ms a layer
    (docs/design.md, "One body per repeated block"), where FSDP2 + per-block compile pays nothing per
    layer: each layer after the first finds its compiled frame in Dynamo's cache.

    So, compiled by mfsdp, a region (fsdp_compile/regions.py) gathers its flat parameters in
    the step's graph and then calls ``fsdp_compile::block_forward``: one node per layer, which
    Dynamo and AOTAutograd do not look into, whose autograd rule is
    ``fsdp_compile::block_backward``. The collectives stay in the step's graph, where the plan
    buckets, schedules, reshards and checks them; the body is not in it.

    The body runs as a Dynamo frame of its own, compiled by the same backend (one code object
    per block structure and backend), exactly as FSDP2 + per-block compile runs a block: at
    every call Dynamo checks its guards (in C++), so a layer that differs in anything the
    body reads gets a compile of its own, and nothing is reused on trust. Its backward is
    the frame's own autograd graph, kept from ``block_forward`` to ``block_backward``:

    - What the step's graph needs of the body while tracing is only its outputs' shapes: the
      op's fake kernel runs the block's Python once per structure and input layout on fake
      tensors (``block_fakes.fake_run``, kept by the backend outside a compile), and the real
      call checks its outputs against them.
    - The gathered weights go into the frame as slots (``block_runtime._slot``): tensors of their own that
      share the gathered storage (a flat's, its members copied out: NOTE: a flat's copies in
      the block call). The frame's autograd graph saves the slots it needs (its partitioner
      recomputes every view of them: ``reshard``), so after the forward each slot lets go of
      the storage (``slot.data``), the step frees the gathered weights as planned, and
      ``block_backward`` points the slots at the weights the step gathered again. Resharding
      after forward holds as in a whole-step graph.
    - The frame's autograd graph waits for its backward in its backend's ``pending``
      (``PendingGraphs``), keyed by a token tensor the op returns and the step saves for
      backward. A call whose token no node reads (a checkpointed block, recomputed in the
      backward) keeps none (``differentiated=False``, pass keep_only_differentiated_calls);
      an entry whose token died unused (a forward never differentiated) is dropped as the
      next step's graph starts.
    - A call that activation checkpointing recomputes in the backward runs the body again:
      where the body draws random numbers (dropout), the recompute must draw the forward's.
      The step's graph reads the generators' state just before such a call (``rng_state``),
      the partitioner saves it, and the recompute replays it and puts the generators back,
      as ``torch.utils.checkpoint`` does eagerly (passes ``save_block_rng`` and
      ``replay_block_rng``). Inside a body, AOTAutograd handles its own random ops.

NOTE: a flat's copies in the block call
    A flat parameter (NOTE: flat parameters, in flat_params.py) is gathered as one tensor, its
    members are copied out of it (``split_gathered``), and their gradients are packed back
    rank-major for its one reduce-scatter (``pack_for_reduce_scatter``). The body's frame
    takes the members as its gathered weights (``body_weights``, ``FlatCopy``): through
    autograd the block call copies them out around the frame, and past it the step's graph
    does, before the call (``copied_out``: NOTE: copied out before the block call, in
    passes/copy_out_flats.py). ``block_backward`` returns their gradients one by one, and the
    op's autograd formula packs them, so the pack is a node of the step's graph:
    - inside the frame the pack could only come out in the gathered weight's dtype (a
      compiled graph's gradient of an input takes the input's dtype), and the step would cast
      the whole gathered-size gradient to fp32 once more; in the step's graph the pass
      ``pack_in_reduce_dtype`` makes the pack write the reduce dtype itself (NOTE: gradients
      packed once), as FSDP2's copy-in writes its fp32 buffer from the bf16 gradients;
    - the pack moves with its reduce-scatter's issue, after the previous reduce-scatter's
      wait (``schedule_collectives``), so one layer's packed gradient is alive at a time, as
      FSDP2 frees the last reduce-scatter's input before packing the next one.
    The copies are the kernels the body ran before, once per forward and once per backward,
    and the body still saves its weights only as its inputs (``reshard``).

NOTE: float8 weights in a block call
    A float8 weight (NOTE: float8 gathers, in float8.py) reaches its linear as torchao's
    ``Float8TrainingTensor``, made in the step's graph after the gather, where the gather and
    the cast are lowered into a float8 all-gather of the cast shard. The block call is an op of
    plain tensors: for that subclass the ops here have a rule of their own
    (``register_torch_dispatch``, given once a region holds a float8 weight) that hands the op
    the tensor's float8 data and scale in its place, so the step's graph holds the float8
    gather feeding the block call, and the op's autograd rule, above the subclass, gives the
    weight its gradient in the weight's dtype, which the cast passes straight to the gather.
    Inside, the body reads the weight as a ``Float8TrainingTensor`` of the two again
    (``float8.float8_from_parts``). Its gradient cannot go to the float8 data (autograd would
    cast it to float8), so it goes to a leaf of the weight's dtype and shape whose strides are
    all 0 (``carrier``): that leaf's gradient is the one ``block_backward`` returns for the
    weight. The body saves the data and scale only as its slots (the step gathers them again
    for the backward), as any gathered weight. A weight the body gives no gradient (read under
    ``torch.no_grad()``) goes to the call detached: the cast is an ``autograd.Function``,
    whose missing gradient the compiled graph would make zeros, where eager leaves ``.grad``
    None. The wrapper learns which from the call's fake run, done first
    (``float8_without_gradient_detached``).

NOTE: DTensors at a block call
    Sequence parallelism on an HF model keeps the residual stream a DTensor between layers
    (HF computes the rotary positions from its length), and a layer may return one
    (``use_local_output=False``). For ``DTensor`` the block ops have a rule too: the op takes
    each DTensor's local tensor, recording its mesh, placements, shape and stride
    (``traced["tensor_specs"]``), and ``block_backward`` gives the gradients of those inputs
    back as DTensors placed as the body's ``from_local`` gave them (a ``Partial`` input's
    replicated, as torch's backward of it makes it). The op's results are local tensors; the step's
    graph reads each the block returned as a DTensor as that DTensor again
    (``traced["output_specs"]``, from the fake run; ``DTensor.from_local`` in the region's
    wrapper, whose backward hands the op the gradient's local tensor). Inside, the body gets
    the DTensors back from the local tensors and returns its outputs' local tensors, both on
    autograd's record, so the block's code runs on what eager hands it. A global shape must be
    a number for that, and the placements values: a call given a DTensor of symbolic sizes (a
    step compiled with dynamic shapes), or one still a masked partial sum (whose placement
    holds the mask of its own call), is traced inline, said once
    (``region_notices.say_dtensor_inline``), and a block returning one of symbolic sizes is
    refused, naming the fix.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from fsdp_compile.block_fakes import fake_run, refuse_input_writes
from fsdp_compile.block_record import BlockCall, call_record
from fsdp_compile.block_runtime import (
    as_dtensors,
    body_weights,
    dtensor_spec,
    generator_states,
    generators_at,
    graded_like,
    gradient_spec,
    packed_grads,
    run_backward,
    run_forward,
    token_like,
)
from fsdp_compile.flat_params import note_block_graded

__all__ = [
    "BLOCK_FORWARD", "BLOCK_BACKWARD", "BLOCK_GRADED", "RNG_STATE", "block_calls_keep_their_buffers",
    "block_ops_take_float8_weights", "float8_without_gradient_detached", "note_traced_grading",
]


@torch.library.custom_op("fsdp_compile::block_forward", mutates_args=())
def block_forward(
    weights: list[Tensor],
    tensors: list[Tensor],
    call: int,
    rng_state: Tensor | None = None,
    replay: bool = False,
    copied_out: bool = False,
    differentiated: bool = True,
) -> list[Tensor]:
    """The block's outputs, then a token its backward finds the body's autograd graph by.

    ``rng_state`` is what the generators were at as the forward's call began (``rng_state``);
    a recompute of the call in the backward (``replay``) draws from it again. ``copied_out``:
    ``weights`` hold each flat's members, which the step's graph copied out (NOTE: copied out
    before the block call, in passes/copy_out_flats.py), not the gathered flats.
    ``differentiated`` False: no node reads the token (the backward recomputes the call), so
    the body's autograd graph is not kept (pass keep_only_differentiated_calls)."""
    if not replay:
        return run_forward(call_record(call), weights, tensors, copied_out, differentiated)
    with generators_at(rng_state, (*weights, *tensors)[0].device):
        return run_forward(call_record(call), weights, tensors, copied_out, differentiated)


@block_forward.register_fake
def _(
    weights, tensors, call, rng_state=None, replay=False, copied_out=False, differentiated=True
) -> list[Tensor]:
    # Dynamo's call comes first and sees the user's tensors; AOTAutograd's come from below
    # autograd, where nothing requires a gradient. The fake run differentiates as they do.
    call_record(call).traced.setdefault("differentiable", [t.requires_grad for t in tensors])
    record = _traced(call, weights, tensors, copied_out)
    refuse_input_writes(record)
    outputs = [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in record.traced["outputs"]]
    return [*outputs, token_like([*weights, *tensors])]


def _traced(call: int, weights: list[Tensor], tensors: list[Tensor], copied_out: bool = False) -> BlockCall:
    """The call's record, its fake run done; a training call tells the block's flats which
    members get a gradient (see NOTE: parameters without a gradient, in block_fakes.py)."""
    record = call_record(call)
    record.traced.update(fake_run(record, weights, tensors, copied_out))
    if record.train:
        note_block_graded(record.block(), record.traced["graded"], traced=True)
    return record


def note_traced_grading(calls: tuple[BlockCall, ...]) -> None:
    """Tell the flats of each training call's block which members its backward gives a
    gradient, as the call's fake run found (a block called twice: either call); run as a
    compiled graph starts, since the step traced again (a flag changed) found otherwise, and
    its earlier version may be back in use. A body's backward says so again as it runs
    (``run_backward``); a call traced inline has no such backward."""
    graded: dict[nn.Module, list] = {}
    for call in calls:
        if call.train and (block := call.block()) is not None:
            before = graded.setdefault(block, call.traced["graded"])
            graded[block] = [tuple(map(operator.or_, a, b)) if a and b else a or b for a, b in zip(before, call.traced["graded"])]
    for block, flags in graded.items():
        note_block_graded(block, flags, traced=True)


@torch.library.custom_op("fsdp_compile::block_graded", mutates_args=())
def block_graded(weights: list[Tensor], tensors: list[Tensor], call: int) -> Tensor:
    """Traced, the fake run of a block call traced inline (``regional=False``), for what its
    flats' members get a gradient (see NOTE: parameters without a gradient, in block_fakes.py),
    or of a call given float8 weights, for which get none (``float8_without_gradient_detached``).
    Its result is a token nobody reads, and the pass ``drop_block_probes`` removes the node
    (Dynamo keeps a custom op's call whatever reads it): nothing runs."""
    return token_like([*weights, *tensors])


@block_graded.register_fake
def _(weights, tensors, call) -> Tensor:
    _traced(call, weights, tensors)
    return token_like([*weights, *tensors])


BLOCK_GRADED = torch.ops.fsdp_compile.block_graded.default


@torch.library.custom_op("fsdp_compile::block_backward", mutates_args=())
def block_backward(
    token: Tensor,
    weights: list[Tensor],
    tensors: list[Tensor],
    grads: list[Tensor | None],
    call: int,
    copied_out: bool = False,
) -> list[Tensor]:
    """Gradients of the body's weights (a flat's members one by one: NOTE: a flat's copies in
    the block call), then of the tensors; zeros where none flows. ``copied_out``: as
    ``block_forward``'s."""
    return run_backward(call_record(call), token, weights, tensors, grads, copied_out)


@block_backward.register_fake
def _(token, weights, tensors, grads, call, copied_out=False) -> list[Tensor]:
    graded = graded_like(call_record(call), body_weights(call_record(call), weights, copied_out))
    return [*graded, *map(torch.empty_like, tensors)]


def _save(ctx, inputs, output) -> None:
    weights, tensors, ctx.call, rng_state, replay, copied_out, differentiated = inputs
    # The dispatcher drops trailing arguments equal to their defaults, and the backward
    # answers for the arguments it kept. Only a graph past autograd copies out or marks a
    # call undifferentiated (passes copy_out_flats, keep_only_differentiated_calls).
    assert not copied_out and differentiated, "a block call the step rewrote past autograd is differentiated"
    ctx.kept = 2 if replay else int(rng_state is not None)
    ctx.counts = (len(weights), len(tensors))
    ctx.differentiable = [t.requires_grad for t in tensors]
    # An output the body computes without a gradient (T5's cross-attention bias: zeros and
    # the mask) has none here either, as in eager: the next layer's SDPA then takes its mask
    # as eager's does (CPU kernels choose by it), and no gradient is computed for it.
    graded = call_record(ctx.call).traced["differentiable_outputs"]
    ctx.mark_non_differentiable(*(t for t, g in zip(output, graded) if not g))
    ctx.save_for_backward(output[-1], *weights, *tensors)


def _backward(ctx, grads: list[Tensor | None]):
    token, *saved = ctx.saved_tensors
    weights, tensors = saved[: ctx.counts[0]], saved[ctx.counts[0] :]
    call = call_record(ctx.call)
    computed = block_backward(token, weights, tensors, list(grads[:-1]), ctx.call)
    by_weight, by_tensor = packed_grads(call, weights, computed), computed[len(computed) - len(tensors) :]
    # A weight no member of which has a gradient gets none (see NOTE: parameters without a
    # gradient): no reduction runs for it, and its parameters' .grad stays None.
    graded = call.traced["graded"]
    by_weight = [g if any(flags) else None for g, flags in zip(by_weight, graded)]
    return by_weight, [g if d else None for g, d in zip(by_tensor, ctx.differentiable)], None, *[None] * ctx.kept


block_forward.register_autograd(_backward, setup_context=_save)

BLOCK_FORWARD = torch.ops.fsdp_compile.block_forward.default
# The body may update the block's buffers (BatchNorm's statistics, a counter): a call whose
# outputs nobody reads still runs, as the block would eagerly, and no graph's dead-code
# elimination removes it with those updates.
torch.fx.node.has_side_effect(BLOCK_FORWARD)
BLOCK_BACKWARD = torch.ops.fsdp_compile.block_backward.default


def _float8_as_parts(weights_at: int, cls, func, types, args, kwargs):
    """``func`` (a block op) with each ``Float8TrainingTensor`` among its weights (argument
    ``weights_at``) given as its float8 data and scale (NOTE: float8 weights in a block call)."""
    weights = [part for w in args[weights_at] for part in ((w._data, w._scale) if isinstance(w, cls) else (w,))]
    return func(*args[:weights_at], weights, *args[weights_at + 1 :], **kwargs)


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _forward_on_locals(cls, func, types, args, kwargs):
    """``block_forward`` or ``block_graded`` called with DTensors among its tensors (NOTE:
    DTensors at a block call)."""
    weights, tensors, call, *rest = args
    record = call_record(call)
    record.traced.setdefault("differentiable", [t.requires_grad for t in tensors])
    record.traced["tensor_specs"] = [dtensor_spec(t) for t in tensors]
    return func(weights, [_local(t) for t in tensors], call, *rest, **kwargs)


def _backward_on_locals(cls, func, types, args, kwargs):
    """``block_backward`` called with DTensors among its tensors: their gradients DTensors
    placed as the body's ``DTensor.from_local`` gave them, a ``Partial`` input's replicated."""
    token, weights, tensors, grads, call, *rest = args
    results = func(token, weights, [_local(t) for t in tensors], [_local(g) for g in grads], call, *rest, **kwargs)
    at = len(results) - len(tensors)
    return [*results[:at], *as_dtensors(results[at:], [gradient_spec(dtensor_spec(t)) for t in tensors])]


block_forward.register_torch_dispatch(DTensor, _forward_on_locals)
block_graded.register_torch_dispatch(DTensor, _forward_on_locals)
block_backward.register_torch_dispatch(DTensor, _backward_on_locals)


def block_ops_take_float8_weights() -> None:
    """The block ops' rule for torchao's ``Float8TrainingTensor`` (NOTE: float8 weights in a
    block call): given for the first region that holds a float8 weight, again for each (the
    same rule), so importing this module needs no torchao."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    for op, weights_at in ((block_forward, 0), (block_graded, 0), (block_backward, 1)):
        op.register_torch_dispatch(Float8TrainingTensor, functools.partial(_float8_as_parts, weights_at))


def float8_without_gradient_detached(gathered: list[Tensor], tensors: list[Tensor], call: int, at: int) -> list[Tensor]:
    """Traced in a training call's wrapper: the gathered weights (those on their own from
    ``at``), each float8 one the call's body gives no gradient detached (NOTE: float8 weights
    in a block call). The call's fake run, done first, says which (``BLOCK_GRADED``: nobody
    reads its token: ``drop_block_probes`` removes it)."""
    BLOCK_GRADED(gathered, tensors, call)
    idle = _float8_without_gradient(call)
    return [*gathered[:at], *(g.detach() if i else g for g, i in zip(gathered[at:], idle))]


@torch._dynamo.assume_constant_result
def _float8_without_gradient(call: int) -> tuple[bool, ...]:
    """Per weight the call gathers on its own, whether it is a float8 one its fake run gave
    no gradient (read under ``torch.no_grad()``, or not read)."""
    record = call_record(call)
    alone = record.traced["graded"][len(record.flats) :]
    return tuple(read is not None and not any(flags) for read, flags in zip(record.float8, alone))


@contextlib.contextmanager
def block_calls_keep_their_buffers() -> Iterator[None]:
    """While Inductor compiles in here, it lowers ``block_forward`` as it lowers any custom
    op (an extern call, with the op's layout constraint), and never reuses the buffers the
    call reads or returns. On leaving, the op's lowering is what it was: none, or the plain
    one Inductor makes itself for a custom op it meets.

    The body's autograd graph keeps tensors of its own call (a Linear's input, a tanh's
    output) until ``block_backward``; Inductor sees none of that, and once the step's graph
    has read a buffer for the last time it writes another result into it (``buf8 = buf5;
    del buf5  # reuse``, or in place: ``h + block(h)`` into the block's output). The body's
    backward then reads that result: silently wrong gradients. The eager runner is not
    affected (Python's reference counts keep the storage alive); Inductor's
    ``never_reuse_buffers`` is its own way to keep a buffer out of reuse."""
    from torch._inductor import graph, lowering
    from torch._inductor.virtualized import V

    before = extern_call = lowering.lowerings.get(BLOCK_FORWARD)
    if getattr(before, "_mfsdp_keeps_buffers", False):  # a compile inside this one
        yield
        return
    if extern_call is None:  # what Inductor registers at its first sight of a custom op
        constraint = graph.tag_to_layout_constraint(graph.get_layout_constraint_tag(BLOCK_FORWARD, with_default=True))
        lowering.make_fallback(BLOCK_FORWARD, layout_constraint=constraint, warn=False)
        extern_call = lowering.lowerings[BLOCK_FORWARD]

    def lowered(weights, tensors, *args, **kwargs):
        outputs = extern_call(weights, tensors, *args, **kwargs)
        kernel = outputs[-1].data.data.inputs[0]  # each output (the token last) is a MultiOutput of it
        # Its inputs in argument order, each as the call reads it (a copy where the layout
        # constraint made one). Not the gathered weights: the body lets go of those after the
        # call, and the step frees them as planned.
        read = kernel.inputs[len(weights) : len(weights) + len(tensors)]
        for buffer in (*read, *(out.data.data for out in outputs)):
            V.graph.never_reuse_buffers.add(buffer.get_name())
        return outputs

    lowered._mfsdp_keeps_buffers = True
    lowering.lowerings[BLOCK_FORWARD] = lowered
    try:
        yield
    finally:
        if before is None:
            del lowering.lowerings[BLOCK_FORWARD]
        else:
            lowering.lowerings[BLOCK_FORWARD] = before


# ---- random numbers: a recompute draws what its forward drew ----------------------------------


@torch.library.custom_op(
    # Seeded: two reads are two reads, never merged by common-subexpression elimination.
    "fsdp_compile::rng_state", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def read_rng_state(like: Tensor) -> Tensor:
    """The random generators' state now, for a block call on ``like``'s device: one byte
    tensor on the host (see ``generator_states``)."""
    return torch.cat(generator_states(like.device))


@read_rng_state.register_fake
def _(like) -> Tensor:
    return torch.empty(sum(s.numel() for s in generator_states(like.device)), dtype=torch.uint8)


RNG_STATE = torch.ops.fsdp_compile.rng_state.default
