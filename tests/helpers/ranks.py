"""Run a function on W processes joined in one torch.distributed group (gloo on CPU, NCCL on
GPUs), with a deadline: a hang (mismatched collectives) fails the test instead of stalling CI.

Each rank calls ``fn(group, *args)`` and returns a picklable result; ``run_ranks`` returns the
results in rank order, or raises with the failing rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world: int, backend: str, port: int, out_dir: str,
           args: tuple) -> None:
    from distributed import ParallelGroup

    result: Any
    try:
        group = ParallelGroup.init(backend, rank, world, f"tcp://127.0.0.1:{port}")
        try:
            result = ("ok", fn(group, *args))
        finally:
            group.destroy()
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", timeout_s: float = 300) -> list:
    """``fn(group, *args)`` on ``world`` spawned ranks; their results in rank order.

    Raises:
        AssertionError: a rank raised (its traceback is the message), or the ranks did not
            finish within ``timeout_s`` (they are killed).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world, backend, free_port(), out_dir, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{world} ranks still running after {timeout_s} s: a collective hung")
        except mp.ProcessRaisedException as e:
            raise AssertionError(str(e)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world):
            path = os.path.join(out_dir, f"{rank}.pkl")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} exited without a result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise AssertionError(f"rank {rank} of {world} failed:\n{value}")
            results.append(value)
        return results
