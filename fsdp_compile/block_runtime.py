"""A block call run for real: the body's frame under autograd with the gathered weights as
slots, its graph kept from the forward to the backward, its outputs unaliased from its
inputs, and the generators' states a checkpointed call replays (NOTE: one op per block call,
in block_call.py)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_compile.block_record import BlockCall, output_form, tensor_metadata, tensors_of
from fsdp_compile.bucket_copies import pack_for_reduce_scatter, split_gathered
from fsdp_compile.errors import CompileUsageError
from fsdp_compile.flat_params import note_block_graded
from fsdp_compile.float8 import float8_from_parts
from fsdp_compile.side_outputs import SideChannel, flatten, stand_ins_of


def generator_states(device: torch.device) -> list[Tensor]:
    """The states ``torch.utils.checkpoint`` keeps for a region on ``device``: the CPU
    generator's, then the device's own where it is an accelerator."""
    states = [torch.get_rng_state()]
    if device.type not in ("cpu", "meta"):
        states.append(torch.get_device_module(device.type).get_rng_state(device))
    return states


def _set_generator_states(states: list[Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.get_device_module(device.type).set_rng_state(states[1], device)


@contextlib.contextmanager
def generators_at(state: Tensor, device: torch.device) -> Iterator[None]:
    """The generators at ``state`` (read by ``rng_state``) inside, back where they were after."""
    current = generator_states(device)
    _set_generator_states(list(state.split([s.numel() for s in current])), device)
    try:
        yield
    finally:
        _set_generator_states(current, device)


# NOTE: autocast in a block call. A user's `torch.autocast` around the step (or inside the
# model's forward) must reach the block's ops as it does in eager. Dynamo does not put an
# ambient autocast into the step's graph: AOTAutograd traces the graph under it, bakes the
# casts in, and runs the compiled graph with autocast off, so an op of ours inside it sees
# autocast off and would run the block's matmuls in the parameters' dtype. The state is read
# at the call while Dynamo traces it (`_block_call` runs, rather than traced, in Dynamo, and
# sees an autocast entered inside the frame too) and every run of the body re-enters it: the
# forward, its fake run and a checkpointed call's recompute. The body's frame guards on it
# like any frame, so a step under autocast and one without compile a body each.


def autocast_state() -> tuple:
    """What ``torch.autocast`` is set to on this thread: ``(device_type, enabled, dtype)`` per
    device type that has autocast, then whether casts are cached."""
    devices = tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in torch._C._autocast_supported_devices()
    )
    return (*devices, torch.is_autocast_cache_enabled())


@contextlib.contextmanager
def autocast_as(state: tuple) -> Iterator[None]:
    """Autocast set to ``state`` (``autocast_state``'s) inside, as it was after."""
    if not state:  # a call recorded outside a trace (the simulator's step on meta tensors)
        yield
        return
    *devices, cache_enabled = state
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in devices:
            # Only where it differs: a device type with no autocast module (privateuseone
            # without a backend) refuses even a disabled context.
            if (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) != (enabled, dtype):
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled))
        yield


class PendingGraphs:
    """The block calls' autograd graphs from their forward until their backward takes them, by
    their token's address; a backend's (``MfsdpBackend.pending``). A token freed with no
    backward run (a validation forward with gradients on, an exception before the backward)
    leaves an entry the next sweep drops: at the start of each run of a graph with block
    calls (``CompiledGraph.compile``), so such a forward's activations live no longer than
    until the next step begins."""

    def __init__(self) -> None:
        self._graphs: dict[int, tuple] = {}

    def sweep(self) -> None:
        """Drop the entries whose token died: no backward can take them."""
        for address in [a for a, (ref, *_) in self._graphs.items() if ref.expired()]:
            del self._graphs[address]

    def keep(self, token: Tensor, entry: tuple) -> None:
        self._graphs[token.data_ptr()] = (StorageWeakRef(token.untyped_storage()), *entry)

    def take(self, token: Tensor, keep: bool) -> tuple:
        """The entry ``token`` names, left in place where the backward runs again (``keep``)."""
        _, *entry = self._graphs[token.data_ptr()] if keep else self._graphs.pop(token.data_ptr())
        return tuple(entry)

    def __len__(self) -> int:
        return len(self._graphs)


