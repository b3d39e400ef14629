"""Breakable capture: one bucket's forward as graph segments with eager splices between.

While a forward is captured, each splice point ends the current CUDA graph segment, runs its
op eagerly, and starts the next segment in the same memory pool. Replay runs the items in
the recorded order; each splice calls its op again with the tensors it received at capture
(fixed addresses) and reads this step's metadata itself. Sharing one pool between segments
and buckets is safe because items replay in capture order on one stream and never overlap.

A whole-graph capture (uniform decode, every splice graph-safe) records one segment and lets
the splices be captured inside it.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .guard import CaptureGuard
from .splice import SpliceOp, Step, call_splice, nvtx_range, step_context

Forward = Callable[[dict[str, torch.Tensor]], Any]


@dataclass
class GraphSegment:
    """Producers between two splice points, captured as one CUDA graph."""

    index: int
    graph: torch.cuda.CUDAGraph

    def run(self) -> None:
        with nvtx_range(f"segment[{self.index}]"):
            self.graph.replay()


@dataclass
class SpliceCall:
    """A splice point recorded at capture: the op and the fixed-address tensors it was given."""

    op: SpliceOp
    fn: Callable[..., None]
    args: tuple
    kwargs: dict

    def run(self) -> None:
        call_splice(self.op, self.fn, self.args, self.kwargs)


@dataclass
class BreakableGraph:
    """One bucket's captured forward."""

    bucket: int
    full: bool
    items: list[GraphSegment | SpliceCall]
    output: Any
    capture_ms: float = 0.0
    memory_bytes: int = 0

    @property
    def num_segments(self) -> int:
        return sum(isinstance(i, GraphSegment) for i in self.items)

    @property
    def splice_names(self) -> list[str]:
        return [i.op.name for i in self.items if isinstance(i, SpliceCall)]

    def replay(self) -> Any:
        for item in self.items:
            item.run()
        return self.output


class _Recorder:
    """Splice driver for capture: closes and reopens graph segments around each splice."""

    def __init__(self, pool: Any, guard: CaptureGuard, full: bool) -> None:
        self.pool = pool
        self.guard = guard
        self.full = full
        self.items: list[GraphSegment | SpliceCall] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        index = len([i for i in self.items if isinstance(i, GraphSegment)])
        self.guard.segment = f"segment {index} (after {self._last_splice()})"
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        assert self._graph is not None
        graph, self._graph = self._graph, None
        with warnings.catch_warnings():
            # Two adjacent splices leave an empty segment; replaying it is harmless.
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            graph.capture_end()
        self.items.append(GraphSegment(len([i for i in self.items if isinstance(i, GraphSegment)]), graph))

    def abort(self) -> None:
        """End a failed capture so the stream is usable again; the partial graph is dropped."""
        if self._graph is not None:
            graph, self._graph = self._graph, None
            with contextlib.suppress(Exception):
                graph.capture_end()

    def _last_splice(self) -> str:
        names = [i.op.name for i in self.items if isinstance(i, SpliceCall)]
        return f"splice {names[-1]!r}" if names else "the start of the forward"

    def on_splice(self, op: SpliceOp, fn: Callable[..., None], args: tuple, kwargs: dict) -> None:
        if self.full:
            if not op.graph_safe_decode:
                raise RuntimeError(
                    f"splice point {op.name!r} is not graph-safe for decode; a whole-graph capture "
                    f"cannot pass through it (declare graph_safe_decode=True only if it reads all "
                    f"per-request state from fixed device buffers)"
                )
            with self.guard.paused():
                return call_splice(op, fn, args, kwargs)
        self.end()
        self.items.append(SpliceCall(op, fn, args, kwargs))
        with self.guard.paused():
            call_splice(op, fn, args, kwargs)
        self.begin()
        return None


class EagerDriver:
    """Splice driver for eager runs (warm-up, debug-eager, fallback): calls each op in order,
    with producer code under the guard when one is given."""

    def __init__(self, guard: CaptureGuard | None = None) -> None:
        self.guard = guard
        self.splices: list[SpliceOp] = []

    def on_splice(self, op: SpliceOp, fn: Callable[..., None], args: tuple, kwargs: dict) -> None:
        self.splices.append(op)
        if self.guard is None:
            return call_splice(op, fn, args, kwargs)
        with self.guard.paused():
            result = call_splice(op, fn, args, kwargs)
        self.guard.segment = f"segment {len(self.splices)} (after splice {op.name!r})"
        return result


def run_eager(forward: Forward, inputs: dict[str, torch.Tensor], step: Step, guard: CaptureGuard | None) -> tuple[Any, list[SpliceOp]]:
    """Run the forward eagerly through the splice path; returns its output and the splices hit."""
    driver = EagerDriver(guard)
    with torch.no_grad(), step_context(step, driver, capturing=guard is not None):
        if guard is None:
            out = forward(inputs)
        else:
            guard.segment = "segment 0 (after the start of the forward)"
            with guard:
                out = forward(inputs)
    return out, driver.splices


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """No garbage collection while capturing: a collection could free (and the allocator reuse)
    memory that a segment being recorded still points at, and it costs time per capture."""
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def capture_bucket(
    forward: Forward, inputs: dict[str, torch.Tensor], step: Step, bucket: int, pool: Any, stream: torch.cuda.Stream, full: bool
) -> BreakableGraph:
    """Capture one bucket's forward on ``stream`` into ``pool``.

    Raises:
        CaptureViolation: producer code synced with the host or read a CPU tensor.
        RuntimeError: a whole-graph capture met a splice that is not graph-safe.
    """
    guard = CaptureGuard(inputs[next(iter(inputs))].device)
    recorder = _Recorder(pool, guard, full)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    with torch.no_grad(), torch.cuda.stream(stream), step_context(step, recorder, capturing=True):
        try:
            recorder.begin()
            with guard:
                out = forward(inputs)
            recorder.end()
        except BaseException:
            recorder.abort()
            raise
    torch.cuda.synchronize()
    return BreakableGraph(
        bucket=bucket,
        full=full,
        items=recorder.items,
        output=out,
        capture_ms=(time.perf_counter() - start) * 1e3,
        memory_bytes=max(0, free_before - torch.cuda.mem_get_info()[0]),
    )
