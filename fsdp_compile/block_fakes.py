"""A block call while the step's graph is traced: the block's Python run once per structure and
input layout on fake tensors, which says the shapes of its outputs, its cost (FLOPs, bytes
saved for backward, bytes held) and which of its weights get a gradient (NOTE: parameters
without a gradient), leaving the block as it found it."""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, get_plain_tensors
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import flop_registry

from fsdp_compile.block_record import BlockCall, output_form, tensor_metadata, tensors_of
from fsdp_compile.block_runtime import (
    autocast_as,
    autograd_inside,
    body_weights,
    dtensor_spec,
    float8_weights,
    local_tensors,
    placed_inputs,
    spec_key,
    transforms_inside,
)
from fsdp_compile.compat import compiling
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.side_outputs import SideChannel, flatten, stand_ins_of



class _RooflineCounter(TorchDispatchMode):
    """What the cost model charges the body's ops, had they been nodes of the step
    (fsdp_compile/cost_model.py): FLOPs where torch counts them, else the bytes an op writes (a
    view writes none).

    A tensor-parallel body computes on DTensors, whose ops this mode sees at their global
    shapes (tp times this rank's work): each is charged as its local pieces, the tensors
    DTensor computes on here. (Declining them, for DTensor to run them on the pieces,
    counted the global shapes too on torch 2.11, whose sharding propagation runs each op
    on fake global tensors under this mode.)"""

    def __init__(self) -> None:
        super().__init__()
        self.flops = self.bytes = 0
        self.random = False
        """Whether an op drew from a random generator (dropout's ``bernoulli_``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.random |= torch.Tag.nondeterministic_seeded in func.tags
        out = func(*args, **kwargs)
        args, kwargs, local = tree_map_only(DTensor, operator.attrgetter("_local_tensor"), (args, kwargs, out))
        count = flop_registry.get(func.overloadpacket)
        flops = _flops(count, args, kwargs, local) if count is not None else None
        if flops is not None:
            self.flops += flops
        elif isinstance(local, Tensor) and not func.is_view:
            self.bytes += local.numel() * local.element_size()
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
                for tensor in _plain(value if isinstance(value, (tuple, list)) else (value,)):
                    ref = StorageWeakRef(tensor.untyped_storage())
                    if ref not in skip:
                        saved[ref] = tensor.untyped_storage().nbytes()
    return sum(saved.values())


def _plain(values: Any) -> Iterator[Tensor]:
    """The plain tensors among ``values``, a tensor subclass's inner ones for it (a float8
    weight's data and scale)."""
    for value in values:
        if isinstance(value, Tensor):
            yield from (t for t in get_plain_tensors(value, out=[]) if isinstance(t, Tensor))


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


def fake_run(call: BlockCall, weights: list[Tensor], tensors: list[Tensor], copied_out: bool = False) -> dict:
    fake_mode = torch._guards.detect_fake_mode([*weights, *tensors])
    # Static shapes give the same answer in every fake mode (Dynamo's, then AOTAutograd's):
    # one run serves both. Symbolic ones belong to their mode's shape environment.
    symbolic = any(isinstance(s, torch.SymInt) for t in (*weights, *tensors) for s in (*t.shape, *t.stride()))
    key = (call.name, call.flags, call.layout, call.recipe.key, call.constants, call.train, call.autocast, id(fake_mode) if symbolic else None,
           tuple(map(str, map(tensor_metadata, weights))), tuple(map(str, map(tensor_metadata, tensors))),
           tuple(_differentiable(call, tensors)), copied_out, spec_key(call.traced.get("tensor_specs")))
    outputs = _fake_runs(call)
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
            outputs[key] = _run_on_fakes(call, weights, tensors, copied_out)
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


def _fake_runs(call: BlockCall) -> dict[tuple, dict]:
    """The fake runs of the compile under way, kept on its tracing context (Dynamo's, which
    AOTAutograd's trace shares): a recompile runs every block again, so a block changed
    since (an attribute its outputs or their constants depend on) is never read stale.
    Outside a compile (the step's graphs run on the meta device), the backend's."""
    context = torch._guards.TracingContext.try_get()
    if context is None:
        return call.backend().meta_runs
    if not hasattr(context, "_mfsdp_block_outputs"):
        context._mfsdp_block_outputs = {}
    return context._mfsdp_block_outputs


