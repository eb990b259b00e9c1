"""This training process's place in a ``torchrun`` job: rank, world size, device, and the collective calls
the loop makes (no-ops in a single process)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class Distributed:
    """Rank / world size / device; initialises torch.distributed when WORLD_SIZE > 1."""

    def __init__(self, device: str) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
        if use_cuda:
            index = self.local_rank if device in ("auto", "cuda") else (torch.device(device).index or 0)
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.owns_group = False
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if use_cuda else "gloo")
            self.owns_group = True
        self.enabled = self.world > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
