"""CaptureManager: the one place that decides graph or eager for a step.

Usage::

    manager = CaptureManager(forward, static_inputs, CaptureConfig(enabled=True),
                             prepare=runner.plan, dummy_step=runner.dummy_step)
    manager.register("model", model)
    manager.register("kv_cache", lambda: cache.tensors(), mutable=True)
    manager.capture()                      # warm-up, then capture largest bucket first
    logits = manager.run(step)             # replay, or eager through the same code

``forward(inputs)`` receives a dict of per-token tensors (``bucket`` rows) plus
``num_real_tokens``; it may call splice points. ``prepare(step, rows)`` is the host-side plan
(never captured) run before every warm-up, capture, replay and eager run; ``rows`` is the
bucket the step is padded to (or its own size when run unpadded). ``dummy_step(bucket,
uniform_decode)`` builds a step used for warm-up and capture.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from .buckets import bucket_for, bucket_list
from .config import CaptureConfig
from .guard import CaptureGuard
from .registry import Source, StorageRegistry
from .segments import BreakableGraph, Forward, capture_bucket, frozen_gc, run_eager
from .splice import Step, step_context
from .static import StaticInputs
from .stats import CaptureStats
from .validation import compare_outputs, compare_state

Prepare = Callable[[Step, int], None]
DummyStep = Callable[[int, bool], Step]
Key = tuple[int, bool]


def _rows(out: Any, n: int) -> Any:
    return tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, out)


class CaptureManager:
    """Captures a forward per token-count bucket and replays it, with eager fallback."""

    def __init__(
        self,
        forward: Forward,
        inputs: StaticInputs,
        config: CaptureConfig,
        *,
        prepare: Prepare | None = None,
        dummy_step: DummyStep | None = None,
    ) -> None:
        if config.max_tokens > inputs.max_tokens:
            raise ValueError(
                f"CaptureConfig.max_tokens={config.max_tokens} exceeds the static input buffers "
                f"({inputs.max_tokens} rows); allocate StaticInputs with max_tokens >= the ceiling"
            )
        self.forward = forward
        self.inputs = inputs
        self.config = config
        self.prepare = prepare or (lambda step, rows: None)
        self.dummy_step = dummy_step
        self.buckets = bucket_list(config)
        self.device = inputs.device
        self.stats = CaptureStats()
        self.registry = StorageRegistry()
        self.registry.add("static_inputs", inputs.tensors())
        self.failures: dict[Key, str] = {}
        self._graphs: dict[Key, BreakableGraph] = {}
        self._pool: Any = None
        self._captured = False
        self._stale: str | None = None

    # ------------------------------------------------------------------ setup
    @property
    def uses_graphs(self) -> bool:
        """Whether steps replay CUDA graphs (enabled, not debug-eager, on a CUDA device)."""
        return self.config.enabled and not self.config.debug_eager and self.device.type == "cuda"

    def register(self, name: str, source: Source, *, mutable: bool = False) -> None:
        """Register storage the forward reads (weights) or writes (``mutable``: caches).

        Graphs are checked against it before every replay; moving any of it invalidates them.
        """
        self.registry.add(name, source, mutable)
        if self._captured:
            self.registry.snapshot()

    def graph(self, bucket: int, full: bool = False) -> BreakableGraph | None:
        """The captured graph of a bucket, if any (for inspection and tests)."""
        return self._graphs.get((bucket, full))

    def _keys(self) -> list[Key]:
        """(bucket, whole graph) pairs to capture, largest bucket first."""
        keys = [(b, False) for b in self.buckets]
        if self.config.full_graph_decode:
            limit = self.config.full_graph_max_tokens or self.buckets[-1]
            keys += [(b, True) for b in self.buckets if b <= limit]
        return sorted(keys, key=lambda k: (-k[0], k[1]))

    # ---------------------------------------------------------------- capture
    def capture(self) -> None:
        """Warm up every bucket eagerly on a side stream, then capture largest first into one pool.

        Raises:
            CaptureViolation: producer code synced with the host or read a CPU tensor; the
                error names the segment and the op. The manager is left with no graphs.
        """
        if not self.uses_graphs:
            return
        if self.dummy_step is None:
            raise ValueError("CaptureManager.capture() needs dummy_step(bucket, uniform_decode) to build capture inputs")
        self._release()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        keys = self._warm_up(stream)
        self._pool = torch.cuda.graph_pool_handle()
        try:
            with frozen_gc():
                for key in keys:
                    self._capture_one(key, stream)
        except BaseException:
            self._release()
            raise
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.registry.snapshot()
        self._captured = True
        self._stale = None
        if self.config.validate:
            self.validate()

    def _warm_up(self, stream: torch.cuda.Stream) -> list[Key]:
        """Eager runs per key (Triton autotune, flashinfer JIT, allocator warm-up) under the
        capture guard; returns the keys worth capturing (whole graphs only through graph-safe splices)."""
        keys = []
        with torch.cuda.stream(stream):
            for bucket, full in self._keys():
                stats = self.stats.bucket(bucket, full)
                step = self.dummy_step(bucket, full)
                for _ in range(self.config.warmup_steps):
                    _, splices = self._run_padded(step, bucket, guard=True)
                unsafe = sorted({op.name for op in splices if not op.graph_safe_decode})
                if full and unsafe:
                    stats.status, stats.reason = "skipped", f"splices not graph-safe for decode: {', '.join(unsafe)}"
                    continue
                keys.append((bucket, full))
        torch.cuda.synchronize(self.device)
        return keys

    def _capture_one(self, key: Key, stream: torch.cuda.Stream) -> None:
        bucket, full = key
        step = self.dummy_step(bucket, full)
        with step_context(step, None):
            self.prepare(step, bucket)
        views = self.inputs.copy_in(step.inputs, step.num_tokens, bucket)
        graph = capture_bucket(self.forward, views, step, bucket, self._pool, stream, full)
        self._graphs[key] = graph
        stats = self.stats.bucket(bucket, full)
        stats.status, stats.reason = "captured", ""
        stats.capture_ms, stats.memory_mib = graph.capture_ms, graph.memory_bytes / 2**20
        stats.segments, stats.splices = graph.num_segments, len(graph.splice_names)
        self.stats.capture_ms += graph.capture_ms
        self.stats.memory_mib += stats.memory_mib

    def _release(self) -> None:
        """Drop every graph and the pool; stale addresses are never replayed."""
        self._graphs.clear()
        self._pool = None
        self._captured = False

    def invalidate(self, reason: str) -> None:
        """Drop all graphs now (e.g. after resizing a cache); recapture or raise on next run."""
        self.stats.invalidations += 1
        self._release()
        if self.config.recapture_on_invalidation:
            self.stats.recaptures += 1
            self.capture()
        else:
            self._stale = reason

    # -------------------------------------------------------------------- run
    def run(self, step: Step) -> Any:
        """Run one step: replay its bucket's graph, or eagerly through the same code.

        Returns the forward's output with ``step.num_tokens`` rows (a view into graph memory
        when replayed: consume it before the next step).
        """
        n = step.num_tokens
        bucket = bucket_for(n, self.buckets)
        if not self.config.enabled:
            self.stats.eager_steps += 1
            return self._run_unpadded(step)
        if bucket is None:
            self.stats.fallbacks += 1
            return self._run_unpadded(step)
        full = step.uniform_decode and self.config.full_graph_decode
        if not self.uses_graphs:  # debug-eager, or no GPU: same padding and splice path
            stats = self.stats.bucket(bucket, full)
            stats.status = "eager"
            self._count(stats, n, bucket)
            out, _ = self._run_padded(step, bucket, guard=True)
            return _rows(out, n)
        if self._stale is not None:
            raise RuntimeError(
                f"captured graphs are stale ({self._stale}) and recapture_on_invalidation is off; "
                f"call CaptureManager.capture() again"
            )
        if not self._captured:
            self.capture()
        moved = self.registry.changed()
        if moved is not None:
            self.invalidate(moved)
            return self.run(step)
        graph = self._graphs.get((bucket, full)) or self._graphs.get((bucket, False))
        if graph is None:
            self.stats.dropped_fallbacks += 1
            return self._run_unpadded(step)
        self._count(self.stats.bucket(bucket, graph.full), n, bucket)
        return _rows(self._replay(graph, step), n)

    def _count(self, stats: Any, n: int, bucket: int) -> None:
        stats.hits += 1
        stats.real_tokens += n
        stats.padded_tokens += bucket - n

    def _replay(self, graph: BreakableGraph, step: Step) -> Any:
        with torch.no_grad(), step_context(step, None):
            self.prepare(step, graph.bucket)
            self.inputs.copy_in(step.inputs, step.num_tokens, graph.bucket)
            return graph.replay()

    def _run_unpadded(self, step: Step) -> Any:
        with step_context(step, None):
            self.prepare(step, step.num_tokens)
        out, _ = run_eager(self.forward, self.inputs.eager_inputs(step.inputs, step.num_tokens), step, guard=None)
        return out

    def _run_padded(self, step: Step, bucket: int, guard: bool) -> tuple[Any, list]:
        with step_context(step, None):
            self.prepare(step, bucket)
        views = self.inputs.copy_in(step.inputs, step.num_tokens, bucket)
        return run_eager(self.forward, views, step, CaptureGuard(self.device) if guard else None)

    # ------------------------------------------------------------- validation
    def validate(self, sample_step: DummyStep | None = None) -> dict[Key, str]:
        """Replay vs eager on identical inputs for every captured graph.

        For each graph, ``sample_step(bucket, full)`` (default: ``dummy_step``) is run once
        eagerly and unpadded, and once through the graph; outputs must agree within the
        dtype's tolerance, mutable state (caches) must match, and the graph may not touch any
        element eager left unchanged (padded rows write nothing). State is restored after
        each comparison. Failing graphs are dropped (their steps run eagerly) and returned
        with the reason; ``self.failures`` keeps them for the report.
        """
        sample_step = sample_step or self.dummy_step
        if sample_step is None:
            raise ValueError("validate() needs sample_step(bucket, uniform_decode)")
        failures: dict[Key, str] = {}
        state = self.registry.mutable_state()
        for key, graph in sorted(self._graphs.items(), key=lambda kv: kv[0]):
            step = sample_step(*key)
            n = step.num_tokens
            before = {k: t.clone() for k, t in state.items()}
            eager_out = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self._run_unpadded(step))
            eager_state = {k: t.clone() for k, t in state.items()}
            for k, t in state.items():
                t.copy_(before[k])
            graph_out = _rows(self._replay(graph, step), n)
            problems = compare_outputs(eager_out, graph_out) + compare_state(before, eager_state, state)
            for k, t in state.items():
                t.copy_(before[k])
            if problems:
                reason = "; ".join(problems)
                failures[key] = reason
                del self._graphs[key]
                stats = self.stats.bucket(*key)
                stats.status, stats.reason = "dropped", reason
        self.failures.update(failures)
        return failures