def _differentiable(call: BlockCall, tensors: list[Tensor]) -> list[bool]:
    """Which of the call's tensors the user's program differentiates: as Dynamo's call saw
    them (``block_forward``'s fake kernel records it first), else as they are."""
    return call.traced.get("differentiable") or [t.requires_grad for t in tensors]


def _run_on_fakes(call: BlockCall, weights: list[Tensor], tensors: list[Tensor], copied_out: bool) -> dict:
    """The block's Python on fake tensors: what it returns, and what its forward and backward
    cost (the backward only when the call trains)."""
    forward, backward = _RooflineCounter(), _RooflineCounter()
    with torch.no_grad(), forward:
        inputs = body_weights(call, weights, copied_out)
    weights_differentiate = [call.train and t.is_floating_point() for t in inputs]
    flags = [*weights_differentiate, *(call.train and d for d in _differentiable(call, tensors))]
    leaves = [t.detach().requires_grad_(d) for t, d in zip((*inputs, *tensors), flags)]
    count = len(inputs)
    with autograd_inside():
        # A differentiable input the block writes in place is a leaf's copy, as the block's
        # caller hands it a non-leaf: the write is then the block's to be refused, not autograd's.
        given = [leaf.clone() if leaf.requires_grad else leaf for leaf in leaves[count:]]
        placed = placed_inputs(call, given)
    # What the body gets, as it is: a tensor written before the call (``h *= 2``) has a version
    # of its own, and a write to a DTensor raises its wrapper's.
    versions = [t._version for t in placed]
    side, stand_ins = SideChannel(), stand_ins_of(call.constants)
    try:
        # Autograd's keys back without training too: their in-place kernel raises the versions.
        with autograd_inside(), contextlib.nullcontext() if call.train else torch.no_grad(), \
                autocast_as(call.autocast), transforms_inside(), forward:
            body, graded_leaves = float8_weights(call, leaves[:count], call.train)
            output = call.body(call.block(), call.layout, call.recipe.key, side, *body, *call.leaves(placed, stand_ins))
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        # See NOTE: a block fake tensors cannot run.
        call.backend().unfakeable.add(call.name)
        _say_unfakeable(type(call.block()).__name__, error.func)
        raise
    writes_inputs = any(t._version != v for t, v in zip(placed, versions))
    side_form, side_tensors = flatten(side, stand_ins)
    own = tensors_of(output)
    returned = [*own, *side_tensors]
    if any(isinstance(t, DTensor) and any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride())) for t in returned):
        raise CompileUsageError(
            f"a repeated block ({type(call.block()).__name__}) returns a DTensor (a "
            "parallelize_module style with use_local_output=False) of symbolic sizes (the step "
            "is compiled with dynamic shapes): its compiled body returns local tensors, which "
            "the step reads as that DTensor again only from a global shape that is a number. "
            "Compile with dynamic=False, return local tensors (use_local_output=True), or "
            "compile with options={'regional': False} to trace such blocks inline."
        )
    with autograd_inside() if call.train else torch.no_grad():
        flat = local_tensors(returned)  # NOTE: DTensors at a block call, in block_call.py
    differentiable = [t for t in flat if t.requires_grad]
    saved_bytes = _saved_bytes(differentiable, besides=[*leaves, *flat])
    with autograd_inside():  # to name the weights' nodes, as the backward's graph does
        graded = _Graded(differentiable, graded_leaves)
    if differentiable:
        with autograd_inside(), backward:
            torch.autograd.grad(
                differentiable, [leaf for leaf in (*graded_leaves, *leaves[count:]) if leaf.requires_grad],
                [torch.ones_like(t) for t in differentiable], allow_unused=True,
            )
    return {
        "graded": _graded_weights(call, graded.found()),
        "form": output_form(output),
        "own": len(own),
        "side": side_form,
        "outputs": [tensor_metadata(t) for t in flat],
        "output_specs": [dtensor_spec(t) for t in returned],
        "differentiable_outputs": [t.requires_grad for t in flat],
        "cost": {"forward": (forward.flops, forward.bytes), "backward": (backward.flops, backward.bytes)},
        "saved_bytes": saved_bytes,
        "held_bytes": held_bytes(call, weights, copied_out),
        "random": forward.random,
        "writes_inputs": writes_inputs,
    }