@contextlib.contextmanager
def _dispatch_keys_back(keys: tuple) -> Iterator[None]:
    """The dispatch ``keys`` that the dispatcher excludes inside a custom op's kernel
    (everything above the Python key, as for a ``__torch_dispatch__`` handler) active again
    for the block's Python run there."""
    excluded = [k for k in keys if torch._C._dispatch_tls_is_dispatch_key_excluded(k)]
    for key in excluded:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key in excluded:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, True)


@contextlib.contextmanager
def autograd_inside() -> Iterator[None]:
    """Autograd recorded inside a custom op's kernel: the dispatcher runs kernels below the
    autograd keys, which it excludes for the call; the body's frame needs them back."""
    with _dispatch_keys_back((torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)):
        with torch.enable_grad():
            yield


def transforms_inside() -> contextlib.AbstractContextManager:
    """torch.func's transforms (``vmap``) usable inside a custom op's kernel: their keys are
    excluded there too, and a block may call one (HF's Mamba layers scan with
    ``associative_scan``, which maps its combine function with ``vmap`` on the CPU)."""
    keys = torch._C.DispatchKey
    return _dispatch_keys_back((
        keys.FuncTorchDynamicLayerFrontMode, keys.FuncTorchDynamicLayerBackMode, keys.FuncTorchBatched,
        keys.FuncTorchVmapMode, keys.FuncTorchGradWrapper,
    ))


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
    if output_form(output) != call.traced["form"]:
        # The step's graph holds the constants the block returned while it was traced, and
        # its guards do not see what they came from (the body's own frame does).
        raise RuntimeError(
            f"a {type(call.block()).__name__} layer returned {output_form(output)[1:]} beside its "
            f"tensors where its compiled step was traced with {call.traced['form'][1:]}: the "
            "step keeps the constants a block returns. Return such a value as a tensor, or "
            "compile with options={'regional': False} (then Dynamo guards on it)."
        )
    flat = local_tensors([*tensors_of(output), *side_tensors])
    expected = call.traced["outputs"]
    got = [tensor_metadata(t) for t in flat]
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


def _strided_like(grad: Tensor, leaf: Tensor) -> Tensor:
    """``grad`` with the strides of ``torch.empty_like(leaf)``, which ``block_backward``'s fake
    promises the step's graph (Inductor asserts them): autograd hands a gradient back in the
    layout its last op made (HF T5's position bias: a permuted one for a contiguous input)."""
    if grad.numel() <= 1 or grad.is_contiguous() and leaf.is_contiguous():
        return grad
    stride = torch.empty_like(leaf, device="meta").stride()
    return grad if grad.stride() == stride else _copy_strided(grad, stride)


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


def body_weights(call: BlockCall, weights: list[Tensor], copied_out: bool = False) -> list[Tensor]:
    """What the body takes for the gathered ``weights``: each flat's members copied out, then
    the weights on their own (NOTE: a flat's copies in the block call); ``weights`` as they
    are where the step's graph copied them out (``copied_out``)."""
    if copied_out:
        return weights
    members = [m for weight, flat in zip(weights, call.flats) for m in split_gathered(weight, *flat.unpack)]
    return [*members, *weights[len(call.flats) :]]


def dtensor_spec(tensor: Tensor) -> tuple | None:
    """A DTensor's mesh, placements, shape and stride (NOTE: DTensors at a block call, in
    block_call.py); None for a plain tensor."""
    if not isinstance(tensor, DTensor):
        return None
    # Placements of their own: the DTensor's may be objects a layer's hooks hold (a style's
    # output layouts), which the body's frame would then guard by identity, one compile a layer.
    placements = tuple(copy.copy(p) for p in tensor.placements)
    # Traced, the mesh is torch's stand-in for it (a FakeScriptObject); the run takes a mesh.
    mesh = getattr(tensor.device_mesh, "real_obj", tensor.device_mesh)
    return (mesh, placements, tuple(tensor.shape), tuple(tensor.stride()))


def gradient_spec(spec: tuple | None) -> tuple | None:
    """The spec of a DTensor input's gradient as ``DTensor.from_local``'s backward gives it: a
    ``Partial`` placement replicated (torch's ``_normalize_placements_for_grad``)."""
    if spec is None:
        return None
    mesh, placements, shape, stride = spec
    return (mesh, tuple(Replicate() if p.is_partial() else p for p in placements), shape, stride)


