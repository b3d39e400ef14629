"""Python garbage-collector pauses on one process-wide timeline, for step metrics.

A full (generation 2) collection walks every tracked object of the process: with a large
model, its runner, captured graphs and compiled-kernel caches that is millions of objects,
charged to whichever step the host was launching or waiting on. The engine reads the pauses
that fall inside each step (``StepRecord.gc_ms``), so a slow step says whether the collector
made it slow. (On the H200's long serving run they did not: 27-29 ms of collection over 830
steps, none above 1.1 ms, and moving start-up's objects out of reach with ``gc.freeze``
changed nothing; BENCHMARKS.md, "Long context", round 7.)
"""

from __future__ import annotations

import gc
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class GcPause:
    """One collection: ``start``/``end`` in ``time.perf_counter`` seconds, its generation."""

    start: float
    end: float
    generation: int


class GcTimeline:
    """The last ``keep`` collections of the process, recorded by a ``gc.callbacks`` hook.

    One per process (``timeline()``): every engine reads the same record, and installing the
    hook once keeps engines from piling callbacks onto ``gc.callbacks``.
    """

    def __init__(self, keep: int = 100_000) -> None:
        self.pauses: deque[GcPause] = deque(maxlen=keep)
        self._start: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        elif self._start is not None:
            self.pauses.append(GcPause(self._start, now, int(info["generation"])))
            self._start = None

    def between(self, t0: float, t1: float) -> list[GcPause]:
        """The collections that overlap ``(t0, t1]`` (newest last)."""
        out = []
        for p in reversed(self.pauses):
            if p.end <= t0:
                break
            if p.start < t1:
                out.append(p)
        return out[::-1]


def pause_ms(pauses: list[GcPause], t0: float, t1: float) -> float:
    """Milliseconds of ``pauses`` (``GcTimeline.between(t0, t1)``) inside ``(t0, t1]``."""
    return 1e3 * sum(min(p.end, t1) - max(p.start, t0) for p in pauses)


_TIMELINE: GcTimeline | None = None


def timeline() -> GcTimeline:
    """The process's collection record (the hook is installed on the first call)."""
    global _TIMELINE
    if _TIMELINE is None:
        _TIMELINE = GcTimeline()
    return _TIMELINE


__all__ = ["GcPause", "GcTimeline", "pause_ms", "timeline"]
