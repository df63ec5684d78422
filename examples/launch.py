"""What every example does first under torchrun: the process group, the device, the compiler."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_torchrun(compiler: str | None) -> tuple[int, int, torch.device, str]:
    """(rank, world, device, compiler): NCCL and this rank's GPU when CUDA is there, else gloo
    on CPU; ``compiler`` None picks mfsdp's Inductor on GPU and the eager runner on CPU."""
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device, compiler or ("inductor" if use_cuda else "eager")
