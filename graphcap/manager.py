"""CaptureManager: the one place that decides graph or eager, and the padding, of a step.

Usage::

    manager = CaptureManager(forward, static_inputs, CaptureConfig(enabled=True),
                             prepare=runner.plan, dummy_step=runner.dummy_step)
    manager.register("model", model)
    manager.register("kv_cache", lambda: cache.tensors(), mutable=True)
    manager.capture()                      # warm-up, then capture largest bucket first
    out = manager.run(step)                # replay, or eager through the same code

``forward(inputs)`` receives a dict of per-token tensors (``padding.rows`` rows) plus
``num_real_tokens``; it may call splice points. ``prepare(step, padding)`` is the host-side
plan (never captured) run before every warm-up, capture, replay and eager run, with the
manager's one padding decision for the step (``graphcap.buckets.Padding``).
``dummy_step(bucket, whole_graph)`` builds a step used for warm-up and capture.
``before_capture(manager)`` runs before every capture and recapture (e.g. backends building
graph-mode state for ``manager.whole_buckets``).
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from . import jit_cache
from .buckets import Padding, bucket_for, bucket_list, whole_graph_buckets
from .compile_ahead import compile_ahead, launching
from .config import CaptureConfig
from .frozen import compare_segments
from .guard import CaptureGuard
from .memory import CaptureOutOfMemory, out_of_memory, pool_bytes
from .peers import Gather, Peers
from .registry import Source, StorageRegistry
from .segments import BreakableGraph, EagerDriver, Forward, capture_bucket, frozen_gc, run_eager
from .splice import Step, step_context
from .static import StaticInputs
from .stats import CaptureStats
from .validation import compare_outputs, compare_state

Prepare = Callable[[Step, Padding], None]
DummyStep = Callable[[int, bool], Step]
Key = tuple[int, bool]


def _splice_names(driver: EagerDriver) -> str:
    return ", ".join(sorted(driver.unsafe))


def _rows(out: Any, n: int) -> Any:
    return tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, out)


class CaptureManager:
    """Captures a forward per token-count bucket and replays it, with eager fallback.

    Args:
        forward: the captured function (see the module docstring).
        inputs: the static input buffers the forward reads.
        config: capture settings.
        prepare: host plan per step (``prepare(step, padding)``).
        dummy_step: steps for warm-up, capture and validation (``dummy_step(bucket, whole)``).
        before_capture: called with the manager before every (re)capture.
        request_capacity: most requests one step holds; whole decode graphs (one token per
            request) are never larger.
        sample_step: steps on other data than ``dummy_step`` (other tokens, positions,
            requests; every row real) for ``validate`` (default: ``dummy_step``).
        frozen_step: steps on other data again, with fewer real tokens where the bucket allows,
            for ``detect_frozen`` (default: ``sample_step``).
        gather: ``gather(obj) -> [every rank's obj]`` over the ranks that capture together
            (tensor parallelism): bucket lists must match and every dropped graph is dropped
            on all ranks (``graphcap.peers``). Default: a single process.
    """

    def __init__(
        self,
        forward: Forward,
        inputs: StaticInputs,
        config: CaptureConfig,
        *,
        prepare: Prepare | None = None,
        dummy_step: DummyStep | None = None,
        before_capture: Callable[["CaptureManager"], None] | None = None,
        request_capacity: int | None = None,
        sample_step: DummyStep | None = None,
        frozen_step: DummyStep | None = None,
        gather: Gather | None = None,
    ) -> None:
        if config.max_tokens > inputs.max_tokens:
            raise ValueError(
                f"CaptureConfig.max_tokens={config.max_tokens} exceeds the static input buffers "
                f"({inputs.max_tokens} rows); allocate StaticInputs with max_tokens >= the ceiling"
            )
        jit_cache.configure()  # Triton and flashinfer caches under GRAPHCAP_CACHE_DIR
        self.forward = forward
        self.inputs = inputs
        self.config = config
        self.prepare = prepare or (lambda step, padding: None)
        self.dummy_step = dummy_step
        self.sample_step = sample_step or dummy_step
        self.frozen_step = frozen_step or self.sample_step
        self.before_capture = before_capture
        self.whole_buckets = whole_graph_buckets(config, request_capacity)
        self.buckets = bucket_list(config, self.whole_buckets)
        self.device = inputs.device
        self.stats = CaptureStats()
        self.peers = Peers(gather)
        self.registry = StorageRegistry()
        self.registry.add("static_inputs", inputs.tensors())
        self.failures: dict[Key, str] = {}
        self._graphs: dict[Key, BreakableGraph] = {}
        self._unavailable: set[Key] = set()  # skipped (splices not graph-safe) or dropped by validation
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._captured = False
        self._stale: str | None = None

    # ------------------------------------------------------------------ setup
    @property
    def uses_graphs(self) -> bool:
        """Whether steps replay CUDA graphs (a capturing mode, not debug-eager, on a CUDA device)."""
        return self.config.captures and not self.config.debug_eager and self.device.type == "cuda"

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

    def keys(self) -> list[Key]:
        """(bucket, whole graph) pairs to capture, largest bucket first."""
        keys = [(b, False) for b in self.buckets] + [(b, True) for b in self.whole_buckets]
        return sorted(keys, key=lambda k: (-k[0], k[1]))

    # ---------------------------------------------------------------- padding
    def padding_for(self, step: Step) -> Padding:
        """The one padding decision for ``step`` (see ``_decide``)."""
        return self._decide(step)[0]

    def _decide(self, step: Step) -> tuple[Padding, Key | None]:
        """The smallest whole decode graph holding a uniform decode step, else the smallest
        segmented bucket, else unpadded eager (key ``None``)."""
        n, s = step.num_tokens, step.num_seqs
        if self.config.captures:
            if step.uniform_decode and self.whole_buckets:
                b = bucket_for(n, self.whole_buckets)
                if b is not None and self._available((b, True)):
                    return Padding.bucketed(n, s, b, whole_graph=True), (b, True)
            b = bucket_for(n, self.buckets)
            if b is not None and self._available((b, False)):
                return Padding.bucketed(n, s, b, whole_graph=False), (b, False)
        return Padding.unpadded(n, s), None

    def _available(self, key: Key) -> bool:
        if key in self._unavailable:
            return False
        return key in self._graphs if self.uses_graphs else True

    # ---------------------------------------------------------------- capture
    def capture(self) -> None:
        """Prebuild, warm up, then capture largest bucket first into one pool.

        Phases (seconds in ``stats``): ``jit_s``, the ``before_capture`` hook (JIT builds,
        kernel tuning, backend graph state); ``warmup_s``, one eager run per graph on a side
        stream, producer code guarded once per bucket size; ``capture_s``; then ``validate``
        when configured. In debug-eager mode nothing is captured; each whole-graph bucket is
        run once, guarded, to learn (as a GPU warm-up would) which ones the splices allow.

        Under several ranks (``gather``) capture is collective: every rank calls it at the same
        point, with the same buckets, and a capture that failed on any rank fails on all.

        Raises:
            CaptureViolation: producer code synced with the host or read a CPU tensor; the
                error names the segment and the op. The manager is left with no graphs.
            CaptureOutOfMemory: the GPU ran out of memory; every graph and the pool are freed.
            ValueError: the ranks' bucket lists differ.
            RuntimeError: the capture failed on another rank (this one's graphs are freed).
        """
        if self.config.captures:
            self.peers.require_same("graph buckets (bucket, whole decode)", self.keys())
        if not self.uses_graphs:
            if self.config.captures and self.dummy_step is not None:
                drivers = {}
                for key in (k for k in self.keys() if k[1] and k not in self._unavailable):
                    step = self.dummy_step(*key)
                    drivers[key] = self._run_padded(step, self._padding_of(step, key), guard=True)[1]
                self._skip_unsafe(drivers)
            return
        if self.dummy_step is None:
            raise ValueError("CaptureManager.capture() needs dummy_step(bucket, whole_graph) to build capture inputs")
        # A recapture mid-serving: steps queued by a scheduler running ahead may still replay
        # the old graphs and read their pool; let them finish before anything is freed.
        torch.cuda.synchronize(self.device)
        self._release()
        stats = self.stats
        stats.capture_ms = stats.memory_mib = 0.0
        what = "building kernels (before_capture)"
        try:
            t0 = time.perf_counter()
            if self.before_capture is not None:
                self.before_capture(self)
            torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            stats.jit_s = t1 - t0
            stream = self._capture_stream()
            what = "warming up"
            keys = self._warm_up(stream)
            t2 = time.perf_counter()
            stats.warmup_s = t2 - t1
            self._pool = torch.cuda.graph_pool_handle()
            with frozen_gc():
                for key in keys:
                    what = f"capturing bucket {key[0]} ({'whole decode' if key[1] else 'segmented'} graph)"
                    self._capture_one(key, stream)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            stats.capture_s = time.perf_counter() - t2
            pool = pool_bytes(self._pool)
            stats.pool_mib = stats.memory_mib if pool is None else pool / 2**20
        except torch.OutOfMemoryError as e:
            graphs, held = len(self._graphs), stats.memory_mib
            self._release()
            # The traceback's frames hold the half-captured forward's tensors (pool memory).
            traceback.clear_frames(e.__traceback__)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.peers.all_ok(False)  # the other ranks drop their graphs too (see below)
            raise CaptureOutOfMemory(out_of_memory(what, graphs, held, self.device, e)) from None
        except Exception:
            self._release()
            self.peers.all_ok(False)
            raise
        except BaseException:
            self._release()
            raise
        # Capture records collectives without running them, so a rank that failed while
        # capturing reaches this agreement too. (One that fails while warm-up runs collectives
        # eagerly leaves the others waiting in that collective until NCCL's timeout.)
        if not self.peers.all_ok(True):
            self._release()
            raise RuntimeError("graph capture failed on another rank (its error says why); this rank's graphs "
                               "were freed so that all ranks replay the same graphs")
        self.registry.snapshot()
        self._captured = True
        self._stale = None
        if self.config.validate:
            self.validate()

    def _capture_stream(self) -> torch.cuda.Stream:
        """The side stream warm-up and capture run on: one per manager, since libraries keep
        per-stream state alive (cuBLAS a 32 MiB workspace per stream), so a new stream per
        recapture would leak it."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream

    def _padding_of(self, step: Step, key: Key) -> Padding:
        return Padding.bucketed(step.num_tokens, step.num_seqs, key[0], whole_graph=key[1])

    def _warm_up(self, stream: torch.cuda.Stream) -> list[Key]:
        """``warmup_steps`` eager runs per graph (allocator warm-up, lazy init, the last JIT
        builds), the first run of each bucket size with producer code under the capture guard
        (a whole and a segmented graph of one size run the same producers). Whole decode graphs
        go first: one whose splices are not graph-safe is skipped, and its size gets a
        segmented graph when the buckets are derived. Returns the keys to capture, largest
        first."""
        guarded: set[int] = set()

        def run(key: Key):
            step = self.dummy_step(*key)
            driver = None
            for _ in range(self.config.warmup_steps):
                _, driver = self._run_padded(step, self._padding_of(step, key), guard=key[0] not in guarded)
                guarded.add(key[0])
            return driver

        with torch.cuda.stream(stream):
            self._skip_unsafe({key: run(key) for key in self.keys() if key[1]})
            whole = [k for k in self.keys() if k[1] and k not in self._unavailable]
            segmented = [k for k in self.keys() if not k[1]]
            for key in segmented:
                run(key)
        torch.cuda.synchronize(self.device)
        return sorted(whole + segmented, key=lambda k: (-k[0], k[1]))

    def precompile(self, workers: int | None = None, keys: list[Key] | None = None) -> None:
        """Build every Triton kernel the warm-up would build, many at once: each graph key's
        dummy step runs once eagerly, its host plan (``prepare``) as usual and its forward under
        ``graphcap.compile_ahead`` (Triton launches compile in ``workers`` threads instead of
        running; nothing else changes). Call it from ``before_capture``, after the kernel
        choices ``prepare`` makes.

        Only for a forward whose host code reads no device result and whose torch ops index
        nothing with a Triton kernel's output: inside, those outputs hold whatever their
        buffers held. ``keys``: the graph keys to run (default: all)."""
        if self.dummy_step is None:
            raise ValueError("CaptureManager.precompile() needs dummy_step(bucket, whole_graph)")
        with compile_ahead(workers):  # one pool for every key: compiles overlap across buckets
            for key in self.keys() if keys is None else keys:
                step = self.dummy_step(*key)
                padding = self._padding_of(step, key)
                with launching():  # the host plan's own kernels (if any) run
                    views = self._staged(step, padding)
                run_eager(self.forward, views, step, padding, None)
        torch.cuda.synchronize(self.device)

    def _skip_unsafe(self, drivers: dict[Key, EagerDriver]) -> None:
        """Skip the whole-graph keys whose splices were not graph-safe in their run (``drivers``)
        on this rank or any other (``peers.union``)."""
        unsafe = {key: _splice_names(d) for key, d in drivers.items() if d.unsafe}
        for key, names in self.peers.union(unsafe).items():
            self._skip(key, names)

    def _mark_unsafe(self, key: Key, driver: EagerDriver) -> None:
        """Skip a whole-graph key whose splices were not graph-safe in ``driver``'s run (a
        debug-eager step; this rank alone, since no step may wait on the others)."""
        if driver.unsafe:
            self._skip(key, _splice_names(driver))

    def _skip(self, key: Key, splices: str) -> None:
        """Skip a whole-graph key whose splices are not graph-safe for it. Its steps then run
        segmented: with derived buckets its size gets a segmented graph."""
        stats = self.stats.bucket(*key)
        stats.status, stats.reason = "skipped", f"splices not graph-safe for decode: {splices}"
        self._unavailable.add(key)
        if self.config.buckets is None and self.config.segmented_graphs and key[0] not in self.buckets:
            self.buckets = tuple(sorted((*self.buckets, key[0])))

    def _capture_one(self, key: Key, stream: torch.cuda.Stream) -> None:
        graph = self._capture_step(key, self.dummy_step, self._pool, stream, keep_graph=self.config.detect_frozen)
        self._graphs[key] = graph
        stats = self.stats.bucket(*key)
        stats.status, stats.reason = "captured", ""
        stats.capture_ms, stats.memory_mib = graph.capture_ms, graph.memory_bytes / 2**20
        stats.segments, stats.splices = graph.num_segments, len(graph.splice_names)
        self.stats.capture_ms += graph.capture_ms
        self.stats.memory_mib += stats.memory_mib

    def release(self) -> None:
        """Drop every graph and the pool now (their memory returns to the allocator); the next
        ``run`` captures again."""
        self._release()

    def destroy(self) -> None:
        """Free every graph, the pool and the capture stream, and remove the registry's module
        hooks; the manager is unusable afterwards. Under torch.distributed, call it before the
        process group is destroyed: graphs hold NCCL work on its communicators."""
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)  # replays still queued read the graphs
        self._release()
        self._stream = None
        self.registry.close()

    def _release(self) -> None:
        """Drop every graph and the pool; stale addresses are never replayed."""
        self._graphs.clear()
        self._unavailable.clear()
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
    def ensure_fresh(self) -> bool:
        """Capture now if graphs are due (first use, or registered storage moved). Call it
        before building a step: a capture runs dummy steps that rewrite the caller's
        persistent metadata buffers. Returns True when it captured.

        Raises:
            RuntimeError: graphs are stale and ``recapture_on_invalidation`` is off.
        """
        if not self.uses_graphs:
            return False
        if self._stale is not None:
            raise RuntimeError(
                f"captured graphs are stale ({self._stale}) and recapture_on_invalidation is off; "
                f"call CaptureManager.capture() again"
            )
        if not self._captured:
            self.capture()
            return True
        moved = self.registry.changed()
        if moved is None:
            return False
        self.invalidate(moved)
        if self._stale is not None:
            raise RuntimeError(f"{moved}: captured graphs are invalid and recapture_on_invalidation is off; "
                               f"call CaptureManager.capture() again")
        return True

    def run(self, step: Step, fresh: bool = False) -> Any:
        """Run one step: replay its bucket's graph, or eagerly through the same code.

        Returns the forward's output with ``step.num_tokens`` rows (a view into graph memory
        when replayed: consume it before the next step). A due (re)capture runs first: when the
        step's inputs live in buffers the dummy steps of a capture rewrite (persistent metadata),
        call ``ensure_fresh()`` before building the step, and pass ``fresh=True`` here to skip the
        second check (it walks every registered tensor).
        """
        n = step.num_tokens
        if not fresh:
            self.ensure_fresh()
        padding, key = self._decide(step)
        if key is None:
            self._count_eager(step)
            return self._run_unpadded(step, padding)
        stats = self.stats.bucket(*key)
        self._count(stats, n, padding.rows)
        if not self.uses_graphs:  # debug-eager, or no GPU: the same padding and splice path
            stats.status = "eager"
            out, driver = self._run_padded(step, padding, guard=True)
            if padding.whole_graph:
                self._mark_unsafe(key, driver)  # later steps of this size mirror the segmented graph
            return _rows(out, n)
        return _rows(self._replay(self._graphs[key], step, padding), n)

    def _count_eager(self, step: Step) -> None:
        """Why a step ran eagerly: its mode runs such steps eagerly (``eager_steps``), it is above
        the graphs' ceiling (``fallbacks``), or its graph was skipped or dropped."""
        cfg = self.config
        if not cfg.captures or not (cfg.segmented_graphs or step.uniform_decode):
            self.stats.eager_steps += 1
        elif bucket_for(step.num_tokens, self.buckets if cfg.segmented_graphs else self.whole_buckets) is None:
            self.stats.fallbacks += 1
        else:
            self.stats.dropped_fallbacks += 1

    def _count(self, stats: Any, n: int, bucket: int) -> None:
        stats.hits += 1
        stats.real_tokens += n
        stats.padded_tokens += bucket - n

    def _replay(self, graph: BreakableGraph, step: Step, padding: Padding) -> Any:
        with torch.no_grad(), step_context(step, padding):
            self.prepare(step, padding)
            self.inputs.copy_in(step.inputs, padding)
            return graph.replay()

    def _run_unpadded(self, step: Step, padding: Padding | None = None) -> Any:
        padding = padding or Padding.unpadded(step.num_tokens, step.num_seqs)
        with step_context(step, padding):
            self.prepare(step, padding)
        out, _ = run_eager(self.forward, self.inputs.eager_inputs(step.inputs, step.num_tokens), step, padding, None)
        return out

    def _staged(self, step: Step, padding: Padding) -> dict[str, torch.Tensor]:
        """The host plan (``prepare``) and the copy-in of a padded run: the views the forward
        reads."""
        with step_context(step, padding):
            self.prepare(step, padding)
        return self.inputs.copy_in(step.inputs, padding)

    def _run_padded(self, step: Step, padding: Padding, guard: bool) -> tuple[Any, EagerDriver]:
        views = self._staged(step, padding)
        checker = CaptureGuard(self.device) if guard and self.config.guard_producers else None
        return run_eager(self.forward, views, step, padding, checker, capturing=guard)

    # ------------------------------------------------------------- validation
    def validate(self, sample_step: DummyStep | None = None) -> dict[Key, str]:
        """Replay vs eager on identical inputs for every captured graph.

        For each graph, ``sample_step(bucket, whole)`` (default: the manager's) is run once
        eagerly and unpadded, and once through the graph; outputs must agree within the
        dtype's tolerance, mutable state (caches) must match, and the graph may not touch any
        element eager left unchanged (padded rows write nothing). State is restored after
        each comparison. Failing graphs are dropped (their steps run eagerly) and returned
        with the reason; ``self.failures`` keeps them for the report. With
        ``CaptureConfig.detect_frozen``, ``detect_frozen()`` follows.
        """
        sample_step = sample_step or self.sample_step
        if sample_step is None:
            raise ValueError("validate() needs sample_step(bucket, whole_graph)")
        t0 = time.perf_counter()
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
            graph_out = _rows(self._replay(graph, step, self._padding_of(step, key)), n)
            problems = compare_outputs(eager_out, graph_out) + compare_state(before, eager_state, state)
            for k, t in state.items():
                t.copy_(before[k])
            if problems:
                failures[key] = "; ".join(problems)
        failures = self.peers.union(failures)
        for key, reason in failures.items():
            self._drop(key, reason)
        self.stats.validate_s = time.perf_counter() - t0
        if self.config.detect_frozen:
            failures.update(self.detect_frozen())
        return failures

    def detect_frozen(self, sample_step: DummyStep | None = None) -> dict[Key, str]:
        """Capture every graph again on ``sample_step(bucket, whole)`` (default: the manager's
        ``frozen_step``; other dummy data than the capture's), and once more on ``dummy_step`` (the capture's own data):
        bytes that change between captures of one data set are noise; a difference found is
        confirmed on one more capture of the other data. Each capture has a scratch pool.
        Kernel nodes are compared
        (``graphcap.frozen``): a kernel name, launch or parameter that differs is a host value
        frozen into the graph. Such graphs are dropped (their steps run eagerly) and returned
        with the kernel and segment; ``stats.frozen_s`` is the time taken.

        Raises:
            ValueError: the graphs were captured without ``CaptureConfig.detect_frozen`` (their
                nodes were not kept).
        """
        sample_step = sample_step or self.frozen_step
        if not self.uses_graphs or not self._graphs:
            return {}
        if sample_step is None:
            raise ValueError("detect_frozen() needs sample_step(bucket, whole_graph)")
        t0 = time.perf_counter()
        failures: dict[Key, str] = {}
        stream = self._capture_stream()
        with frozen_gc():
            for key, graph in sorted(self._graphs.items(), key=lambda kv: -kv[0][0]):
                problems = self._recapture_and_compare(key, graph, sample_step, stream)
                if problems:
                    failures[key] = "frozen host value: " + "; ".join(problems)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        failures = self.peers.union(failures)
        for key, reason in failures.items():
            self._drop(key, reason)
        self.stats.frozen_s = time.perf_counter() - t0
        return failures

    def _recapture_and_compare(self, key: Key, graph: BreakableGraph, sample_step: DummyStep,
                               stream: torch.cuda.Stream) -> list[str]:
        if not graph.kept:
            raise ValueError("frozen-value detection needs the captured graphs' nodes: capture with "
                             "CaptureConfig(detect_frozen=True)")
        other = self._capture_again(key, sample_step, stream)
        same = self._capture_again(key, self.dummy_step, stream)
        first, labels = graph.segment_nodes(), graph.segment_labels()
        problems = compare_segments(first, other, labels, same_data=same)
        if problems:  # confirm: a difference counts only where the other data's twin agrees too
            again = self._capture_again(key, sample_step, stream)
            problems = compare_segments(first, other, labels, same_data=same, second_again=again)
        return problems

    def _capture_step(self, key: Key, make_step: DummyStep, pool: Any, stream: torch.cuda.Stream,
                      keep_graph: bool) -> BreakableGraph:
        """Capture ``key`` on ``make_step``'s step: the host plan, the copy-in, the capture
        (producers unguarded: warm-up guarded the same shapes)."""
        step = make_step(*key)
        padding = self._padding_of(step, key)
        views = self._staged(step, padding)
        return capture_bucket(self.forward, views, step, padding, pool, stream, keep_graph)

    def _capture_again(self, key: Key, make_step: DummyStep, stream: torch.cuda.Stream) -> list[list[Any]]:
        """The nodes of one more capture of ``key`` on ``make_step``'s data, in a pool of its
        own (freed with the graph on return)."""
        graph = self._capture_step(key, make_step, torch.cuda.graph_pool_handle(), stream, keep_graph=True)
        return graph.segment_nodes()

    def _drop(self, key: Key, reason: str) -> None:
        """Drop a graph that failed a check; its steps run eagerly, the report keeps why."""
        self._graphs.pop(key, None)
        self._unavailable.add(key)
        self.failures[key] = reason
        stats = self.stats.bucket(*key)
        stats.status, stats.reason = "dropped", reason