def refuse_input_writes(call: BlockCall) -> None:
    """Raised for a call whose body would be compiled on its own (traced inline, the write is
    the step's like any other) when its fake run wrote in place to a tensor it was called with."""
    if call.traced["writes_inputs"]:
        raise CompileUsageError(
            f"a repeated block ({type(call.block()).__name__}) writes in place to a tensor it "
            "was called with; its body cannot be compiled on its own. Compile with "
            "options={'regional': False}, or make the write out of place."
        )


# NOTE: a block fake tensors cannot run
#     A block whose forward reads tensor values (HF JetMoE's router: ``expert_size.tolist()``)
#     cannot run on fake tensors: nothing would say its outputs, and its body cannot be
#     compiled on its own. Its fake run, in the block call's fake kernel as Dynamo traces the
#     step, fails; the backend keeps the body's name (``MfsdpBackend.unfakeable``), and Dynamo
#     breaks the graph at the call and traces the frame again, where ``_block_call`` (in
#     regions.py) finds the name: the call is traced inline, each parameter gathered by its
#     own read, as with ``regional=False``. The step computes what eager does, with Dynamo's
#     graph breaks in the block (each said). The backend keeps the name: another
#     ``torch.compile`` of the model tries its bodies again.


def _say_unfakeable(block: str, op: Any) -> None:
    """Said once per block class and op (Python's warnings keep the first)."""
    warnings.warn(
        f"a repeated {block}'s forward reads tensor values ({op}: a data-dependent op, such "
        "as a loop over the experts a router picked), which fake tensors cannot run, so its "
        "body cannot be compiled on its own: each of its calls is traced inline in the step, "
        "as with options={'regional': False}, with Dynamo's graph breaks there (said below). "
        "A layer that computes without reading values (a fixed-shape expert dispatch) is "
        "compiled once for all layers.",
        stacklevel=2,
    )


def held_bytes(call: BlockCall, weights: list[Tensor], copied_out: bool = False) -> dict[str, int]:
    """What the call holds while it runs, beyond its inputs, outputs and the body's saved
    tensors: the members it copies out of its flats, in the forward and again in the backward
    (NOTE: a flat's copies in the block call); none where the step's graph copied them out."""
    members = 0 if copied_out else sum(w.numel() * w.element_size() for w, _ in zip(weights, call.flats))
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
        has a gradient none at all, and the marker's backward takes that None as it is, not
        as zeros (``markers._unshard_setup_context``): no reduction runs for it and its ``.grad``
        stays None, as at the root. Each traced call tells its block's flats which members to
        hand out; a call traced inline (``regional=False``) is fake-run for that alone
        (``block_graded``). Run eagerly, the copy-out's own node says so at each backward
        (``region_body.region_inline``). Layers alike in structure may still differ in a flag
        (``self.frozen = True`` on one: its gate read under ``torch.no_grad()``), so a fake
        run serves only calls whose block holds the same flags (``block_record.python_flags``:
        bools, strings, enums, Nones; not a number, nor a flag inside a container). The
        region's wrapper reads the flags where Dynamo guards them (not numpy's bools, which
        Dynamo takes as no constant), so a flag changed after the step compiled traces it
        again. As each version of the step may run again later, each body's backward tells
        its flats what its call's fake run found as it runs (``run_backward``), added to what
        the others found since the flat's last hand-out (a layer called twice, micro-batches
        accumulated); each graph also tells them as it starts, for calls traced inline
        (``note_traced_grading``; for those, two versions' backwards after both forwards are
        handed out as the later graph found), and drops what no hand-out took. An attribute
        the step's own code sets before a call (of the block's modules, or of an object one
        holds) is written only after the step's graph ran, so such a call is traced inline
        (``block_record.written_in_trace``).
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
