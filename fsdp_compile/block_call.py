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
      tensors (``_outputs``), and the real call checks its outputs against them.
    - The gathered weights go into the frame as slots (``_slot``): tensors of their own that
      share the gathered storage (a flat's, its members copied out: NOTE: a flat's copies in
      the block call). The frame's autograd graph saves the slots it needs (its partitioner
      recomputes every view of them: ``reshard``), so after the forward each slot lets go of
      the storage (``slot.data``), the step frees the gathered weights as planned, and
      ``block_backward`` points the slots at the weights the step gathered again. Resharding
      after forward holds as in a whole-step graph.
    - The frame's autograd graph waits for its backward in ``_PENDING``, keyed by a token
      tensor the op returns and the step saves for backward; an entry whose token died
      unused (a checkpointed block recomputed in backward, a forward never differentiated) is
      dropped at a later call.
    - A call that activation checkpointing recomputes in the backward runs the body again:
      where the body draws random numbers (dropout), the recompute must draw the forward's.
      The step's graph reads the generators' state just before such a call (``rng_state``),
      the partitioner saves it, and the recompute replays it and puts the generators back,
      as ``torch.utils.checkpoint`` does eagerly (passes ``save_block_rng`` and
      ``replay_block_rng``). Inside a body, AOTAutograd handles its own random ops.

