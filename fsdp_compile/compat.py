"""Workarounds for the torch releases we support, each scoped to the call that needs it.

Each names the torch behaviour it works around and is a no-op where torch already does the
right thing, so that a torch fix needs no change here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from typing import Any, Iterator

import torch
from torch._inductor import output_code
from torch.distributed.device_mesh import DeviceMesh

_GATHER_ON_CPU: torch.library.Library | None = None
_RNG_STATES_AS_TENSORS = False


def _all_gather_into_fresh_tensor(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """``_c10d_functional.all_gather_into_tensor``, run as its ``_out`` variant into a buffer
    allocated as torch allocates it (dim 0 times ``group_size``; a complex tensor travels as
    its real view, as in torch's kernel)."""
    if not input.is_contiguous():
        raise RuntimeError("all_gather_into_tensor: the input must be contiguous")
    if input.is_complex():
        return torch.view_as_complex(_all_gather_into_fresh_tensor(torch.view_as_real(input), group_size, group_name))
    out = input.new_empty((input.shape[0] * group_size, *input.shape[1:]))
    return torch.ops._c10d_functional.all_gather_into_tensor_out(input, group_size, group_name, out=out)


def gather_cpu_tensors_one_work_each() -> None:
    """On CPU tensors, ``_c10d_functional.all_gather_into_tensor`` (the gather every compiled
    step issues) runs as ``all_gather_into_tensor_out`` does: one ``_allgather_base`` work.

    torch 2.11 to 2.13 (the releases tested) run the functional gather as a one-tensor
    ``allgather_into_tensor_coalesced``, and gloo's coalesced all-gather corrupts the heap
    when two are in flight at once: glibc aborts ("malloc(): unaligned tcache chunk
    detected") or gloo's worker thread segfaults, within seconds of issuing four gathers
    before waiting on any, with one worker thread as with two, while the same loop through
    ``_allgather_base`` (``dist.all_gather_into_tensor``, the ``_out`` op) ran 20,000
    iterations clean (2 ranks on 127.0.0.1, docs/design.md, "Gloo's concurrent gathers").
    A prefetched step always has two in flight. The result and its ``wait_tensor`` are the
    same; CUDA tensors keep torch's kernel. Called by ``fully_shard`` on a CPU mesh, the
    first call registers it: importing the package changes nothing in torch. A kernel
    registered in a process stays for its life."""
    global _GATHER_ON_CPU
    if _GATHER_ON_CPU is None and torch.distributed.is_available():
        _GATHER_ON_CPU = torch.library.Library("_c10d_functional", "IMPL")
        _GATHER_ON_CPU.impl("all_gather_into_tensor", _all_gather_into_fresh_tensor, "CPU")


def device_mesh_copies_run_untraced() -> None:
    """``DeviceMesh.__setstate__`` runs as Python whenever Dynamo's frame callback is on, not
    traced as a frame of its own.

    A backward called inside a function Dynamo traces (``loss.backward()`` in a train step
    compiled whole: Dynamo breaks the graph there and runs the call with its callback on)
    compiles a step's backward lazily there, copying its graph, whose constants include the
    ``DeviceMesh`` each DTensor gradient is built on. The copy's ``__setstate__`` was caught
    by the callback, and Dynamo, wrapping the half-built mesh, failed on every rank ("Opaque
    object of type DeviceMesh was specified to have member '_flatten_rank_map', but this
    doesn't actually exist in the object"). Called by ``fully_shard``: importing the package
    changes nothing in torch. The mark stays for the process's life."""
    torch._dynamo.eval_frame.skip_code(DeviceMesh.__setstate__.__code__)


def checkpoint_rng_states_saved_as_tensors() -> None:
    """A checkpointed region with a CPU random op compiles with the RNG state it saves for
    its recompute among the saved tensors, where AOTAutograd's runtime looks for it.

    torch 2.13's partitioner (``functionalize_rng_ops``, the non-graphsafe path it takes for
    CPU random ops, SDPA's CPU kernel among them) appends each RNG state to the forward's
    outputs after the saved opaque objects. A graph that also saves one (the ``DeviceMesh`` a
    DTensor parameter's ``to_local`` needs in backward: every block compiled on its own, as
    FSDP2 users do) then has the state counted as the opaque object and the mesh as a tensor,
    and its first forward failed ("expected all tensors_saved_with_vc_check to be Tensors,
    got ... DeviceMesh"). Each state is moved before the saved opaque objects, in the forward's
    outputs and in the backward's inputs alike; a graph torch already orders so is left as it
    is (CUDA random ops take torch's graph-safe path, which saves no state, unless Inductor's
    ``fallback_random`` or ``graphsafe_rng_functionalization=False`` turns it off). The first
    ``fully_shard`` call patches it: importing the package changes nothing in torch. The patch
    stays for the process's life."""
    global _RNG_STATES_AS_TENSORS
    from torch._functorch import partitioners

    if _RNG_STATES_AS_TENSORS:
        return
    _RNG_STATES_AS_TENSORS = True
    functionalize = partitioners.functionalize_rng_ops

    @functools.wraps(functionalize)
    def functionalize_saving_states_as_tensors(joint_module, fw_module, bw_module, num_sym_nodes):
        fw_module, bw_module = functionalize(joint_module, fw_module, bw_module, num_sym_nodes)
        if _states_before_opaque_objects(fw_module, bw_module):
            fw_module.recompile()
            bw_module.recompile()
        return fw_module, bw_module

    partitioners.functionalize_rng_ops = functionalize_saving_states_as_tensors


def _states_before_opaque_objects(fw_module: torch.fx.GraphModule, bw_module: torch.fx.GraphModule) -> bool:
    """Moves the forward's saved RNG states, and the backward's inputs that take them, before
    the first saved opaque object ahead of them; whether anything moved."""
    from torch._library.fake_class_registry import FakeScriptObject

    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    except ImportError:  # torch 2.11: a mesh traces as a fake script object, as it does here
        is_opaque_node = lambda node: False  # noqa: E731

    def opaque(node) -> bool:  # as the partitioner tells them
        if not isinstance(node, torch.fx.Node):
            return False
        return isinstance(node.meta.get("val"), FakeScriptObject) or is_opaque_node(node)

    output = next(iter(fw_module.graph.find_nodes(op="output")))
    outputs = list(output.args[0])
    states = [n for n in outputs if _is_saved_rng_state(n)]
    if not states or not any(opaque(n) for n in outputs[: outputs.index(states[0])]):
        return False
    kept = [n for n in outputs if n not in states]
    at = next(i for i, n in enumerate(kept) if opaque(n))
    output.args = (tuple(kept[:at] + states + kept[at:]), *output.args[1:])
    placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
    first_opaque = next(p for p in placeholders if opaque(p))  # the backward takes what is saved
    for placeholder in placeholders:
        if placeholder.name.startswith("rng_state_output_"):  # the partitioner's name for them
            first_opaque.prepend(placeholder)
    return True


def _is_saved_rng_state(node) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and node.target is operator.getitem
        and node.args[1] == 0
        and getattr(node.args[0], "target", None) is torch._prims.rng_prims.run_and_save_rng_state
    )


