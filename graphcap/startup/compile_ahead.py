"""Compile Triton kernels ahead of their first launch, many at once.

A Triton kernel compiles on its first launch with a new specialization, and the launch waits
for it: on a fresh machine the warm-up of every bucket compiles its kernels one after the
other (about 0.4 s each on an H200 host, dozens of them). Most of a compile (MLIR passes,
LLVM, ``ptxas``) runs without the GIL, so compiles in threads overlap.

Inside ``compile_ahead()`` every Triton launch *of the calling thread* compiles only: the
launch is turned into Triton's own ``warmup`` (no kernel runs, no memory is written) and the
compile is handed to a thread pool (Triton's ``AsyncCompileMode``). On exit the pool is
drained and every compiled kernel is installed in its in-memory cache (and Triton's disk
cache), so the real launches that follow start at once. Code run inside must not depend on
what a Triton kernel would have written (the outputs stay as allocated): run the launches of
an op on probe inputs, not a step's forward whose host code reads device results.

A compile that fails is left out silently: the real launch compiles it again and raises
there, where the caller handles it (a kernel tuner rejects that candidate).
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

_lock = threading.Lock()
_patched = False


def default_workers() -> int:
    """Compile threads: the host's cores, at most 8 (flashinfer's JIT builds may share them)."""
    return max(1, min(8, os.cpu_count() or 1))


@functools.cache
def _mode_class() -> type:
    from triton.runtime._async_compile import AsyncCompileMode

    class CompileAheadMode(AsyncCompileMode):
        """The ``AsyncCompileMode`` that ``compile_ahead`` entered: only under this one do
        launches compile instead of running (another one, entered by someone else, keeps
        Triton's own behaviour)."""

    return CompileAheadMode


def _install() -> None:
    """Route ``JITFunction.run`` through a check of the calling thread's mode (once per
    process; a launch outside ``compile_ahead`` is unchanged)."""
    global _patched
    with _lock:
        if _patched:
            return
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction

        run, mode = JITFunction.run, _mode_class()

        def run_or_compile(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            ahead = isinstance(_async_compile.active_mode.get(), mode)
            return run(self, *args, grid=grid, warmup=warmup or ahead, **kwargs)

        JITFunction.run = run_or_compile
        _patched = True


@contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[None]:
    """Within the block, the calling thread's Triton launches compile (in ``workers`` threads,
    default ``default_workers()``) instead of running; leaving the block waits for every
    compile. A no-op when a Triton async-compile mode is already active, or without Triton."""
    try:
        from triton.runtime._async_compile import active_mode
    except ImportError:  # no Triton: nothing compiles
        yield
        return
    if active_mode.get() is not None:
        yield
        return
    _install()
    with ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="graphcap-compile") as pool:
        with _mode_class()(pool, ignore_errors=True):
            yield


@contextmanager
def launching() -> Iterator[None]:
    """Inside ``compile_ahead``: the calling thread's launches run again for the block (e.g. a
    host plan's own kernels); a kernel whose compile is still pending compiles again here."""
    try:
        from triton.runtime._async_compile import active_mode
    except ImportError:
        yield
        return
    token = active_mode.set(None)
    try:
        yield
    finally:
        active_mode.reset(token)


__all__ = ["compile_ahead", "default_workers", "launching"]
