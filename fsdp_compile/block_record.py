"""What the step's graph names a repeated block's call by: a ``BlockCall`` (the block, its
body, its flats' copies, its constants), registered under the index ``block_forward``
carries (NOTE: one op per block call, in block_call.py), and the form of a body's outputs."""

from __future__ import annotations

import enum
import itertools
import warnings
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor, nn

from fsdp_compile.errors import CompileUsageError

__all__ = ["BlockCall", "FlatCopy", "Recipe", "register_call", "call_record", "python_flags", "flag_sources", "written_in_trace"]


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
class Recipe:
    """How a block's gathered weights become its parameters (``region_tables._recipe_key``
    says what ``value`` holds), under the key a body's frame reads it by. Owned by the blocks
    that gather with it and the calls traced with it; ``region_tables.RECIPES`` only names it."""

    key: str
    value: tuple


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
    """How the call's leaves regroup into arguments (``region_tables.call_layout``'s key)."""
    recipe: Recipe
    """How the gathered weights become the block's parameters."""
    constants: tuple[tuple, ...]
    """Per leaf: ``()`` where a tensor goes, ``(value,)`` for a constant."""
    train: bool
    """Traced with grad enabled: the forward keeps its autograd graph for the backward."""
    backend: weakref.ref
    """The MfsdpBackend that compiles the body's frame (it outlives the step it compiled)."""
    autocast: tuple = ()
    """The autocast state at the call, as Dynamo traced it (``autocast_state``): the step's
    graph runs with autocast off, its casts baked in (AOTAutograd does so for any graph traced
    under autocast), so the body's frame, which the step calls as one op, gets it back
    (NOTE: autocast in a block call, in block_runtime.py)."""
    flats: tuple[FlatCopy, ...] = ()
    """The first gathered weights are the block's flat parameters: how each is copied out
    and its gradient packed (NOTE: a flat's copies in the block call)."""
    float8: tuple = ()
    """Per weight gathered on its own (after the flats), ``(Float8Gather, dtype)`` for a float8
    weight, which the op takes as its float8 data and scale, else None (NOTE: float8 weights
    in a block call, in block_call.py); empty where there is none."""
    flags: tuple = ()
    """The block's Python flags, which the fake run is keyed by (``python_flags``)."""
    traced: dict = field(default_factory=dict)
    """Filled by the fake kernel: ``differentiable`` (which tensor leaves need a gradient),
    ``outputs`` (the metadata of the block's tensor outputs, then of its side values: NOTE:
    hooks inside a repeated block), ``form`` (how the block's regroup), ``own`` (how many
    they are), ``side`` (the side values' form), ``cost``: the FLOPs and
    bytes of the body's forward and backward ops (see ``_RooflineCounter``),
    ``saved_bytes``: what its autograd graph keeps for the backward (see ``_saved_bytes``),
    ``held_bytes``: what the call holds while it runs, forward and backward (``held_bytes``),
    ``random``: whether its forward draws random numbers, and ``graded``: per gathered
    weight, which of its members the backward gives a gradient (see ``_Graded``)."""

    def leaves(self, tensors: list[Tensor], stand_ins: dict[int, Any]) -> list[Any]:
        """The body's leaves: the tensors and constants in place, a cache stand-in where its
        spec is (NOTE: HF caches in a repeated block, in side_outputs.py)."""
        tensors = iter(tensors)
        return [next(tensors) if not c else stand_ins[at][0] if at in stand_ins else c[0] for at, c in enumerate(self.constants)]


_CALLS: weakref.WeakValueDictionary[int, BlockCall] = weakref.WeakValueDictionary()
"""Every live call, by the index the step's graphs name it by. The backend that traced a call
owns its record (``MfsdpBackend.calls``): it lives as long as the graphs naming it and goes
with them; this table only names."""
_CALL_INDICES = itertools.count()


def register_call(call: BlockCall, owner: list[BlockCall]) -> int:
    """The index ``block_forward`` names ``call`` by; ``owner`` (its backend's ``calls``)
    keeps it."""
    owner.append(call)
    index = next(_CALL_INDICES)
    _CALLS[index] = call
    return index


def call_record(index: int) -> BlockCall:
    record = _CALLS.get(index)
    if record is None:
        raise CompileUsageError(
            f"block call {index} was traced by an mfsdp backend that no longer exists: keep the "
            "object torch.compile returned (it holds the backend) for as long as you run the step."
        )
    return record