def spec_key(specs: list[tuple | None] | None) -> tuple:
    """``specs`` as a key of values only (a mesh by its shape and dimension names)."""
    return tuple(
        None if s is None else (tuple(s[0].shape), s[0].mesh_dim_names, tuple(map(repr, s[1])), s[2], s[3])
        for s in specs or ()
    )


def as_dtensors(tensors: list[Tensor], specs: list[tuple | None]) -> list[Tensor]:
    """Each of ``tensors`` (local) as the DTensor its spec says; as it is where none."""
    return [
        t if spec is None else DTensor.from_local(t, spec[0], spec[1], run_check=False, shape=spec[2], stride=spec[3])
        for t, spec in zip(tensors, specs)
    ]


def placed_inputs(call: BlockCall, tensors: list[Tensor]) -> list[Tensor]:
    """The call's tensors as the block was called with them: DTensors again where they were
    (NOTE: DTensors at a block call, in block_call.py)."""
    specs = call.traced.get("tensor_specs")
    return tensors if specs is None else as_dtensors(tensors, specs)


def local_tensors(tensors: list[Tensor]) -> list[Tensor]:
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _float8_parts(call: BlockCall, weights: list[Tensor]) -> tuple[list[Tensor], list[tuple | None], list]:
    """``body_weights``' list as the flats' members, then per weight gathered on its own its
    float8 cast or None and its tensors: a float8 weight's data and scale, or the weight
    (NOTE: float8 weights in a block call, in block_call.py)."""
    tail = len(call.float8) + sum(read is not None for read in call.float8)
    head, rest = list(weights[: len(weights) - tail]), iter(weights[len(weights) - tail :])
    return head, list(call.float8), [(next(rest), next(rest)) if read else (next(rest),) for read in call.float8]


def float8_weights(call: BlockCall, weights: list[Tensor], train: bool) -> tuple[list[Tensor], list[Tensor]]:
    """What the body's frame takes for ``body_weights``' list, each float8 weight's data and
    scale as one ``Float8TrainingTensor``, and the leaves whose gradients are the weights'
    (``train``), a float8 weight's its carrier (NOTE: float8 weights in a block call, in
    block_call.py)."""
    if not call.float8:
        return weights, weights
    frame, reads, parts = _float8_parts(call, weights)
    graded = list(frame)
    for read, tensors in zip(reads, parts):
        if read is None:
            frame.append(tensors[0])
            graded.append(tensors[0])
            continue
        data, weight_scale = (t.requires_grad_(False) for t in tensors)  # leaves: slots, or a fake run's
        carrier = _carrier(data, read[1]).requires_grad_(True) if train else None
        weight = float8_from_parts(data, weight_scale, *read, carrier)
        weight._mfsdp_gathered = True  # the body's plan: a gathered weight (fsdp_compile/planner.py)
        frame.append(weight)
        graded.append(carrier if train else data)  # untrained: no leaf takes a gradient
    return frame, graded


