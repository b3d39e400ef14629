"""ParallelGroup: the ranks one model is sharded over, and the collectives its forward runs.

The model calls ``all_reduce_`` after each row-parallel projection and ``all_gather_last`` on
its vocab-parallel logits; a group with no process group (``ParallelGroup.single()``, the
default) makes both free no-ops, so an unsharded model runs the very same code. A group over
``torch.distributed`` (gloo on CPU, NCCL on GPUs; world size 1 included) runs real
collectives, which CUDA graphs capture like any other kernel: they belong inside the captured
segments, launched on the current (capture) stream.

Lifecycle, every rank in the same order::

    group = ParallelGroup.from_torchrun("cuda")    # or ParallelGroup.init(...)
    runner = build_from_preset("real", ..., group=group)
    ...
    runner.destroy()                               # graphs hold NCCL work: free them first
    group.destroy()
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .env import configure_nccl


@dataclass
class ParallelGroup:
    """Attributes:
        rank, world_size: this process's place in the group (0 and 1 for ``single()``).
        device: the device this rank's tensors live on.
        pg: the ``torch.distributed`` process group, or None (single process, no collectives).
    """

    rank: int
    world_size: int
    device: torch.device
    pg: Any = None

    # ---- construction --------------------------------------------------------------
    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelGroup":
        """One process and no torch.distributed: every collective is a no-op."""
        return cls(0, 1, torch.device(device))

    @classmethod
    def init(cls, backend: str, rank: int, world_size: int, init_method: str,
             device: torch.device | str | None = None) -> "ParallelGroup":
        """Join a new default process group.

        Args:
            backend: ``nccl`` (CUDA tensors) or ``gloo`` (CPU tensors).
            init_method: rendezvous URL (``tcp://host:port``, ``file://path``, ``env://``).
            device: this rank's device (default: ``cuda:<rank % GPUs>`` for NCCL, else cpu).

        Raises:
            ValueError: an unknown backend, a rank outside ``[0, world_size)``, or NCCL without
                a GPU for this rank.
        """
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={backend!r}: choose 'nccl' (GPUs) or 'gloo' (CPU)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise ValueError("backend='nccl' needs CUDA GPUs; use backend='gloo' on CPU")
            configure_nccl()
            dev = torch.device(device or f"cuda:{rank % torch.cuda.device_count()}")
            torch.cuda.set_device(dev)
            # device_id makes NCCL create its communicator now, outside any capture (a
            # communicator cannot be created while a graph is being captured).
            dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size,
                                    device_id=dev)
        else:
            dev = torch.device(device or "cpu")
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        group = cls(rank, world_size, dev, dist.group.WORLD)
        group.barrier()
        return group

    @classmethod
    def from_torchrun(cls, device_type: str = "cuda") -> "ParallelGroup":
        """The group ``torchrun`` launched this process into (``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment); NCCL on
        ``cuda:<LOCAL_RANK>`` for ``device_type='cuda'``, gloo on CPU otherwise.

        Raises:
            ValueError: the torchrun variables are missing (the script was not launched by
                torchrun).
        """
        missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(f"{', '.join(missing)} not set: launch with "
                             f"`torchrun --nproc-per-node N script.py --tp N`")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device_type == "cuda":
            return cls.init("nccl", rank, world, "env://", f"cuda:{os.environ['LOCAL_RANK']}")
        return cls.init("gloo", rank, world, "env://")

    @property
    def distributed(self) -> bool:
        """Whether collectives run (a process group exists, even of world size 1)."""
        return self.pg is not None

    # ---- collectives (capturable with NCCL) -------------------------------------------
    def padded_rows(self, num_rows: int, num_real_tokens: torch.Tensor | None,
                    device: torch.device) -> torch.Tensor | None:
        """bool ``[num_rows, 1]``, True for rows ``>= num_real_tokens`` (padding): computed once
        per forward and passed to every ``all_reduce_``. None when there is nothing to mask (no
        collectives, or every row real)."""
        if self.pg is None or num_real_tokens is None:
            return None
        return (torch.arange(num_rows, device=device) >= num_real_tokens)[:, None]

    def all_reduce_(self, x: torch.Tensor, padded: torch.Tensor | None = None) -> torch.Tensor:
        """Sum ``x [T, H]`` over the ranks, in place; returns ``x``.

        ``padded`` (from ``padded_rows``) rows are zeroed first, so whatever a padded row holds
        (it may be uninitialised memory) never enters a collective.
        """
        if self.pg is None:
            return x
        if padded is not None:
            x.masked_fill_(padded, 0)
        dist.all_reduce(x, group=self.pg)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, V/world]`` per rank -> ``[N, V]``, rank r's part at columns ``[r*V/world, ...)``."""
        if self.pg is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.pg)
        return torch.cat(parts, dim=-1)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order; host-side and synchronising, so
        only for rare decisions (which graphs validated), never per step."""
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def barrier(self) -> None:
        if self.pg is not None:
            if self.device.type == "cuda":
                dist.barrier(group=self.pg, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.pg)

    def destroy(self) -> None:
        """Destroy the process group (after every graph holding its collectives is freed:
        ``runner.destroy()`` first). Idempotent."""
        if self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = None