def python_flags(block: nn.Module) -> tuple:
    """The flags the block's modules hold, by path and name: what a layer's Python may branch
    on, unlike its siblings of one structure, to read a weight under ``torch.no_grad()`` or
    return other outputs (NOTE: parameters without a gradient, in block_fakes.py). A flag is
    a bool (numpy's too), a string (a ``str`` enum too), an enum or None. Numbers are left
    out, as what is held inside a container: each would split layers that differ in a value
    no weight's gradient hangs on (HF's ``layer_idx``, torchtitan's per-layer init scale,
    PEFT's per-layer target names), and a fake run per layer costs about half a first step
    more at 32 layers. A flag the module's class holds counts too, as the default its instance
    reads until it sets its own (``frozen = False`` in the class body, ``layer.frozen = True``
    later): one not read at compile would never be guarded."""
    return tuple(
        (path, name, flag)
        for path, module in block.named_modules()
        for name, value in _held(module).items()
        if name not in _BOOKKEEPING and not name.startswith("_mfsdp") and (flag := _flag(value)) is not _NOT_A_FLAG
    )


def _held(module: nn.Module) -> dict[str, Any]:
    """What ``module`` reads as its attributes, but ``nn.Module``'s: its classes' (not the
    dunders; a mixin after ``nn.Module`` too, as PEFT's layers hold their adapters' defaults),
    then its own over them."""
    held = {}
    for cls in reversed(type(module).__mro__):
        if cls not in _MODULE_CLASSES:
            held.update((n, v) for n, v in vars(cls).items() if not (n.startswith("__") and n.endswith("__")))
    return held | vars(module)


def flag_sources(block: nn.Module) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """Where the block's flags are (``python_flags``), as the path of each module holding some
    (its names from the block, one by one) and their names; not numpy's bools, which Dynamo
    cannot take as constants."""
    sources: dict[str, tuple[str, ...]] = {}
    for path, name, _ in python_flags(block):
        if type(getattr(block.get_submodule(path), name)).__module__ != "numpy":
            sources[path] = (*sources.get(path, ()), name)
    return tuple((tuple(filter(None, path.split("."))), names) for path, names in sources.items())


def written_in_trace(block: nn.Module) -> str | None:
    """An attribute that the step under trace has set (``path.name``) of the block's modules
    or of an object one holds (HF's ``self.config``), if any: Dynamo makes such writes after
    the step's graph has run."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    effects = tx.output.side_effects if tx is not None else None
    for path, module in block.named_modules() if effects is not None else ():
        held = ((name, v) for name, v in vars(module).items() if not isinstance(v, (nn.Module, Tensor)))
        for at, target in (("", module), *held):
            written = effects.store_attr_mutations.get(effects.id_to_variable.get(id(target)), {})
            if names := [n for n in written if not n.startswith("_mfsdp")]:
                return ".".join(filter(None, (path, at, names[0])))
    return None


def say_written_in_step(block: str, attribute: str) -> None:
    """Said once per block class and attribute (Python's warnings keep the first)."""
    warnings.warn(
        f"the step's own code sets {attribute!r} of a repeated {block} before calling it. A "
        "compiled step makes such writes after its graph has run, so the block's compiled body "
        "would read the value from before: these calls are traced inline, at eager's results, "
        "and compile time grows with depth. Set it before calling the compiled model, or pass "
        "the value as an argument of the block's call.",
        stacklevel=3,
    )


_BOOKKEEPING = frozenset((*vars(nn.Module()), "_is_hf_initialized"))
"""What torch's modules (``training``, ``_is_full_backward_hook``) and HF's loading set: no
layer's arithmetic branches on it."""
_NOT_A_FLAG = object()
_MODULE_CLASSES = frozenset(nn.Module.__mro__)


def _flag(value: Any) -> Any:
    """``value`` as a flag, or ``_NOT_A_FLAG``."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()  # a numpy scalar, without importing numpy
    if value is None or isinstance(value, (bool, str)):
        return value
    # An enum whose class defines __eq__ alone has no hash: it cannot key a fake run.
    return value if isinstance(value, enum.Enum) and isinstance(value, Hashable) else _NOT_A_FLAG


def tensor_metadata(tensor: Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def tensors_of(output: Any) -> list[Tensor]:
    """A block's tensor outputs, in order: ``block_forward``'s results before the token."""
    return [output] if isinstance(output, Tensor) else [v for v in output if isinstance(v, Tensor)]


def output_form(output: Any) -> tuple:
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
