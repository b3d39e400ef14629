"""Triton compiles of this process, counted, so a serving run can say whether it compiled after capture.

Triton builds a kernel on the first launch of each new specialization (constexpr values, int
arguments specialised as 1 or 16-divisible, dtypes, num_warps) and that launch waits: 0.3-1 s
for a build, milliseconds for a load from Triton's disk cache (plus the launcher stub and the
module load on the first run). Mid-serving, every request of the step waits with it.

What fires when, read in Triton 3.6's source (``runtime/jit.py``, ``compiler/compiler.py``,
``knobs.py``):

- an in-memory hit (the kernel's ``device_caches``) calls no hook at all: counting costs the
  launch path nothing;
- a miss calls ``knobs.runtime.jit_cache_hook`` before and ``jit_post_compile_hook`` after the
  compile, for a build and a disk-cache load alike: they cannot tell the two apart;
- ``triton.compile`` calls ``knobs.compilation.listener`` once, at its end, with ``cache_hit``
  (True: loaded from the disk cache) and its stage times. Every JIT miss runs it, including the
  compiles ``compile_ahead`` hands to worker threads (``AsyncCompileMode`` runs the same
  ``compile`` there), so those are counted too, in the thread that ran them.

So the counter is that listener. Under the interpreter (``TRITON_INTERPRET=1``) nothing
compiles and none of the hooks fire: on a CPU the count is 0 because there is nothing to count
(the tests check the counter on a real compile for a Hopper target, which needs no GPU).

The listener slot holds one callable. ``install`` wraps whatever it holds and calls it after
counting, so a tool installed before keeps working; one that sets the slot later without
chaining replaces ours, and ``install`` again (``ModelRunner.capture`` calls it each time)
wraps it in turn. A thread-local guard keeps a chain holding two of our wrappers from counting
one compile twice.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable

_KEY_CHARS = 400  # a specialization key is for people to read; a full signature can run long


@dataclass(frozen=True)
class CompileEvent:
    """One ``triton.compile``: a real build (``cached`` False) or a load from the disk cache.

    Attributes:
        kernel: the kernel's name.
        key: its specialization: constexpr values, argument types, num_warps and num_stages.
        cached: loaded from Triton's disk cache (a shorter stall) rather than built.
        seconds: time inside ``triton.compile`` (the launcher stub and module load come on top).
        thread: the thread that compiled (``graphcap-compile-*``: ``compile_ahead``'s pool).
    """

    kernel: str
    key: str
    cached: bool
    seconds: float
    thread: str

    def describe(self) -> str:
        return f"{self.key} ({'disk cache' if self.cached else 'built'}, {self.seconds * 1e3:.0f} ms)"


def specialization_key(src: Any, metadata: dict[str, Any]) -> str:
    """``name[constexpr=value, ...](arg: type, ...) warps=W stages=S`` of a compile's source
    (an ``ASTSource``; another source gives its name alone)."""
    name = str(getattr(src, "name", None) or metadata.get("name", "?"))
    fn, signature = getattr(src, "fn", None), getattr(src, "signature", None)
    if fn is None or not isinstance(signature, dict):
        return name
    arg_names = list(getattr(fn, "arg_names", signature))
    constants = getattr(src, "constants", {}) or {}
    consts = ", ".join(f"{arg_names[k[0]] if len(k) == 1 and k[0] < len(arg_names) else k}={v}"
                       for k, v in sorted(constants.items(), key=str))
    types = ", ".join(f"{a}: {t}" for a, t in signature.items() if t != "constexpr")
    key = f"{name}[{consts}]({types}) warps={metadata.get('num_warps')} stages={metadata.get('num_stages')}"
    return key[:_KEY_CHARS]


class CompileCounter:
    """Every Triton compile of the process since ``install``, in order; thread-safe.

    Positions (``count``) are the way to ask "since when": take ``count`` at a moment, later
    ``since(position)`` gives what compiled after it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[CompileEvent] = []
        self._counting = threading.local()

    @property
    def count(self) -> int:
        """Compiles recorded so far (builds and disk loads)."""
        with self._lock:
            return len(self._events)

    def since(self, position: int) -> list[CompileEvent]:
        """The compiles recorded after ``position`` (a former ``count``)."""
        with self._lock:
            return self._events[position:]

    def record(self, event: CompileEvent) -> None:
        with self._lock:
            self._events.append(event)

    def on_compile(self, *, src: Any, metadata: dict[str, Any], cache_hit: bool, times: Any = None,
                   **_: Any) -> None:
        """Triton's compilation listener (``knobs.compilation.listener``): record one compile."""
        total = getattr(times, "total", None)
        self.record(CompileEvent(kernel=str(getattr(src, "name", None) or metadata.get("name", "?")),
                                 key=specialization_key(src, metadata), cached=bool(cache_hit),
                                 seconds=total / 1e6 if isinstance(total, (int, float)) else 0.0,
                                 thread=threading.current_thread().name))

    def install(self) -> bool:
        """Be Triton's compilation listener, chained with the one already there (idempotent).
        Returns False without Triton (nothing compiles then)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        with self._lock:
            current = knobs.compilation.listener
            if not (isinstance(current, _Chained) and current.counter is self):
                knobs.compilation.listener = _Chained(self, current)
        return True


class _Chained:
    """The listener ``install`` puts in Triton's slot: counts, then calls the one it replaced."""

    def __init__(self, counter: CompileCounter, previous: Callable[..., None] | None) -> None:
        self.counter, self.previous = counter, previous

    def __call__(self, **kwargs: Any) -> None:
        guard = self.counter._counting
        outer = not getattr(guard, "active", False)
        if outer:  # an inner wrapper of the same counter (chained twice) must not count again
            self.counter.on_compile(**kwargs)
            guard.active = True
        try:
            if self.previous is not None:
                self.previous(**kwargs)
        finally:
            if outer:
                guard.active = False


@functools.cache
def compile_counter() -> CompileCounter:
    """The process's counter, installed as Triton's compilation listener (on first use: nothing
    is set at import)."""
    counter = CompileCounter()
    counter.install()
    return counter


__all__ = ["CompileCounter", "CompileEvent", "compile_counter", "specialization_key"]