@contextlib.contextmanager
def compile_caches_work() -> Iterator[None]:
    """Inside, torch 2.13's AOTAutograd and Inductor caches work for graphs of DTensors:
    a restart finds the entry the first process wrote, and the graph it loads runs.

    - The key is stable. Inductor's FX graph key pickles each ``DeviceMesh`` input whole,
      the ``_hash`` it caches included: ``hash()`` of a tuple of strings, salted per process,
      so every process got a different key and never hit. The state pickled here leaves
      that cached value out (``DeviceMesh.__hash__`` computes it again when it is missing).
    - The loaded graph has its opaque constants. A fresh compile builds the module with the
      graph's opaque constants (``get_attr`` of a ``DeviceMesh``, kept in
      ``CompiledFxGraph.torchbind_constants`` and pickled with the cache entry), but a cache
      hit hands the module only ``constants`` and ``opaque_value_type_classes``, and the
      constant read ``None``. Our backward returns each DTensor gradient's ``DeviceMesh``
      as such a constant (pass ``constant_opaque_outputs``), so the gradient came back
      without a mesh and the first op on it failed ("found no DeviceMesh from dtensor args
      for aten::detach"). The constants the entry holds are added under whatever torch
      already returns.

    Both are patched only while the backend compiles (or loads) a graph, and are no-ops
    where torch does this itself.
    """
    classes = (output_code.CompiledFxGraphConstants, output_code.CompiledFxGraphConstantsWithGm)
    unwraps = {cls: cls.__dict__["unwrap"] for cls in classes}
    mesh_getstate = DeviceMesh.__getstate__

    def with_constants(original):
        def unwrap(self, graph):
            return {**getattr(graph, "torchbind_constants", {}), **original(self, graph)}

        return unwrap

    def getstate_without_hash(self) -> dict:
        state = mesh_getstate(self)
        state.pop("_hash", None)
        return state

    for cls, original in unwraps.items():
        cls.unwrap = with_constants(original)
    DeviceMesh.__getstate__ = getstate_without_hash
    try:
        yield
    finally:
        for cls, original in unwraps.items():
            cls.unwrap = original
        DeviceMesh.__getstate__ = mesh_getstate


