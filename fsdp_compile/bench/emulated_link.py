"""``--emulate-link nvlink|ib``: one rank of a fake world whose collectives take their time.

On the fake process group a collective returns at once, so a one-device bench measures
compute and memory but never communication. This process group keeps the fake group's data
semantics (an all-gather repeats this rank's shard, a reduce-scatter keeps its chunk: no data
moves) and gives every collective the duration the simulator's ring alpha-beta model gives
it on that link (``fsdp_compile.cost_model.collective_seconds``, ``NVLINK_GPU`` or
``INFINIBAND_GPU``), on one link shared in issue order:

- CPU: a collective starts when it is issued or when the link frees, whichever is later;
  its ``wait()`` blocks the caller until the modeled end, and the time blocked is counted
  as exposed communication (``EmulatedLinkGroup.exposed_s``). Compute the program runs
  between issue and wait hides the collective, as it does on a real link.
- CUDA: the collective is its data copies and a ``torch.cuda._sleep`` of the modeled length
  on a communication stream, after an event on the issuing stream (it starts when its input
  is ready and the link is free); ``wait()`` makes the current stream wait on its end, as
  NCCL's does, so exposed time is what the compute stream idles. The host is not blocked.
  The copies run there as NCCL's kernels do: on the issuing stream (where torch's fake group
  runs them) they would cost a program that issues from its compute stream, as a compiled
  graph does, and not one that issues from a stream of its own, as FSDP2 does.

torch has no process group that delays (the fake group does nothing, gloo and NCCL need
peers), hence this one; the delays come from the same model the simulator uses, so a
simulated timeline and an emulated one can be compared.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

from fsdp_compile.patterns import CollectiveFacts
from fsdp_compile.cost_model import NVLINK_GPU, Hardware, collective_seconds
from fsdp_compile.simulate import INFINIBAND_GPU

LINKS: dict[str, Hardware] = {"nvlink": NVLINK_GPU, "ib": INFINIBAND_GPU}


class _LinkWork(dist.Work):
    """A collective on the link; its future holds the tensors it wrote."""

    def __init__(self, result: list) -> None:
        super().__init__()
        self._result = result

    def get_future(self) -> Future:
        future: Future = Future()
        future.set_result(self._result)
        return future


class _CpuWork(_LinkWork):
    """Done at ``done_at`` (``time.perf_counter`` seconds); ``wait`` sleeps until then."""

    def __init__(self, group: EmulatedLinkGroup, done_at: float, result: list) -> None:
        super().__init__(result)
        self._group, self._done_at = group, done_at

    def is_completed(self) -> bool:
        return time.perf_counter() >= self._done_at

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        blocked = self._done_at - time.perf_counter()
        if blocked > 0:
            time.sleep(blocked)
            with self._group._lock:
                self._group.exposed_s += blocked
        return True


class _CudaWork(_LinkWork):
    """Done when ``done`` (an event on the communication stream) is; ``wait`` makes the
    current stream wait for it."""

    def __init__(self, done: torch.cuda.Event, result: list) -> None:
        super().__init__(result)
        self._done = done

    def is_completed(self) -> bool:
        return self._done.query()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        torch.cuda.current_stream().wait_event(self._done)
        return True


class EmulatedLinkGroup(dist.ProcessGroup):
    """Rank ``rank`` of ``world`` on ``hardware``'s link; see the module docstring."""

    def __init__(self, rank: int, world: int, hardware: Hardware) -> None:
        super().__init__(rank, world)
        self._rank, self._world, self.hardware = rank, world, hardware
        self._lock = threading.Lock()
        self._link_free_at = 0.0
        self.exposed_s = 0.0
        """CPU: seconds callers spent blocked in ``wait`` (the exposed communication)."""
        self.modeled_s = 0.0
        """Seconds of link time the issued collectives were given."""
        self.issued: list[tuple[str, int]] = []
        """(kind, bytes) of every collective issued, in order: the census of the step."""
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._cycles_per_second: dict[torch.device, float] = {}

    def size(self) -> int:
        return self._world

    def getBackendName(self) -> str:
        return "emulated"

    @property
    def group_name(self) -> str:
        # A Python group's C++ name field stays empty; c10d's registry holds the name.
        return dist.distributed_c10d._world.pg_names[self]

    def _issue(self, kind: str, nbytes: int, outputs: list[torch.Tensor], move=None, inputs=()) -> dist.Work:
        """Give the collective its modeled time on the link; ``move()`` writes ``outputs`` from
        ``inputs`` (the fake group's data semantics): at once on the CPU, on the communication
        stream on CUDA, where NCCL's kernels would write them."""
        facts = CollectiveFacts(kind=kind, group_name="", world=self._world, nbytes=nbytes, dtype=torch.uint8)
        seconds = collective_seconds(facts, self.hardware)
        self.modeled_s += seconds
        if nbytes:  # a barrier or a broadcast of nothing moves nothing
            self.issued.append((kind, nbytes))
        device = outputs[0].device if outputs else torch.device("cpu")
        if device.type == "cuda":
            return self._issue_cuda(device, seconds, outputs, move, inputs)
        if move is not None:
            move()
        with self._lock:
            start = max(time.perf_counter(), self._link_free_at)
            self._link_free_at = start + seconds
        return _CpuWork(self, self._link_free_at, outputs)

    def _issue_cuda(self, device: torch.device, seconds: float, outputs: list, move, inputs) -> dist.Work:
        stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        ready = torch.cuda.current_stream(device).record_event()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            if move is not None:
                move()
            torch.cuda._sleep(int(seconds * self._sleep_cycles_per_second(device)))
            for t in (*outputs, *inputs):  # used on this stream: not reused before it is done
                t.record_stream(stream)
            done = stream.record_event()
        return _CudaWork(done, outputs)

    def _sleep_cycles_per_second(self, device: torch.device) -> float:
        """``torch.cuda._sleep`` spins for a number of GPU cycles: timed once per device."""
        if device not in self._cycles_per_second:
            cycles = 10**8
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.device(device):
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
            self._cycles_per_second[device] = cycles / (start.elapsed_time(end) / 1e3)
        return self._cycles_per_second[device]

    # The fake group's data semantics: nothing moves between ranks.
    def _repeat(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every rank's piece of ``output`` is this rank's ``input`` (which may already be its
        own piece: FSDP2 gathers in place)."""
        source = input.reshape(-1)
        for piece in output.view(self._world, -1):
            if piece.data_ptr() != source.data_ptr():
                piece.copy_(source)

    def all_gather_single(self, output, input, opts=None):
        return self._issue(
            "all_gather", output.numel() * output.element_size(), [output], lambda: self._repeat(output, input), [input]
        )

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        def move():
            for output, input in zip(outputs, inputs, strict=True):
                self._repeat(output, input)

        return self._issue("all_gather", sum(o.numel() * o.element_size() for o in outputs), outputs, move, inputs)

    def allgather(self, output_lists, inputs, opts=None):
        def move():
            for outputs, input in zip(output_lists, inputs, strict=True):
                for output in outputs:
                    output.copy_(input)

        flat = [o for outputs in output_lists for o in outputs]
        return self._issue("all_gather", sum(o.numel() * o.element_size() for o in flat), flat, move, inputs)

    def _keep_mine(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input.reshape(self._world, -1)[self._rank].view_as(output))

    def reduce_scatter_single(self, output, input, opts=None):
        nbytes = input.numel() * input.element_size()
        return self._issue("reduce_scatter", nbytes, [output], lambda: self._keep_mine(output, input), [input])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        def move():
            for output, input in zip(outputs, inputs, strict=True):
                self._keep_mine(output, input)

        nbytes = sum(i.numel() * i.element_size() for i in inputs)
        return self._issue("reduce_scatter", nbytes, outputs, move, inputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        def move():
            for output, inputs in zip(outputs, input_lists, strict=True):
                output.copy_(inputs[self._rank])

        read = [t for inputs in input_lists for t in inputs]
        return self._issue("reduce_scatter", sum(t.numel() * t.element_size() for t in read), outputs, move, read)

    # torch 2.12's c10d calls the tensor-to-tensor collectives by these older names.
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def allreduce(self, tensors, opts=None):
        return self._issue("all_reduce", sum(t.numel() * t.element_size() for t in tensors), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        def move():
            if output.numel() == input.numel():
                output.copy_(input.view_as(output))

        return self._issue("all_to_all", input.numel() * input.element_size(), [output], move, [input])

    def broadcast(self, tensors, opts=None):
        return self._issue("all_gather", 0, tensors)

    def barrier(self, opts=None):
        return self._issue("all_gather", 0, [])


_LIBRARY: torch.library.Library | None = None


def _gather_into_out(input: torch.Tensor, group_size: int, group_name: str, *, out: torch.Tensor):
    group = dist.distributed_c10d._resolve_process_group(group_name)
    if not isinstance(group, EmulatedLinkGroup):
        raise RuntimeError(f"all_gather_into_tensor_out on group {group_name!r}, which is not emulated")
    torch._C._distributed_c10d._register_work(out, group.all_gather_single(out, input))
    return out


def _route_out_variant_through_group() -> None:
    """``_c10d_functional.all_gather_into_tensor_out`` (what bucketed gathers run) asks the
    group for its C++ backend, which a Python group has not, and C++ backends cannot be
    written in Python; so in this process that op's kernel calls the group's
    ``all_gather_single`` and registers its work for ``wait_tensor``. Only the bench's own
    process calls this (through ``init_emulated_group``), and for good: a kernel cannot be
    put back."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("_c10d_functional", "IMPL")
        for key in ("CPU", "CUDA"):
            _LIBRARY.impl("all_gather_into_tensor_out", _gather_into_out, key)


def init_emulated_group(hardware: Hardware, world: int) -> EmulatedLinkGroup:
    """Make this process rank 0 of ``world`` on ``hardware``'s emulated link, as the default
    group (``LINKS`` names the two the bench offers). For a process of its own: it replaces
    a functional collective's kernel for the rest of the process."""
    name = f"emulated_{abs(hash(hardware))}"
    if not hasattr(dist.Backend, name.upper()):
        dist.Backend.register_backend(
            name,
            lambda store, rank, size, timeout: EmulatedLinkGroup(rank, size, hardware),
            devices=["cpu", "cuda"],
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(name, store=FakeStore(), rank=0, world_size=world)
    group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, EmulatedLinkGroup):
        raise RuntimeError(f"the default group is a {type(group).__name__}, not the emulated one")
    _route_out_variant_through_group()
    return group
