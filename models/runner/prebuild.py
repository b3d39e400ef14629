"""Start-up builds of a runner, before warm-up and capture, side by side.

On a fresh machine three kinds of build wait before the first graph: the attention backend's
JIT modules (flashinfer: compiler subprocesses, tens of seconds), the tunable kernels'
candidates and their validated choices (the op table), and every Triton kernel the warm-up
would otherwise compile one launch at a time. ``KernelPrebuild.run`` runs the first in a
thread beside the others (the GIL is free while a compiler subprocess runs) and, in this
thread, with ``workers`` compile threads:

1. compiles every candidate of every graph size at once (``graphcap.startup.compile_ahead``);
2. validates and times the candidates (``OpTable.choose_kernels``), all built by then;
3. yields the graph keys whose forward kernels the manager then compiles ahead, inside the
   block, with the backend's ops as they can run before its JIT finished
   (``AttentionBackend.before_jit``: flashinfer's dense layers served by torch meanwhile; the
   forward's Triton kernels are the same either way).

With ``workers == 0`` only step 2 runs and kernels compile on their first launch.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import torch

from attention.base import AttentionBackend
from graphcap import GraphKey, Prebuild
from graphcap.startup.tuning import ChoiceStore

from .protocol import OpTable


class KernelPrebuild:
    """A runner's start-up builds (see the module docstring).

    Args:
        workers: Triton compile threads (0: compile on first launch).

    Attributes:
        built: graph keys whose forward kernels this process built (a recapture skips them).
        seconds: the last run's parts: ``attention_jit_s``, ``compile_ahead_s``,
            ``kernel_choices_s``, ``forward_compile_s``.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.built: set[GraphKey] = set()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def run(self, keys: Sequence[GraphKey], model: torch.nn.Module, ops: OpTable, backend: AttentionBackend,
            max_seqs: int, signature: str) -> Iterator[Prebuild]:
        """The builds for ``keys`` (``signature``: what the forward's kernels depend on, for the
        choice store's record of which keys' kernels the cache directory holds)."""
        backend.init_capture([k.rows for k in keys if k.decode], max_seqs)
        ahead = self.workers if backend.cache.block_tables.device.type == "cuda" else 0
        rows = sorted({k.rows for k in keys})

        def attention_jit() -> float:
            t0 = time.perf_counter()
            backend.warmup()
            return time.perf_counter() - t0

        with ThreadPoolExecutor(1, thread_name_prefix="graphcap-jit") as pool:
            jit = pool.submit(attention_jit)
            t0 = time.perf_counter()
            if ahead:
                from graphcap.startup.compile_ahead import compile_ahead

                with compile_ahead(ahead):
                    for r in rows:
                        ops.compile_kernels(model, r)
            t1 = time.perf_counter()
            for r in rows:
                ops.choose_kernels(model, r)
            t2 = time.perf_counter()
            record = _ForwardRecord(ops, signature)
            todo = tuple(k for k in keys if k not in self.built and str(k) not in record.keys) if ahead else ()
            with backend.before_jit() as ready:
                if todo and not ready:
                    jit.result()  # the forward's attention needs the backend's modules
                yield Prebuild(compile_forward=todo, workers=ahead)
            self.built.update(todo)
            record.add(todo)
            t3 = time.perf_counter()
            self.seconds = {"attention_jit_s": jit.result(), "compile_ahead_s": t1 - t0, "kernel_choices_s": t2 - t1,
                            "forward_compile_s": t3 - t2}


def forward_signature(*parts: object) -> str:
    """A digest of what a forward's Triton specialisations depend on (config, dtype, step
    capacity, cache layout, backend), for the choice store."""
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


class _ForwardRecord:
    """The choice store's entry listing the graph keys whose forward kernels were compiled into
    this cache directory for one forward signature (a warm start skips compiling them ahead).
    A stale record costs speed, never correctness: warm-up then compiles what is missing on
    first launch. No store (CPU, no tuned kernels): no record."""

    def __init__(self, ops: OpTable, signature: str) -> None:
        self.store: ChoiceStore | None = ops.tuner.store if ops.tuner is not None else None
        self.entry = f"forward kernels|{signature}"
        self.keys = set((self.store.get(self.entry) or "").split(",")) if self.store is not None else set()
        self.keys.discard("")

    def add(self, keys: Sequence[GraphKey]) -> None:
        if keys and self.store is not None:
            self.store.put(self.entry, ",".join(sorted(self.keys | {str(k) for k in keys})))


__all__ = ["KernelPrebuild", "forward_signature"]
