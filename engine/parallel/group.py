"""The tensor-parallel process group and its three collectives (sum all-reduce, all-gather, broadcast).

Invariants: a `TPGroup` of size 1 runs no collective at all, so that a TP = 1 engine's steps are exactly the ones it
ran before parallelism existed (and stay CUDA-graph capturable as they were); every rank calls the same collectives
in the same order (each rank runs the same schedule on the same inputs). The backend is NCCL for CUDA tensors (whose
collectives a CUDA graph captures) and gloo on a CPU, so that CI runs the same code in separate processes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from baton.engine.parallel.parallel_config import ParallelConfig


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, tp: TPGroup) -> torch.device:
    """A rank's device: GPU `rank` of the node where the device names no GPU (`cuda`, or `auto` resolved to it),
    else `device` as given."""
    if device.type == "cuda" and device.index is None and tp.size > 1:
        return torch.device("cuda", tp.rank)
    return device


class TPGroup:
    """This rank's view of the tensor-parallel group (`config.tp_size` ranks, all of this process group)."""

    def __init__(self, config: ParallelConfig, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None) -> None:
        self.config = config
        self.group = group
        self.device = device or torch.device("cpu")  # where this rank's collectives run (its GPU under NCCL)

    @property
    def size(self) -> int:
        return self.config.tp_size

    @property
    def rank(self) -> int:
        return self.config.rank

    @classmethod
    def single(cls) -> TPGroup:
        return cls(ParallelConfig())

    @classmethod
    def init(cls, tp_size: int, rank: int, device: torch.device, init_method: str | None = None) -> TPGroup:
        """Join (or create) the default process group of `tp_size` ranks as `rank`; `init_method` None reads
        MASTER_ADDR / MASTER_PORT from the environment (torch's "env://")."""
        config = ParallelConfig(tp_size, rank)
        if tp_size == 1:
            return cls(config)
        device = rank_device(device, cls(config))
        if device.type == "cuda":  # NCCL binds each rank to its own GPU
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend_for(device), init_method=init_method or "env://", world_size=tp_size,
                                    rank=rank)
        if dist.get_world_size() != tp_size or dist.get_rank() != rank:
            raise ValueError(f"tensor parallel group: expected world size {tp_size} and rank {rank}, got "
                             f"{dist.get_world_size()} and {dist.get_rank()}")
        group = cls(config, dist.group.WORLD, device)
        # A first collective now: NCCL creates its communicator then, not inside a CUDA graph's capture.
        group.all_reduce(torch.zeros(1, device=device))
        return group

    @classmethod
    def from_env(cls, tp_size: int, device: torch.device) -> TPGroup:
        """The group of `tp_size` ranks, this process's rank read from RANK (as torchrun and the node set it)."""
        if tp_size == 1:
            return cls.single()
        rank = os.environ.get("RANK")
        if rank is None or not rank.isdigit():
            raise ValueError(f"environment variable 'RANK': expected this process's rank 0..{tp_size - 1} with "
                             f"tensor_parallel_size = {tp_size}, got {rank!r}")
        return cls.init(tp_size, int(rank), device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place), on every rank."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order, on every rank."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def agree_min(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """Each of `values`' minimum over the ranks, on every rank (sizes that every rank must share)."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return tuple(t.tolist())

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` (in place), on every rank."""
        if self.size == 1:
            return x
        if x.is_contiguous():
            dist.broadcast(x, src=src, group=self.group)
            return x
        y = x.contiguous()
        dist.broadcast(y, src=src, group=self.group)
        return x.copy_(y)


def bind_group(root: torch.nn.Module, tp: TPGroup) -> None:
    """Give every module under `root` that runs collectives (its class declares `tp`) this rank's group."""
    for module in root.modules():
        if hasattr(type(module), "tp"):
            module.tp = tp