def _carrier(data: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty_strided(data.shape, (0,) * data.ndim, dtype=dtype, device=data.device)


def graded_like(call: BlockCall, weights: list[Tensor]) -> list[Tensor]:
    """Empty tensors shaped as the gradients ``block_backward`` returns for ``body_weights``'
    list: a float8 weight's in its dtype and shape."""
    if not call.float8:
        return [torch.empty_like(w) for w in weights]
    head, reads, parts = _float8_parts(call, weights)
    tail = [
        torch.empty_like(tensors[0]) if read is None else torch.empty(tensors[0].shape, dtype=read[1], device=tensors[0].device)
        for read, tensors in zip(reads, parts)
    ]
    return [*map(torch.empty_like, head), *tail]


def packed_grads(call: BlockCall, weights: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    """The gathered ``weights``' gradients from ``block_backward``'s: each flat's members'
    packed (NOTE: a flat's copies in the block call), then those of the weights on their own."""
    packed, at = [], 0
    for weight, flat in zip(weights, call.flats):
        members = grads[at : at + flat.members]
        packed.append(pack_for_reduce_scatter(members, flat.unpack[0]).view(weight.shape))
        at += flat.members
    return [*packed, *grads[at : at + len(weights) - len(call.flats)]]


def token_like(tensors: list[Tensor]) -> Tensor:
    return torch.empty(1, dtype=torch.uint8, device=tensors[0].device)


def run_forward(
    call: BlockCall, weights: list[Tensor], tensors: list[Tensor], copied_out: bool, differentiated: bool
) -> list[Tensor]:
    if "outputs" not in call.traced:
        # Dynamo ran the call instead of tracing it: its fake run failed, and Dynamo broke the
        # graph there, swallowing the reason (one that reads tensor values is traced inline
        # instead: NOTE: a block fake tensors cannot run, in block_fakes.py).
        raise CompileUsageError(
            f"a repeated {type(call.block()).__name__}'s body could not be run on fake tensors "
            "while the step was traced (TORCH_LOGS=graph_breaks shows why; an op without a "
            "fake kernel is one cause), so it cannot be compiled on its own. Compile with "
            "options={'regional': False}."
        )
    frame = call.backend().frame(call.name, call.body)
    block = call.block()
    token = token_like([*weights, *tensors])
    side, stand_ins = SideChannel(), stand_ins_of(call.constants)
    if not call.train:
        with torch.no_grad(), autocast_as(call.autocast), transforms_inside():
            body, _ = float8_weights(call, body_weights(call, weights, copied_out), train=False)
            placed = placed_inputs(call, tensors)
            output = frame(block, call.layout, call.recipe.key, side, *body, *call.leaves(placed, stand_ins))
        outputs = _flat_outputs(call, output, flatten(side, stand_ins), [*weights, *tensors])
        return [*(t.detach() for t in outputs), token]
    slots = [_slot(w) for w in body_weights(call, weights, copied_out)]
    inputs = [t.detach().requires_grad_(d) for t, d in zip(tensors, call.traced["differentiable"])]
    with autograd_inside():
        with autocast_as(call.autocast), transforms_inside():
            body, graded = float8_weights(call, slots, train=True)
            placed = placed_inputs(call, inputs)
            output = frame(block, call.layout, call.recipe.key, side, *body, *call.leaves(placed, stand_ins))
        outputs = _flat_outputs(call, output, flatten(side, stand_ins), [*weights, *tensors])
    _release(slots)
    if differentiated:
        call.backend().pending.keep(token, (outputs, slots, graded, inputs))
    # Else the backward recomputes the call: its autograd graph goes with ``outputs`` here, as
    # torch.utils.checkpoint's forward keeps nothing for the backward.
    return [*(t.detach() for t in outputs), token]


def run_backward(
    call: BlockCall,
    token: Tensor,
    weights: list[Tensor],
    tensors: list[Tensor],
    grads: list[Tensor | None],
    copied_out: bool,
) -> list[Tensor]:
    # backward(retain_graph=True) differentiates the step again later: the body's autograd
    # graph stays for it, as the step's does.
    retained = torch._C._current_graph_task_id() != -1 and torch._C._autograd._get_current_graph_task_keep_graph()
    outputs, slots, graded, inputs = call.backend().pending.take(token, keep=retained)
    # This call's version of the step says which of its flats' members get a gradient, at the
    # backward it runs (NOTE: parameters without a gradient, in block_fakes.py).
    if (block := call.block()) is not None:  # the model may be gone, its loss kept
        note_block_graded(block, call.traced["graded"], traced=False)
    for slot, weight in zip(slots, body_weights(call, weights, copied_out)):
        slot.data = weight
    leaves = [*graded, *inputs]
    differentiable = [leaf for leaf in leaves if leaf.requires_grad]
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    computed = [None] * len(differentiable)
    if pairs:
        with autograd_inside():
            computed = torch.autograd.grad(
                [o for o, _ in pairs], differentiable, [g for _, g in pairs], allow_unused=True, retain_graph=retained
            )
    by_leaf = {id(leaf): grad for leaf, grad in zip(differentiable, computed)}
    found = [by_leaf.get(id(leaf)) for leaf in leaves]
    # Zeros where none flows, shaped as the leaf (a slot's shape goes with its storage).
    found = [_strided_like(g, leaf) if g is not None else torch.zeros_like(leaf) for g, leaf in zip(found, leaves)]
    arguments = [token, *weights, *tensors, *(g for g in grads if g is not None)]
    results = _unaliased(found, arguments, lambda i, g: torch.empty_like(leaves[i]).copy_(g))
    _release(slots)
    return results
