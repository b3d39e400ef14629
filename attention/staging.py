"""Two host staging sets used alternately for asynchronous host-to-device copies.

A per-step host → device copy from pinned memory is only asynchronous if the host does not
overwrite the pinned source while the copy may still be reading it. Two sets are enough:
the set about to be written was last read by the copy of the step before the previous one,
and waiting on that copy's event costs nothing in steady state. ``MetadataBuilder`` and
``TilePlanner`` both stage through this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import torch

S = TypeVar("S")


class PingPongStaging(Generic[S]):
    """Two staging sets made by ``make(pin)`` plus the event of the copy that last read each.

    Args:
        make: builds one staging set; called twice with ``pin`` (pin host memory, True when
            the device is CUDA).
        device: the copies' destination device; copies are non-blocking only on CUDA.
    """

    def __init__(self, make: Callable[[bool], S], device: torch.device) -> None:
        self.non_blocking = device.type == "cuda"
        self.sets: list[S] = [make(self.non_blocking) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._which = 0

    @contextmanager
    def next_set(self) -> Iterator[tuple[int, S]]:
        """Yields ``(index, set)`` of the set to write, after the copy that last read it has
        finished; the caller issues its copies from that set inside the block. On exit the
        event of those copies is recorded (on CUDA), even if the block raised after queueing
        some of them."""
        w = self._which
        self._which ^= 1
        ev = self._events[w]
        if ev is not None:
            ev.synchronize()
        try:
            yield w, self.sets[w]
        finally:
            if self.non_blocking:
                ev = torch.cuda.Event()
                ev.record()
                self._events[w] = ev


__all__ = ["PingPongStaging"]
