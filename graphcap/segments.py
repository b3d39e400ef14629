"""Breakable capture: one graph's forward as graph segments with eager splices between.

While a forward is captured, each splice point ends the current CUDA graph segment, runs its
op eagerly, and starts the next segment in the same memory pool. Replay runs the items in
the recorded order; each splice calls its op again with the tensors it received at capture
(fixed addresses) and reads this step's metadata itself. Sharing one pool between segments
and buckets is safe because items replay in capture order on one stream and never overlap.

A decode-graph capture (uniform decode, every splice graph-safe) records one segment and lets
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
from torch.utils._pytree import tree_map

from .buckets import GraphKey, Padding
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
    """One graph's captured forward: segments and splices in execution order (a decode graph is
    one segment with its splices inside)."""

    key: GraphKey
    items: list[GraphSegment | SpliceCall]
    output: Any
    capture_ms: float = 0.0
    memory_bytes: int = 0
    kept: bool = False  # each segment keeps its cudaGraph_t (its nodes can be read)

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

    def segment_labels(self) -> list[str]:
        """``segment i (after splice 'name')`` per graph segment, in order."""
        labels, last = [], "the start of the forward"
        for item in self.items:
            if isinstance(item, SpliceCall):
                last = f"splice {item.op.name!r}"
            else:
                labels.append(f"segment {item.index} (after {last})")
        return labels

    def segment_nodes(self) -> list[list[Any]]:
        """Each segment's graph nodes (``graphcap.verify.graph_nodes``); needs ``kept``."""
        from .verify.graph_nodes import graph_nodes

        if not self.kept:
            raise ValueError("the graph was captured without keep_graph; its nodes are gone")
        return [graph_nodes(i.graph.raw_cuda_graph()) for i in self.items if isinstance(i, GraphSegment)]


class _Recorder:
    """Splice driver for capture: closes and reopens graph segments around each splice."""

    def __init__(self, pool: Any, padding: Padding, keep_graph: bool = False) -> None:
        self.pool = pool
        self.keep_graph = keep_graph
        self.padding = padding
        self.decode = padding.decode_graph
        self.items: list[GraphSegment | SpliceCall] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph(keep_graph=self.keep_graph)
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        assert self._graph is not None
        graph, self._graph = self._graph, None
        with warnings.catch_warnings():
            # Two adjacent splices leave an empty segment; replaying it is harmless.
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            graph.capture_end()
        if self.keep_graph:
            graph.instantiate()
        self.items.append(GraphSegment(len([i for i in self.items if isinstance(i, GraphSegment)]), graph))

    def abort(self) -> None:
        """End a failed capture so the stream is usable again; the partial graph is dropped."""
        if self._graph is not None:
            graph, self._graph = self._graph, None
            with contextlib.suppress(Exception):
                graph.capture_end()

    def on_splice(self, op: SpliceOp, fn: Callable[..., None], args: tuple, kwargs: dict) -> None:
        if self.decode:
            if not op.graph_safe(args, self.padding):
                raise RuntimeError(
                    f"splice point {op.name!r} is not graph-safe for a decode graph of "
                    f"{self.padding.rows} rows; a decode-graph capture cannot pass through it (declare "
                    f"graph_safe_decode only where it reads all per-request state from fixed device buffers)"
                )
            return call_splice(op, fn, args, kwargs)
        self.end()
        self.items.append(SpliceCall(op, fn, args, kwargs))
        call_splice(op, fn, args, kwargs)
        self.begin()
        return None


class EagerDriver:
    """Splice driver for eager runs (warm-up, debug-eager, fallback): calls each op in order,
    with producer code under the guard when one is given, and records which ops were hit and
    whether each is graph-safe for a decode graph of this padding."""

    def __init__(self, padding: Padding, guard: CaptureGuard | None = None) -> None:
        self.guard = guard
        self.padding = padding
        self.splices: list[SpliceOp] = []
        self.unsafe: set[str] = set()

    def on_splice(self, op: SpliceOp, fn: Callable[..., None], args: tuple, kwargs: dict) -> None:
        self.splices.append(op)
        if not op.graph_safe(args, self.padding):
            self.unsafe.add(op.name)
        if self.guard is None:
            return call_splice(op, fn, args, kwargs)
        with self.guard.paused():
            result = call_splice(op, fn, args, kwargs)
        self.guard.segment = f"segment {len(self.splices)} (after splice {op.name!r})"
        return result


def run_eager(forward: Forward, inputs: dict[str, torch.Tensor], step: Step, padding: Padding,
              guard: CaptureGuard | None, capturing: bool | None = None) -> tuple[Any, EagerDriver]:
    """Run the forward eagerly through the splice path; returns its output and the driver
    (splices hit, and those not graph-safe for a decode graph of ``padding``).

    ``capturing`` (default: a guard is given): producer code must not read the step (as in a
    capture), whether or not the guard checks its ops."""
    driver = EagerDriver(padding, guard)
    capturing = guard is not None if capturing is None else capturing
    with torch.no_grad(), step_context(step, padding, driver, capturing=capturing):
        if guard is None:
            out = forward(inputs)
        else:
            guard.segment = "segment 0 (after the start of the forward)"
            with guard:
                out = forward(inputs)
    return out, driver


def rows_of(out: Any, n: int) -> Any:
    """The first ``n`` rows of every tensor in a forward's output (the real tokens)."""
    return tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, out)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
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


def capture_graph(
    forward: Forward, inputs: dict[str, torch.Tensor], step: Step, padding: Padding, pool: Any,
    stream: torch.cuda.Stream, keep_graph: bool = False,
) -> BreakableGraph:
    """Capture one graph's forward (``padding.rows`` rows; a decode graph if
    ``padding.decode_graph``) on ``stream`` into ``pool``. Producer ops are not guarded here:
    the manager guards one warm-up run of the same shapes (``run_eager``), so they are
    checked once per bucket size; reading the step from producer code is refused still.
    ``keep_graph`` keeps each segment's ``cudaGraph_t`` for ``BreakableGraph.segment_nodes``.

    Raises:
        RuntimeError: a decode-graph capture met a splice that is not graph-safe.
    """
    recorder = _Recorder(pool, padding, keep_graph)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    with torch.no_grad(), torch.cuda.stream(stream), step_context(step, padding, recorder, capturing=True):
        try:
            recorder.begin()
            out = forward(inputs)
            recorder.end()
        except BaseException:
            recorder.abort()
            raise
    torch.cuda.synchronize()
    return BreakableGraph(
        key=GraphKey(padding.rows, padding.decode_graph),
        items=recorder.items,
        output=out,
        capture_ms=(time.perf_counter() - start) * 1e3,
        memory_bytes=max(0, free_before - torch.cuda.mem_get_info()[0]),
        kept=keep_graph,
    )