NOTE: a flat's copies in the block call
    A flat parameter (NOTE: flat parameters, in flat_params.py) is gathered as one tensor, its
    members are copied out of it (``split_gathered``), and their gradients are packed back
    rank-major for its one reduce-scatter (``pack_for_reduce_scatter``). The block call copies
    the members out around the body's frame, which takes them as its gathered weights
    (``_body_weights``, ``FlatCopy``); ``block_backward`` returns their gradients one by one,
    and the op's autograd formula packs them, so the pack is a node of the step's graph:
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
"""

from __future__ import annotations

import contextlib
import functools
import operator
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fsdp_compile.bucket_copies import pack_for_reduce_scatter, split_gathered
from fsdp_compile.compat import compiling
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.side_outputs import SideChannel, flatten, stand_ins_of

__all__ = [
    "BlockCall", "FlatCopy", "register_call", "call_record", "BLOCK_FORWARD", "BLOCK_BACKWARD", "BLOCK_GRADED", "RNG_STATE",
]


@dataclass(frozen=True)
class FlatCopy:
    """A gathered flat parameter as a block call hands it to the body and its gradient back
    (NOTE: a flat's copies in the block call)."""

    unpack: tuple
    """``split_gathered``'s arguments after the gathered flat (``FlatLayout.unpack_args``)."""

    @property
    def members(self) -> int:
        return len(self.unpack[1])


@dataclass(frozen=True, eq=False)
class BlockCall:
    """One layer's call of its block, as the step's graph names it (``block_forward``'s
    ``call`` argument indexes these)."""

    block: weakref.ref
    """The block module (its parameters are already gathered: the body reads none)."""
    body: Callable[..., Any]
    """The body function of the block's structure: ``body(block, layout, recipe, side,
    *leaves)`` (``side``: a ``SideChannel`` its hooks' recorders fill)."""
    name: str
    """The body's name, one per structure (``_region_3``)."""
    layout: str
    """How the call's leaves regroup into arguments (a key of regions' call layouts)."""
    recipe: str
    """How the gathered weights become the block's parameters (a key of regions' recipes)."""
    constants: tuple[tuple, ...]
    """Per leaf: ``()`` where a tensor goes, ``(value,)`` for a constant."""
    train: bool
    """Traced with grad enabled: the forward keeps its autograd graph for the backward."""
    backend: weakref.ref
    """The MfsdpBackend that compiles the body's frame (it outlives the step it compiled)."""
    flats: tuple[FlatCopy, ...] = ()
    """The first gathered weights are the block's flat parameters: how each is copied out
    and its gradient packed (NOTE: a flat's copies in the block call)."""
    traced: dict = field(default_factory=dict)
    """Filled by the fake kernel: ``differentiable`` (which tensor leaves need a gradient),
    ``outputs`` (the metadata of the block's tensor outputs, then of its side values: NOTE:
    hooks inside a repeated block), ``form`` (how the block's regroup), ``own`` (how many
    they are), ``side`` (the side values' form), ``cost``: the FLOPs and
    bytes of the body's forward and backward ops (see ``_RooflineCounter``),
    ``saved_bytes``: what its autograd graph keeps for the backward (see ``_saved_bytes``),
    ``held_bytes``: what the call holds while it runs, forward and backward (``_held_bytes``),
    ``random``: whether its forward draws random numbers, and ``graded``: per gathered
    weight, which of its members the backward gives a gradient (see ``_Graded``)."""

    def leaves(self, tensors: list[Tensor], stand_ins: dict[int, Any]) -> list[Any]:
        """The body's leaves: the tensors and constants in place, a cache stand-in where its
        spec is (NOTE: HF caches in a repeated block, in side_outputs.py)."""
        tensors = iter(tensors)
        return [next(tensors) if not c else stand_ins[at][0] if at in stand_ins else c[0] for at, c in enumerate(self.constants)]


_CALLS: list[BlockCall] = []


def register_call(call: BlockCall) -> int:
    """The index ``block_forward`` names ``call`` by."""
    _CALLS.append(call)
    return len(_CALLS) - 1


def call_record(index: int) -> BlockCall:
    return _CALLS[index]


# ---- tracing: what the step's graph sees -----------------------------------------------------

_OUTPUTS: dict[tuple, dict] = {}
"""What a body returns, per structure, call and input layout, outside a compile (the
simulator's step on meta tensors): one run of the block's Python per entry. A compile keeps
its own (``_outputs_of_this_compile``)."""


def _metadata(tensor: Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def _tensors_of(output: Any) -> list[Tensor]:
    """A block's tensor outputs, in order: ``block_forward``'s results before the token."""
    return [output] if isinstance(output, Tensor) else [v for v in output if isinstance(v, Tensor)]


def _form(output: Any) -> tuple:
    """How ``block_forward``'s flat tensors regroup into what the block returned: a tensor,
    or a tuple or list of tensors and constants."""
    if isinstance(output, Tensor):
        return ("tensor",)
    if type(output) in (tuple, list) and not any(isinstance(v, (tuple, list, dict)) for v in output):
        return (type(output).__name__, tuple(() if isinstance(v, Tensor) else (v,) for v in output))
    raise CompileUsageError(
        f"a repeated block returned {type(output).__name__}; mfsdp compiles a block's body on "
        "its own when it returns a tensor, or a tuple or list of tensors and constants. "
        "Compile with options={'regional': False} to trace such blocks inline."
    )


class _RooflineCounter(TorchDispatchMode):
    """What the cost model charges the body's ops, had they been nodes of the step
    (fsdp_compile/schedule.py): FLOPs where torch counts them, else the bytes an op writes."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = self.bytes = 0
        self.random = False
        """Whether an op drew from a random generator (dropout's ``bernoulli_``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.random |= torch.Tag.nondeterministic_seeded in func.tags
        out = func(*args, **kwargs)
        count = flop_registry.get(func.overloadpacket)
        flops = _flops(count, args, kwargs, out) if count is not None else None
        if flops is not None:
            self.flops += flops
        elif isinstance(out, Tensor):
            self.bytes += out.numel() * out.element_size()
        return out


def _flops(count: Callable, args: tuple, kwargs: dict, out: Any) -> int | None:
    """torch's FLOP count of an op, or None where it has none for these shapes (torch 2.11
    counts no grouped-query SDPA: K and V with fewer heads than Q fail its shape check)."""
    try:
        return count(*args, **kwargs, out_val=out)
    except AssertionError:
        return None


def _saved_bytes(outputs: list[Tensor], besides: list[Tensor]) -> Any:
    """What the body's autograd graph keeps from its forward to its backward that the step's
    graph does not see: the tensors its nodes saved (read back from the graph, which leaves
    the cost counters' ops as they are), less the storages of ``besides``, the call's inputs
    (the step saves its tensors and re-gathers its weights) and outputs (the step's own).
    The simulator's memory count charges them from the block's forward to its backward."""
    skip = {StorageWeakRef(t.untyped_storage()) for t in besides}
    saved: dict[StorageWeakRef, Any] = {}
    for node in _graph_nodes(outputs):
        for name in dir(node):
            if name.startswith("_saved_") or name == "saved_tensors":
                value = getattr(node, name)
                for tensor in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(tensor, Tensor):
                        ref = StorageWeakRef(tensor.untyped_storage())
                        if ref not in skip:
                            saved[ref] = tensor.untyped_storage().nbytes()
    return sum(saved.values())


def _graph_nodes(outputs: list[Tensor]) -> Iterator[Any]:
    """Each autograd node ``outputs`` depend on, once."""
    stack, seen = [t.grad_fn for t in outputs], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


def _fake_run(call: BlockCall, weights: list[Tensor], tensors: list[Tensor]) -> dict:
    fake_mode = torch._guards.detect_fake_mode([*weights, *tensors])
    # Static shapes give the same answer in every fake mode (Dynamo's, then AOTAutograd's):
    # one run serves both. Symbolic ones belong to their mode's shape environment.
    symbolic = any(isinstance(s, torch.SymInt) for t in (*weights, *tensors) for s in (*t.shape, *t.stride()))
    key = (call.name, call.layout, call.recipe, call.constants, call.train, id(fake_mode) if symbolic else None,
           tuple(map(str, map(_metadata, weights))), tuple(map(str, map(_metadata, tensors))))
    outputs = _outputs_of_this_compile()
    if key not in outputs:
        # No fake mode: tensors on the meta device (the simulator's step), which run as they are.
        # The backward runs on this thread, as in AOTAutograd's own trace: this is a fake
        # kernel, inside the fake mode's dispatch, and autograd's CUDA worker thread has none
        # of the Python dispatcher's state for it (torch 2.11 on an H100: an internal assert
        # in PythonFallbackKernel.cpp on the first block call).
        with (
            fake_mode or contextlib.nullcontext(),
            _leaving_no_trace(call.block(), fake_mode),
            torch.autograd.set_multithreading_enabled(False),
            compiling(),
        ):
            outputs[key] = _run_on_fakes(call, weights, tensors)
    return outputs[key]


@contextlib.contextmanager
def _leaving_no_trace(block: nn.Module, fake_mode: Any) -> Iterator[None]:
    """The block's Python runs for real on fake tensors, to learn its outputs, and must leave
    the block as it found it; the body's frame makes every update when the step runs, as
    Dynamo replays a traced frame's side effects.

    - Its buffers (BatchNorm's statistics, an EMA, a mask) become fakes for the run: a fake
      mode runs an op whose inputs are all real for real, and BatchNorm's
      ``num_batches_tracked.add_(1)`` would count a batch that never ran. Any other real
      tensor it reads (a global) is converted where an op reads it, as torch does for a
      function Dynamo traces non-strictly.
    - What it assigns to its modules or adds to their containers (a call counter, a cached
      tensor, a buffer registered anew, an entry in a list of statistics) is put back: a
      fake tensor left in a cache would meet the real ones at the next call, and a cache's
      recorded length would skip the real computation.
    - What it keeps there that autograd differentiates (``self.aux_loss = ...``, a list of
      losses) is refused: a gradient reaching the body from outside ``block_backward``
      would find its weights let go of after the call.
    """
    states = [(prefix, module.__dict__, _attributes(module)) for prefix, module in block.named_modules()]
    fakes = {} if fake_mode is None else {  # no fake mode: meta tensors, the simulator's step
        name: fake_mode.from_tensor(b, static_shapes=True) for name, b in block.named_buffers(remove_duplicate=False)
    }
    tls = torch._subclasses.fake_tensor.fake_tensor_tls
    before = tls.allow_non_fake_inputs_override
    tls.allow_non_fake_inputs_override = True
    try:
        with _reparametrize_module(block, fakes):
            yield
        kept = [f"{prefix}.{name}".lstrip(".") for prefix, attributes, saved in states for name in _differentiable_news(attributes, saved)]
    finally:
        tls.allow_non_fake_inputs_override = before
        for _, attributes, saved in states:
            _put_back(attributes, saved)
    if kept:
        raise CompileUsageError(
            f"a repeated block ({type(block).__name__}) keeps a tensor that requires grad in "
            f"{', '.join(kept)} during its forward: its body is compiled on its own, and a "
            "gradient can reach it only through what it returns. Return the tensor from "
            "forward (an auxiliary loss as an output), or compile with "
            "options={'regional': False}."
        )


def _attributes(module: nn.Module) -> dict[str, tuple[Any, Any]]:
    """A module's attributes, each with a copy of its contents where it is a dict, list or
    set (``_parameters``, ``_buffers``, ``_modules``, hooks, a list of statistics), which a
    forward may change in place."""
    return {name: (value, _contents(value)) for name, value in vars(module).items()}


def _differentiable_news(attributes: dict, saved: dict[str, tuple[Any, Any]]) -> Iterator[str]:
    """The attributes the forward set, or added to, with a tensor autograd differentiates."""
    for name, value in attributes.items():
        before, contents = saved.get(name, (None, None))
        if value is not before:
            new = [value]
        elif contents is not None:
            known = {id(v) for v in (contents.values() if isinstance(contents, dict) else contents)}
            new = [v for v in (value.values() if isinstance(value, dict) else value) if id(v) not in known]
        else:
            new = []
        if any(isinstance(v, Tensor) and v.grad_fn is not None for v in new):
            yield name


def _contents(value: Any) -> Any:
    for kind in (dict, list, set):
        if isinstance(value, kind):
            return kind(value)
    return None


def _put_back(attributes: dict, saved: dict[str, tuple[Any, Any]]) -> None:
    for name in [name for name in attributes if name not in saved]:
        del attributes[name]
    for name, (value, contents) in saved.items():
        attributes[name] = value
        if contents is not None:  # the same object: others may hold it
            value.clear()
            (value.extend if isinstance(value, list) else value.update)(contents)


def _outputs_of_this_compile() -> dict[tuple, dict]:
    """The fake runs of the compile under way, kept on its tracing context (Dynamo's, which
    AOTAutograd's trace shares): a recompile runs every block again, so a block changed
    since (an attribute its outputs or their constants depend on) is never read stale."""
    context = torch._guards.TracingContext.try_get()
    if context is None:
        return _OUTPUTS
    if not hasattr(context, "_mfsdp_block_outputs"):
        context._mfsdp_block_outputs = {}
    return context._mfsdp_block_outputs


def _run_on_fakes(call: BlockCall, weights: list[Tensor], tensors: list[Tensor]) -> dict:
    """The block's Python on fake tensors: what it returns, and what its forward and backward
    cost (the backward only when the call trains)."""
    versions = [t._version for t in tensors]
    forward, backward = _RooflineCounter(), _RooflineCounter()
    with torch.no_grad(), forward:
        body_weights = _body_weights(call, weights)
    leaves = [t.detach().requires_grad_(call.train and t.is_floating_point()) for t in (*body_weights, *tensors)]
    count = len(body_weights)
    side, stand_ins = SideChannel(), stand_ins_of(call.constants)
    with _autograd_inside() if call.train else torch.no_grad(), forward:
        output = call.body(
            call.block(), call.layout, call.recipe, side, *leaves[:count], *call.leaves(leaves[count:], stand_ins)
        )
    if any(t._version != v for t, v in zip(leaves[count:], versions)):
        raise CompileUsageError(
            f"a repeated block ({type(call.block()).__name__}) writes in place to a tensor it "
            "was called with; its body cannot be compiled on its own. Compile with "
            "options={'regional': False}, or make the write out of place."
        )
    side_form, side_tensors = flatten(side, stand_ins)
    own = _tensors_of(output)
    flat = [*own, *side_tensors]
    differentiable = [t for t in flat if t.requires_grad]
    saved_bytes = _saved_bytes(differentiable, besides=[*leaves, *flat])
    with _autograd_inside():  # to name the weights' nodes, as the backward's graph does
        graded = _Graded(differentiable, leaves[:count])
    if differentiable:
        with _autograd_inside(), backward:
            torch.autograd.grad(
                differentiable, [leaf for leaf in leaves if leaf.requires_grad],
                [torch.ones_like(t) for t in differentiable], allow_unused=True,
            )
    return {
        "graded": _graded_weights(call, graded.found()),
        "form": _form(output),
        "own": len(own),
        "side": side_form,
        "outputs": [_metadata(t) for t in flat],
        "cost": {"forward": (forward.flops, forward.bytes), "backward": (backward.flops, backward.bytes)},
        "saved_bytes": saved_bytes,
        "held_bytes": _held_bytes(call, weights),
        "random": forward.random,
    }


def _held_bytes(call: BlockCall, weights: list[Tensor]) -> dict[str, int]:
    """What the call holds while it runs, beyond its inputs, outputs and the body's saved
    tensors: the members it copies out of its flats, in the forward and again in the backward
    (NOTE: a flat's copies in the block call)."""
    members = sum(w.numel() * w.element_size() for w, _ in zip(weights, call.flats))
    return {"forward": members, "backward": members}


class _Graded:
    """Which members of each gathered weight a block's backward gives a gradient.

    NOTE: parameters without a gradient
        A parameter autograd gives no gradient (read only under ``torch.no_grad()``, or not
        read at all) keeps ``.grad is None`` in the unsharded model, and optimizers skip it:
        AdamW neither decays it nor advances its state. A repeated block's members share one
        flat buffer and one reduce-scatter, whose backward (``split_gathered``'s) packs zeros
        for a member without gradient; so who has a gradient is found apart, per member, and
        the flat's hand-out (``flat_params._hand_out_grads``) gives those members none.

        Compiled regionally, the body is opaque to the step: its fake run records, on the
        autograd node consuming each gathered weight (the copy-out of a flat, or the ops
        reading a parameter on its own), which outputs the backward reached
        (``traced["graded"]``); the step's backward then gives a weight no member of which
        has a gradient none at all (no reduce-scatter: its ``.grad`` stays None, as at the
        root). Each traced call tells its block's flats which members to hand out; a call
        traced inline (``regional=False``) is fake-run for that alone (``block_graded``). Run
        eagerly, the copy-out's own node says so at each backward (``regions._region_inline``).
    """

    def __init__(self, outputs: list[Tensor], weights: list[Tensor]) -> None:
        self._count = len(weights)
        self._reached: dict[int, tuple[bool, ...]] = {}
        for node, index in _consumers(outputs, weights):
            node.register_prehook(functools.partial(self._record, index))

    def _record(self, index: int, grad_outputs: tuple) -> None:
        flags = tuple(g is not None for g in grad_outputs)
        before = self._reached.get(index, flags)
        # Several nodes read a parameter on its own (one output each): any reached counts.
        self._reached[index] = tuple(map(operator.or_, before, flags)) if len(before) == len(flags) else (True,)

    def found(self) -> list[tuple[bool, ...]]:
        """Per weight: a flag per output of the node reading it (a flat's copy-out has one per
        member; any other reader one); empty for a weight the backward never reached."""
        return [self._reached.get(i, ()) for i in range(self._count)]


def _graded_weights(call: BlockCall, found: list[tuple[bool, ...]]) -> list[tuple[bool, ...]]:
    """``found`` (per weight the body took) per gathered weight: a flat's members one flag
    each, whether the backward reached a node reading it; a weight on its own as found."""
    graded, at = [], 0
    for flat in call.flats:
        graded.append(tuple(any(flags) for flags in found[at : at + flat.members]))
        at += flat.members
    return [*graded, *found[at:]]


def _consumers(outputs: list[Tensor], weights: list[Tensor]) -> Iterator[tuple[Any, int]]:
    """Each autograd node that reads one of ``weights`` (leaves) directly, with the weight's
    index, among the nodes ``outputs`` depend on."""
    accumulators = {_accumulator_of(w): i for i, w in enumerate(weights) if w.requires_grad}
    for node in _graph_nodes(outputs):
        for next_node, _ in node.next_functions:
            if next_node in accumulators:
                yield node, accumulators[next_node]


def _accumulator_of(leaf: Tensor) -> Any:
    """A leaf's ``AccumulateGrad`` node: what the nodes reading it name in ``next_functions``."""
    return leaf.view_as(leaf).grad_fn.next_functions[0][0]


@torch.library.custom_op("fsdp_compile::block_forward", mutates_args=())
def block_forward(
    weights: list[Tensor], tensors: list[Tensor], call: int, rng_state: Tensor | None = None, replay: bool = False
) -> list[Tensor]:
    """The block's outputs, then a token its backward finds the body's autograd graph by.

    ``rng_state`` is what the generators were at as the forward's call began (``rng_state``);
    a recompute of the call in the backward (``replay``) draws from it again."""
    if not replay:
        return _run_forward(_CALLS[call], weights, tensors)
    with _generators_at(rng_state, (*weights, *tensors)[0].device):
        return _run_forward(_CALLS[call], weights, tensors)


@block_forward.register_fake
def _(weights, tensors, call, rng_state=None, replay=False) -> list[Tensor]:
    record = _traced(call, weights, tensors)
    # Dynamo's call comes first and sees the user's tensors; AOTAutograd's come from below
    # autograd, where nothing requires a gradient.
    record.traced.setdefault("differentiable", [t.requires_grad for t in tensors])
    outputs = [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in record.traced["outputs"]]
    return [*outputs, _token_like([*weights, *tensors])]


def _traced(call: int, weights: list[Tensor], tensors: list[Tensor]) -> BlockCall:
    """The call's record, its fake run done; a training call tells the block's flats which
    members get a gradient (see NOTE: parameters without a gradient)."""
    record = _CALLS[call]
    record.traced.update(_fake_run(record, weights, tensors))
    if record.train:
        record.block()._mfsdp_note_graded(record.traced["graded"])
    return record


@torch.library.custom_op("fsdp_compile::block_graded", mutates_args=())
def block_graded(weights: list[Tensor], tensors: list[Tensor], call: int) -> Tensor:
    """Traced, the fake run of a block call traced inline (``regional=False``), for what its
    flats' members get a gradient (see NOTE: parameters without a gradient). Its result is a
    token nobody reads, so Dynamo's dead-code elimination drops the node: nothing runs."""
    return _token_like([*weights, *tensors])


@block_graded.register_fake
def _(weights, tensors, call) -> Tensor:
    _traced(call, weights, tensors)
    return _token_like([*weights, *tensors])


BLOCK_GRADED = torch.ops.fsdp_compile.block_graded.default


@torch.library.custom_op("fsdp_compile::block_backward", mutates_args=())
def block_backward(
    token: Tensor, weights: list[Tensor], tensors: list[Tensor], grads: list[Tensor | None], call: int
) -> list[Tensor]:
    """Gradients of the body's weights (a flat's members one by one: NOTE: a flat's copies in
    the block call), then of the tensors; zeros where none flows."""
    return _run_backward(_CALLS[call], token, weights, tensors, grads)


@block_backward.register_fake
def _(token, weights, tensors, grads, call) -> list[Tensor]:
    return [torch.empty_like(t) for t in (*_body_weights(_CALLS[call], weights), *tensors)]


def _save(ctx, inputs, output) -> None:
    weights, tensors, ctx.call, rng_state, replay = inputs
    # The dispatcher drops trailing arguments equal to their defaults, and the backward
    # answers for the arguments it kept.
    ctx.kept = 2 if replay else int(rng_state is not None)
    ctx.counts = (len(weights), len(tensors))
    ctx.differentiable = [t.requires_grad for t in tensors]
    ctx.save_for_backward(output[-1], *weights, *tensors)


def _backward(ctx, grads: list[Tensor | None]):
    token, *saved = ctx.saved_tensors
    weights, tensors = saved[: ctx.counts[0]], saved[ctx.counts[0] :]
    call = _CALLS[ctx.call]
    computed = block_backward(token, weights, tensors, list(grads[:-1]), ctx.call)
    by_weight, by_tensor = _packed(call, weights, computed), computed[len(computed) - len(tensors) :]
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


def lower_block_calls_keeping_their_buffers() -> None:
    """Inductor lowers ``block_forward`` as it lowers any custom op (an extern call, with the
    op's layout constraint), and never reuses the buffers the call reads or returns.

    The body's autograd graph keeps tensors of its own call (a Linear's input, a tanh's
    output) until ``block_backward``; Inductor sees none of that, and once the step's graph
    has read a buffer for the last time it writes another result into it (``buf8 = buf5;
    del buf5  # reuse``, or in place: ``h + block(h)`` into the block's output). The body's
    backward then reads that result: silently wrong gradients. The eager runner is not
    affected (Python's reference counts keep the storage alive); Inductor's
    ``never_reuse_buffers`` is its own way to keep a buffer out of reuse."""
    from torch._inductor import graph, lowering
    from torch._inductor.virtualized import V

    if getattr(lowering.lowerings.get(BLOCK_FORWARD), "_mfsdp_keeps_buffers", False):
        return
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


def _token_like(tensors: list[Tensor]) -> Tensor:
    return torch.empty(1, dtype=torch.uint8, device=tensors[0].device)


# ---- random numbers: a recompute draws what its forward drew ----------------------------------


def _generator_states(device: torch.device) -> list[Tensor]:
    """The states ``torch.utils.checkpoint`` keeps for a region on ``device``: the CPU
    generator's, then the device's own where it is an accelerator."""
    states = [torch.get_rng_state()]
    if device.type not in ("cpu", "meta"):
        states.append(torch.get_device_module(device.type).get_rng_state(device))
    return states


@torch.library.custom_op(
    # Seeded: two reads are two reads, never merged by common-subexpression elimination.
    "fsdp_compile::rng_state", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def read_rng_state(like: Tensor) -> Tensor:
    """The random generators' state now, for a block call on ``like``'s device: one byte
    tensor on the host (see ``_generator_states``)."""
    return torch.cat(_generator_states(like.device))


@read_rng_state.register_fake
def _(like) -> Tensor:
    return torch.empty(sum(s.numel() for s in _generator_states(like.device)), dtype=torch.uint8)


RNG_STATE = torch.ops.fsdp_compile.rng_state.default


def _set_generator_states(states: list[Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.get_device_module(device.type).set_rng_state(states[1], device)


@contextlib.contextmanager
def _generators_at(state: Tensor, device: torch.device) -> Iterator[None]:
    """The generators at ``state`` (read by ``rng_state``) inside, back where they were after."""
    current = _generator_states(device)
    _set_generator_states(list(state.split([s.numel() for s in current])), device)
    try:
        yield
    finally:
        _set_generator_states(current, device)


# ---- running: the body as a frame of its own ----------------------------------------------

_PENDING: dict[int, tuple] = {}
"""A forward's autograd graph, by its token's address, until its backward takes it."""
_SWEEP_AT = [64]


def _keep(token: Tensor, entry: tuple) -> None:
    if len(_PENDING) >= _SWEEP_AT[0]:
        for address in [a for a, (ref, *_) in _PENDING.items() if ref.expired()]:
            del _PENDING[address]
        _SWEEP_AT[0] = max(64, 2 * len(_PENDING))
    _PENDING[token.data_ptr()] = (StorageWeakRef(token.untyped_storage()), *entry)


@contextlib.contextmanager
def _autograd_inside() -> Iterator[None]:
    """Autograd recorded inside a custom op's kernel: the dispatcher runs kernels below the
    autograd keys, which it excludes for the call; the body's frame needs them back."""
    keys = [
        k for k in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
        if torch._C._dispatch_tls_is_dispatch_key_excluded(k)
    ]
    for key in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for key in keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, True)


def _slot(weight: Tensor) -> Tensor:
    """A leaf of its own over ``weight``'s storage (see NOTE: one op per block call)."""
    slot = torch.empty(0, dtype=weight.dtype, device=weight.device)
    slot.data = weight
    slot._mfsdp_gathered = True  # the body's plan: a gathered weight (fsdp_compile/planner.py)
    return slot.requires_grad_(weight.is_floating_point())


def _release(slots: list[Tensor]) -> None:
    for slot in slots:
        slot.data = torch.empty(0, dtype=slot.dtype, device=slot.device)


def _flat_outputs(call: BlockCall, output: Any, side: tuple[tuple, list[Tensor]], inputs: list[Tensor]) -> list[Tensor]:
    """The body's tensor outputs, then its side values' (``side``: their form and tensors),
    as the step's graph was traced to take them: same shapes and same constants beside them
    (an error otherwise) and, copied where the compiled body chose others, same strides.
    Copied too where one shares storage with the call's ``inputs`` or an earlier output (a
    block that passes a tensor through, or returns two chunks of one): see ``_unaliased``."""
    side_form, side_tensors = side
    if side_form != call.traced["side"]:
        raise RuntimeError(
            f"a {type(call.block()).__name__} layer's hooks or cache writes inside the block "
            f"gave {side_form} where its compiled step was traced with {call.traced['side']}: "
            "this layer differs from the one its body was traced for. Compile with "
            "options={'regional': False}."
        )
    if _form(output) != call.traced["form"]:
        # The step's graph holds the constants the block returned while it was traced, and
        # its guards do not see what they came from (the body's own frame does).
        raise RuntimeError(
            f"a {type(call.block()).__name__} layer returned {_form(output)[1:]} beside its "
            f"tensors where its compiled step was traced with {call.traced['form'][1:]}: the "
            "step keeps the constants a block returns. Return such a value as a tensor, or "
            "compile with options={'regional': False} (then Dynamo guards on it)."
        )
    flat = [*_tensors_of(output), *side_tensors]
    expected = call.traced["outputs"]
    got = [_metadata(t) for t in flat]
    if len(got) != len(expected) or any(
        g[2:] != e[2:] or len(g[0]) != len(e[0]) or not all(_agrees(a, b) for a, b in zip(e[0], g[0]))
        for g, e in zip(got, expected)
    ):
        raise RuntimeError(
            f"a {type(call.block()).__name__} layer returned {got} where its compiled step "
            f"expects {expected}: this layer differs from the one its body was traced for in "
            "something its outputs depend on. Compile with options={'regional': False}."
        )
    strides = [stride for _, stride, *_ in expected]
    strided = [_strided_as(t, stride) for t, stride in zip(flat, strides)]
    return _unaliased(strided, inputs, lambda i, t: _copy_strided(t, strides[i]))


def _agrees(traced: Any, real: int) -> bool:
    return isinstance(traced, torch.SymInt) or traced == real


def _strided_as(tensor: Tensor, stride: tuple) -> Tensor:
    if any(isinstance(s, torch.SymInt) for s in stride) or tensor.stride() == stride or tensor.numel() <= 1:
        return tensor
    return _copy_strided(tensor, stride)


def _copy_strided(tensor: Tensor, stride: tuple) -> Tensor:
    if any(isinstance(s, torch.SymInt) for s in stride):
        return tensor.clone()
    return torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def _unaliased(results: list[Tensor], arguments: list[Tensor], copy: Callable[[int, Tensor], Tensor]) -> list[Tensor]:
    """``results``, each that shares storage with one of ``arguments`` or with an earlier
    result replaced by ``copy(index, result)``. A custom op's results may not alias its
    arguments or each other (torch checks it at every call, Inductor plans buffers on it),
    and a body's may: a block that passes a tensor through or returns two chunks of one, a
    gradient autograd hands back as it came (the tensor a block passed through, or both
    terms of a sum)."""
    taken = {_storage(t) for t in arguments}
    fresh = []
    for index, result in enumerate(results):
        fresh.append(copy(index, result) if _storage(result) in taken else result)
        taken.add(_storage(fresh[-1]))
    return fresh


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _body_weights(call: BlockCall, weights: list[Tensor]) -> list[Tensor]:
    """What the body takes for the gathered ``weights``: each flat's members copied out, then
    the weights on their own (NOTE: a flat's copies in the block call)."""
    members = [m for weight, flat in zip(weights, call.flats) for m in split_gathered(weight, *flat.unpack)]
    return [*members, *weights[len(call.flats) :]]


def _packed(call: BlockCall, weights: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    """The gathered ``weights``' gradients from ``block_backward``'s: each flat's members'
    packed (NOTE: a flat's copies in the block call), then those of the weights on their own."""
    packed, at = [], 0
    for weight, flat in zip(weights, call.flats):
        members = grads[at : at + flat.members]
        packed.append(pack_for_reduce_scatter(members, flat.unpack[0]).view(weight.shape))
        at += flat.members
    return [*packed, *grads[at : at + len(weights) - len(call.flats)]]


def _run_forward(call: BlockCall, weights: list[Tensor], tensors: list[Tensor]) -> list[Tensor]:
    if "outputs" not in call.traced:
        # Dynamo ran the call instead of tracing it: its fake run failed, and Dynamo broke the
        # graph there (a data-dependent op in the block, say), swallowing the reason.
        raise CompileUsageError(
            f"a repeated {type(call.block()).__name__}'s body could not be run on fake tensors "
            "while the step was traced (TORCH_LOGS=graph_breaks shows why; a data-dependent "
            "op, such as a loop over the experts a router picked, is one cause), so it cannot "
            "be compiled on its own. Compile with options={'regional': False}."
        )
    frame = call.backend().frame(call.name, call.body)
    block = call.block()
    token = _token_like([*weights, *tensors])
    side, stand_ins = SideChannel(), stand_ins_of(call.constants)
    if not call.train:
        with torch.no_grad():
            output = frame(
                block, call.layout, call.recipe, side, *_body_weights(call, weights), *call.leaves(tensors, stand_ins)
            )
        outputs = _flat_outputs(call, output, flatten(side, stand_ins), [*weights, *tensors])
        return [*(t.detach() for t in outputs), token]
    slots = [_slot(w) for w in _body_weights(call, weights)]
    inputs = [t.detach().requires_grad_(d) for t, d in zip(tensors, call.traced["differentiable"])]
    with _autograd_inside():
        output = frame(block, call.layout, call.recipe, side, *slots, *call.leaves(inputs, stand_ins))
        outputs = _flat_outputs(call, output, flatten(side, stand_ins), [*weights, *tensors])
    _release(slots)
    _keep(token, (outputs, slots, inputs))
    return [*(t.detach() for t in outputs), token]


def _run_backward(
    call: BlockCall, token: Tensor, weights: list[Tensor], tensors: list[Tensor], grads: list[Tensor | None]
) -> list[Tensor]:
    # backward(retain_graph=True) differentiates the step again later: the body's autograd
    # graph stays for it, as the step's does.
    retained = torch._C._current_graph_task_id() != -1 and torch._C._autograd._get_current_graph_task_keep_graph()
    _, outputs, slots, inputs = _PENDING[token.data_ptr()] if retained else _PENDING.pop(token.data_ptr())
    for slot, weight in zip(slots, _body_weights(call, weights)):
        slot.data = weight
    leaves = [*slots, *inputs]
    differentiable = [leaf for leaf in leaves if leaf.requires_grad]
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    computed = [None] * len(differentiable)
    if pairs:
        with _autograd_inside():
            computed = torch.autograd.grad(
                [o for o, _ in pairs], differentiable, [g for _, g in pairs], allow_unused=True, retain_graph=retained
            )
    by_leaf = {id(leaf): grad for leaf, grad in zip(differentiable, computed)}
    found = [by_leaf.get(id(leaf)) for leaf in leaves]
    # Zeros where none flows, shaped as the leaf (a slot's shape goes with its storage).
    found = [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(found, leaves)]
    arguments = [token, *weights, *tensors, *(g for g in grads if g is not None)]
    results = _unaliased(found, arguments, lambda i, g: torch.empty_like(leaves[i]).copy_(g))
    _release(slots)
    return results