def pre_bucket_all_gather_args(ins, world: int, group_name: str, dtype, out_dtype_ints, rank: int, foreach_groups) -> tuple:
    """The arguments of Inductor's ``bucketing::_pre_bucket_all_gather`` (the op that copies a
    bucket's shards into one buffer) in the order this torch's schema has them: torch 2.12
    takes the group's name after the world size, 2.13 no longer does."""
    schema = torch.ops.bucketing._pre_bucket_all_gather.default._schema
    named = {a.name for a in schema.arguments}
    return (ins, world, *((group_name,) if "group_name" in named else ()), dtype, out_dtype_ints, rank, foreach_groups)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Inside, ``torch.compiler.is_compiling()`` is True, as torch 2.13 holds it for the whole
    of a compile: code the compile runs but Dynamo does not trace (a block's Python on fake
    tensors, run by its op's fake kernel) then takes the branch it takes when traced. torch
    2.11 answers False there, and HF's MoE experts, which fall back from ``grouped_mm`` to a
    custom op when compiling in a dtype other than bf16, called ``grouped_mm`` on fake fp32
    tensors, whose meta kernel refuses them ("Expected inputs of BF16 type")."""
    before = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = before


@contextlib.contextmanager
def missing_gradients_stay_missing() -> Iterator[None]:
    """Inside, ``DTensor.to_local``'s backward hands a missing gradient on as None, as torch
    2.13's does (its ``_ToTorchTensor`` sets ``set_materialize_grads(False)``). torch 2.11's
    materialises it as zeros: a weight a block reads only under ``torch.no_grad()`` and
    gathered on its own (every block weight under tensor parallelism) got a zero gradient in
    the compiled step's joint graph, which AdamW's weight decay then moved, where the
    unsharded model leaves ``.grad`` None. Patched while the backend traces a graph (the
    joint graph is traced then); a no-op where torch keeps None. An eager read uses
    ``local_rows``."""
    from torch.distributed.tensor._api import _ToTorchTensor

    if _to_local_keeps_none():
        yield
        return
    forward, backward = _ToTorchTensor.__dict__["forward"], _ToTorchTensor.__dict__["backward"]
    _ToTorchTensor.forward = staticmethod(_forward_keeping_none(forward.__func__))
    _ToTorchTensor.backward = staticmethod(_backward_keeping_none(backward.__func__))
    try:
        yield
    finally:
        _ToTorchTensor.forward, _ToTorchTensor.backward = forward, backward


def local_rows(param: torch.Tensor) -> torch.Tensor:
    """``param.to_local()`` for an eager read, its backward handing a missing gradient on as
    None on every torch: on torch 2.11 a micro-batch without sync, whose marker returns none,
    left every weight's ``.grad`` zeros where FSDP2 and the unsharded model leave None (and a
    weight no later micro-batch reached then got AdamW's decay). A traced read keeps
    ``to_local``, which the mfsdp backend patches while it traces
    (``missing_gradients_stay_missing``); traced for another backend, that backend's
    AOTAutograd still hands zeros on."""
    # Compiling first: Dynamo would not trace into the cached check.
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or _to_local_keeps_none():
        return param.to_local()
    return _to_local_keeping_none().apply(param, None)


# Called from eager code (a frame Dynamo fell back on), the read must run eagerly: compiled as
# a frame of its own, AOTAutograd's backward of its to_local made the missing gradient zeros.
torch._dynamo.eval_frame.skip_code(local_rows.__code__)


@functools.cache
def _to_local_keeping_none() -> type:
    from torch.distributed.tensor._api import _ToTorchTensor

    class ToLocalKeepingNone(_ToTorchTensor):
        forward = staticmethod(_forward_keeping_none(_ToTorchTensor.forward))
        backward = staticmethod(_backward_keeping_none(_ToTorchTensor.backward))

    return ToLocalKeepingNone


def _forward_keeping_none(forward):
    def forward_keeping_none(ctx, *args):
        ctx.set_materialize_grads(False)
        return forward(ctx, *args)

    return forward_keeping_none


def _backward_keeping_none(backward):
    def backward_keeping_none(ctx, grad_output):
        if grad_output is None:
            return None, None
        return backward(ctx, grad_output)

    return backward_keeping_none


@functools.cache
def _to_local_keeps_none() -> bool:
    """Whether this torch's ``DTensor.to_local`` backward already keeps a missing gradient
    None (asked once: every compile would read torch's source again)."""
    from torch.distributed.tensor._api import _ToTorchTensor

    try:
        return "set_materialize_grads" in inspect.getsource(_ToTorchTensor.forward)
    except (OSError, TypeError):  # no source at hand: patching is harmless where torch keeps None
        return False


def unused_output_grads_freed_in_backward(compiled):
    """``compiled`` (AOTAutograd's callable for a step graph, not a body's: a step's outputs
    reach the user, who may leave some without a gradient), its backward freeing the
    gradient of an output the loss does not read once the graph has read it, as on torch 2.13.

    An output the backward reaches without a gradient (an HF model's ``logits`` beside its
    ``loss``) gets one of zeros, which AOTAutograd's compiled backward reads as its tangent.
    torch 2.13 hands the backward its gradients as a list the graph clears
    (``boxed_grads_call``), so the graph frees them after their last use, the first ops of
    the backward. torch 2.11 calls it with a tuple the autograd engine materialises the
    zeros into and holds until the whole backward returns: the logits' size (1 MiB for a
    vocabulary of 2048 and 256 tokens in bf16) was held over the backward's peak (under
    activation checkpointing, a block's recompute), 1.07x FSDP2's peak in
    tests/test_census.py where 2.13 peaks at 1.0x. Each such output is handed out through
    ``_ZerosWhenUnused`` instead, whose backward gives a missing gradient as a zero
    expanded to the output's shape (one element): AOTAutograd lays it out as the graph's
    tangent (``coerce_to_expected_memory_format``), a tensor only the graph's argument list
    holds. A no-op where the graph's function already takes its gradients boxed, under
    ``no_grad``, and for outputs AOTAutograd does not return from its function (an input,
    a view it regenerates)."""

    boxed = False  # the graph's backward seen taking its gradients boxed: nothing to do, ever

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal boxed
        outs = compiled(*args, **kwargs)
        if boxed or not torch.is_grad_enabled():
            return outs
        if any(getattr(_compiled_function(o), "boxed_grads_call", False) for o in outs):
            boxed = True
            return outs
        picked = [i for i, o in enumerate(outs) if _held_by_the_engine(o)]
        if not picked:
            return outs
        unique = list({id(outs[i]): outs[i] for i in picked}.values())
        handed = dict(zip(map(id, unique), _ZerosWhenUnused.apply(*unique)))
        replaced = [handed[id(o)] if i in picked else o for i, o in enumerate(outs)]
        return type(outs)(replaced) if isinstance(outs, tuple) else replaced

    return functools.update_wrapper(run, compiled, assigned=(), updated=("__dict__",))


def _compiled_function(out: object) -> type | None:
    """The AOTAutograd function class ``out`` is an output of, if any."""
    if not isinstance(out, torch.Tensor) or not out.requires_grad or out.grad_fn is None:
        return None
    cls = getattr(out.grad_fn, "_forward_cls", None)
    return cls if cls is not None and hasattr(cls, "compiled_bw") and hasattr(cls, "metadata") else None


def _held_by_the_engine(out: object) -> bool:
    """An output of an AOTAutograd function whose backward takes its gradients as a tuple."""
    cls = _compiled_function(out)
    return cls is not None and not getattr(cls, "boxed_grads_call", False) and type(out) is torch.Tensor


class _ZerosWhenUnused(torch.autograd.Function):
    """The identity on its inputs (the same storage, detached); its backward gives a missing
    gradient as a zero expanded to the input's shape, which allocates one element."""

    @staticmethod
    def forward(ctx, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in outs]
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        return tuple(
            g if g is not None else torch.zeros((), dtype=dtype, device=device).expand(shape)
            for g, (shape, dtype, device) in zip(grads, ctx.shapes)
        )
