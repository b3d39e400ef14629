"""CaptureManager: the one place that decides graph or eager, and the padding, of a step.

Usage::

    manager = CaptureManager(forward, static_inputs, CaptureConfig(enabled=True), source)
    manager.register("model", model)
    manager.register("kv_cache", lambda: cache.tensors(), mutable=True)
    manager.capture()                      # prebuild, warm-up, then capture largest graph first
    out = manager.run(step)                # replay, or eager through the same code

``forward(inputs)`` receives a dict of per-token tensors (``padding.rows`` rows) plus
``num_real_tokens``; it may call splice points. The ``source`` (``graphcap.source``) plans each
step for the manager's one padding decision, builds dummy steps per graph key and purpose,
and prebuilds kernels; the manager never hands it a way back in.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import torch

from common.deprecation import warn_renamed

from .buckets import (
    GraphKey,
    Padding,
    bucket_for,
    capture_order,
    decode_graph_buckets,
    eager_warmup_buckets,
    piecewise_graph_buckets,
)
from .capture import Capturer, padding_of
from .config import CaptureConfig
from .eager import EagerPath
from .graph_table import GraphTable
from .memory import CaptureOutOfMemory, out_of_memory, pool_bytes
from .peers import Gather, Peers
from .registry import Source, StorageRegistry
from .segments import BreakableGraph, EagerDriver, Forward, gc_paused, rows_of
from .source import CaptureSource, Purpose
from .splice import Step, step_context
from .startup import jit_cache
from .static import StaticInputs
from .stats import CaptureStats
from .verify.audit import Auditor
from .verify.replay_checks import detect_frozen_values, validate_graphs


class CaptureManager:
    """Captures a forward per graph key and replays it, with eager fallback.

    Args:
        forward: the captured function (see the module docstring).
        inputs: the static input buffers the forward reads.
        config: capture settings.
        source: plans steps, builds dummy steps and prebuilds kernels (``graphcap.source``);
            needed for ``capture`` and the checks. ``None``: steps are not planned.
        request_capacity: most requests one step holds; decode graphs (one token per request)
            are never larger.
        gather: ``gather(obj) -> [every rank's obj]`` over the ranks that capture together
            (tensor parallelism): graph keys must match and every dropped graph is dropped on
            all ranks (``graphcap.peers``). Default: a single process.
    """

    def __init__(self, forward: Forward, inputs: StaticInputs, config: CaptureConfig,
                 source: CaptureSource | None = None, *, request_capacity: int | None = None,
                 gather: Gather | None = None) -> None:
        if config.max_tokens > inputs.max_tokens:
            raise ValueError(
                f"CaptureConfig.max_tokens={config.max_tokens} exceeds the static input buffers "
                f"({inputs.max_tokens} rows); allocate StaticInputs with max_tokens >= the ceiling"
            )
        jit_cache.configure()  # Triton and flashinfer caches under GRAPHCAP_CACHE_DIR
        self.forward, self.inputs, self.config, self.source = forward, inputs, config, source
        self.decode_buckets = decode_graph_buckets(config, request_capacity)
        self.piecewise_buckets = piecewise_graph_buckets(config, self.decode_buckets)
        # Mode decode's eager step sizes, warmed once before the first capture returns.
        self.eager_warmup_buckets = eager_warmup_buckets(config, self.decode_buckets)
        self._eager_warmed = False
        self.device = inputs.device
        self.stats = CaptureStats()
        self.peers = Peers(gather)
        self.registry = StorageRegistry()
        self.registry.add("static_inputs", inputs.tensors())
        self.table = GraphTable(self.stats)
        self.eager = EagerPath(forward, inputs, source, config.guard_producers)
        self.capturer = Capturer(self.eager, source, config, self.device) if source is not None else None
        self._pool: Any = None
        self._captured = False
        self._stale: str | None = None
        self.auditor = Auditor(config.audit_every, config.audit_seed, self.stats)

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

    @property
    def failures(self) -> dict[GraphKey, str]:
        """Graphs dropped by a check, with the reason."""
        return self.table.failures

    def graph(self, key: GraphKey | int, decode: bool = False) -> BreakableGraph | None:
        """The captured graph ``key`` (or of ``key`` rows and kind ``decode``), if any."""
        return self.table.get(key if isinstance(key, GraphKey) else GraphKey(key, decode))

    def keys(self) -> list[GraphKey]:
        """Every graph to capture, in capture order (largest first)."""
        return capture_order([GraphKey(b, False) for b in self.piecewise_buckets]
                             + [GraphKey(b, True) for b in self.decode_buckets])

    def eager_warmup_keys(self) -> list[GraphKey]:
        """The eager step sizes warmed before capture returns (``eager_warmup_buckets``), as
        piecewise keys of dummy steps that are run, never captured; empty once warmed (a
        recapture finds their kernels built and their choices made)."""
        if self._eager_warmed:
            return []
        return capture_order(GraphKey(b, False) for b in self.eager_warmup_buckets)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Deprecated spelling of ``piecewise_buckets``."""
        warn_renamed("CaptureManager.buckets", "CaptureManager.piecewise_buckets")
        return self.piecewise_buckets

    @property
    def whole_buckets(self) -> tuple[int, ...]:
        """Deprecated spelling of ``decode_buckets``."""
        warn_renamed("CaptureManager.whole_buckets", "CaptureManager.decode_buckets")
        return self.decode_buckets

    # ---------------------------------------------------------------- padding
    def padding_for(self, step: Step) -> Padding:
        """The one padding decision for ``step`` (see ``_decide``)."""
        return self._decide(step)[0]

    def _decide(self, step: Step) -> tuple[Padding, GraphKey | None]:
        """The smallest decode graph holding a uniform decode step, else the smallest piecewise
        graph, else unpadded eager (key ``None``)."""
        n, s = step.num_tokens, step.num_seqs
        if self.config.captures:
            candidates = [(self.decode_buckets, True)] if step.uniform_decode else []
            for buckets, decode in [*candidates, (self.piecewise_buckets, False)]:
                b = bucket_for(n, buckets)
                if b is not None and self._available(GraphKey(b, decode)):
                    return Padding.for_graph(n, s, GraphKey(b, decode)), GraphKey(b, decode)
        return Padding.unpadded(n, s, graph_size=n in self.piecewise_buckets or n in self.decode_buckets), None

    def _available(self, key: GraphKey) -> bool:
        if self.table.unavailable(key):
            return False
        return key in self.table if self.uses_graphs else True

    # ---------------------------------------------------------------- capture
    def capture(self) -> None:
        """Prebuild, warm up, then capture largest graph first into one pool.

        Phases (seconds in ``stats``): ``jit_s``, the source's ``prebuild``; ``warmup_s``, eager
        runs on a side stream, producer code guarded once per size; ``capture_s``; then
        ``validate`` when configured. Debug-eager captures nothing: each decode graph runs once,
        guarded, to learn which ones the splices allow, and invalidation checks are armed.
        Under several ranks (``gather``) capture is collective: every rank calls it at the same
        point, with the same graph keys, and a capture that failed on any rank fails on all.

        Raises:
            CaptureViolation: producer code synced with the host or read a CPU tensor; the
                error names the segment and the op. The manager is left with no graphs.
            CaptureOutOfMemory: the GPU ran out of memory; every graph and the pool are freed.
            ValueError: no capture source, or the ranks' graph keys differ.
            RuntimeError: the capture failed on another rank (this one's graphs are freed).
        """
        if self.config.captures:
            self.peers.require_same("graph keys", [str(k) for k in self.keys()])
        if self.source is None and self.config.captures:
            raise ValueError("CaptureManager.capture() needs a CaptureSource (it builds the dummy steps graphs are "
                             "captured on): CaptureManager(forward, inputs, config, source)")
        try:
            if self.uses_graphs:
                self._capture_graphs()
            elif self.config.captures:
                self._probe_decode_graphs()
        finally:
            if self.source is not None:
                self.source.release_dummies()
        if self.config.validate and self._captured:
            self.validate()

    def _probe_decode_graphs(self) -> None:
        """Debug-eager: one guarded run per decode graph (skipping those whose splices are not
        graph-safe), then the invalidation checks are armed."""
        self._release()
        drivers = {}
        for key in (k for k in self.keys() if k.decode):
            step = self.source.dummy_step(key, Purpose.CAPTURE)
            drivers[key] = self.eager.padded(step, padding_of(step, key), guard=True)[1]
        self._skip_unsafe(drivers)
        self.registry.snapshot()
        self._captured, self._stale = True, None

    def _capture_graphs(self) -> None:
        # A recapture mid-serving: steps queued by a scheduler running ahead may still replay
        # the old graphs and read their pool; let them finish before anything is freed.
        torch.cuda.synchronize(self.device)
        self._release()
        stats, capturer = self.stats, self.capturer
        stats.capture_ms = stats.memory_mib = 0.0
        what = "building kernels (prebuild)"
        try:
            t0 = time.perf_counter()
            capturer.prebuild(self.keys() + self.eager_warmup_keys())
            t1 = time.perf_counter()
            stats.jit_s = t1 - t0
            what = "warming up"
            keys = self._warm_up()
            t2 = time.perf_counter()
            stats.warmup_s = t2 - t1
            self._pool = torch.cuda.graph_pool_handle()
            with gc_paused():
                for key in keys:
                    what = f"capturing graph {key}"
                    self.table.add(key, capturer.capture(key, Purpose.CAPTURE, self._pool, self.config.detect_frozen))
            torch.cuda.current_stream(self.device).wait_stream(capturer.stream)
            torch.cuda.synchronize(self.device)
            stats.capture_s = time.perf_counter() - t2
            pool = pool_bytes(self._pool)
            stats.pool_mib = stats.memory_mib if pool is None else pool / 2**20
        except torch.OutOfMemoryError as e:
            graphs, held = len(self.table), stats.memory_mib
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
        self._captured, self._stale = True, None

    def _warm_up(self) -> list[GraphKey]:
        """One warm-up per graph, producer code guarded on the first run of each size (a
        decode and a piecewise graph of one size run the same producers). Decode graphs go
        first: one whose splices are not graph-safe is skipped, and its size gets a piecewise
        graph when the buckets are derived. Returns the keys to capture, in capture order."""
        guarded: set[int] = set()

        def run(key: GraphKey) -> EagerDriver:
            driver = self.capturer.warm_up(key, guard=key.rows not in guarded)
            guarded.add(key.rows)
            return driver

        self._skip_unsafe({key: run(key) for key in self.keys() if key.decode})
        for key in (k for k in self.keys() if not k.decode):
            run(key)
        for key in self.eager_warmup_keys():
            self.capturer.warm_up(key, guard=False, steps=1)
        self._eager_warmed = True
        torch.cuda.synchronize(self.device)
        return [k for k in self.keys() if not self.table.unavailable(k)]

    def _skip_unsafe(self, drivers: dict[GraphKey, EagerDriver]) -> None:
        """Skip the decode graphs whose splices were not graph-safe in their run (``drivers``)
        on this rank or any other (``peers.union``)."""
        unsafe = {key: ", ".join(sorted(d.unsafe)) for key, d in drivers.items() if d.unsafe}
        for key, names in self.peers.union(unsafe).items():
            self._skip(key, names)

    def _skip(self, key: GraphKey, splices: str) -> None:
        """Skip a decode graph whose splices are not graph-safe for it. Its steps then run
        piecewise: with derived buckets its size gets a piecewise graph."""
        self.table.skip(key, splices)
        if self.config.buckets is None and self.config.piecewise_graphs and key.rows not in self.piecewise_buckets:
            self.piecewise_buckets = tuple(sorted((*self.piecewise_buckets, key.rows)))

    def release(self) -> None:
        """Drop every graph and the pool now (memory back to the allocator); the next ``run``
        captures again."""
        self._release()

    def destroy(self) -> None:
        """Free every graph, the pool and the capture stream, and remove the registry's module
        hooks; the manager is unusable afterwards. Under torch.distributed, call it before the
        process group is destroyed: graphs hold NCCL work on its communicators."""
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)  # replays still queued read the graphs
        self._release()
        if self.capturer is not None:
            self.capturer.drop_stream()
        self.registry.close()

    def _release(self) -> None:
        """Drop every graph and the pool; stale addresses are never replayed."""
        self.table.clear()
        self._pool, self._captured = None, False

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
        """Capture now if graphs are due (first use on a GPU, or registered storage moved since
        the last capture; debug-eager checks storage once ``capture()`` armed it). Call it
        before building a step: a capture runs dummy steps that rewrite the caller's persistent
        metadata buffers. Returns True when it captured.

        Raises:
            RuntimeError: graphs are stale and ``recapture_on_invalidation`` is off.
        """
        if not self.config.captures:
            return False
        if self._stale is not None:
            raise RuntimeError(f"captured graphs are stale ({self._stale}) and recapture_on_invalidation is off; "
                               f"call CaptureManager.capture() again")
        if not self._captured:
            if self.uses_graphs:
                self.capture()
            return self.uses_graphs
        moved = self.registry.changed()
        if moved is None:
            return False
        self.invalidate(moved)
        if self._stale is not None:
            raise RuntimeError(f"{moved}: captured graphs are invalid and recapture_on_invalidation is off; "
                               f"call CaptureManager.capture() again")
        return True

    def run(self, step: Step, fresh: bool = False) -> Any:
        """Run one step: replay its graph, or eagerly through the same code.

        Returns the forward's output with ``step.num_tokens`` rows (a view into graph memory
        when replayed: consume it before the next step). A due (re)capture runs first: when the
        step's inputs live in buffers the dummy steps of a capture rewrite (persistent metadata),
        call ``ensure_fresh()`` before building the step, and pass ``fresh=True`` here to skip the
        second check (it walks every registered tensor). With ``CaptureConfig.audit_every``, one
        graph step in that many is audited against the padded eager path (``_audit``).
        """
        n = step.num_tokens
        if not fresh:
            self.ensure_fresh()
        padding, key = self._decide(step)
        if key is None:
            cfg = self.config
            by_mode = not cfg.captures or not (cfg.piecewise_graphs or step.uniform_decode)
            sizes = self.piecewise_buckets if cfg.piecewise_graphs else self.decode_buckets
            self.stats.count_eager(by_mode, above_ceiling=bucket_for(n, sizes) is None)
            return self.eager.unpadded(step, padding)
        stats = self.stats.graph(key)
        stats.hits += 1
        stats.real_tokens += n
        stats.padded_tokens += padding.rows - n
        out = self._run_graph(key, step, padding)
        if self.auditor.due():
            out = self._audit(key, step, padding, out)
        return rows_of(out, n)

    def _run_graph(self, key: GraphKey, step: Step, padding: Padding) -> Any:
        """Replay graph ``key`` for ``step``; without graphs (debug-eager, CPU) the same padding
        and splice path, eagerly."""
        if self.uses_graphs:
            return self._replay(self.table[key], step, padding)
        self.stats.graph(key).status = "eager"
        out, driver = self.eager.padded(step, padding, guard=True)
        if padding.decode_graph and driver.unsafe:  # later steps of this size mirror the piecewise graph
            self._skip(key, ", ".join(sorted(driver.unsafe)))
        return out

    def _audit(self, key: GraphKey, step: Step, padding: Padding, out: Any) -> Any:
        """Run ``step`` again through the padded eager path of the same padding (its plan and
        static inputs are still in place) and compare with the graph's output. A mismatch (on
        any rank) drops the graph and is recorded; the step returns the eager output either
        way, so no request sees a bad replay. The comparison syncs with the host."""
        tolerance = self.source.audit_tolerance if self.source is not None else 0.0
        eager_out, finding = self.auditor.audit(key, step, out, lambda: self.eager.again(step, padding), tolerance)
        # Every rank audits the same step (the same counter), so the agreement pairs up.
        for k, reason in self.peers.union({key: finding.describe()} if finding else {}).items():
            self.table.drop(k, f"audit: {reason}")
        return eager_out

    def _replay(self, graph: BreakableGraph, step: Step, padding: Padding) -> Any:
        self.eager.staged(step, padding)  # the graph reads the static buffers these views slice
        with torch.no_grad(), step_context(step, padding):
            return graph.replay()

    def replay(self, key: GraphKey, step: Step) -> Any:
        """Plan, copy in and replay graph ``key`` for ``step`` (every row; for checks)."""
        return self._replay(self.table[key], step, padding_of(step, key))

    # ------------------------------------------------------------- checks
    def validate(self) -> dict[GraphKey, str]:
        """Replay vs eager on the source's validation data for every captured graph, then
        frozen-value detection with ``CaptureConfig.detect_frozen`` (``graphcap.verify.
        replay_checks``). Failing graphs are dropped (their steps run eagerly) and returned
        with the reason; ``failures`` keeps them for the report."""
        return self._checked(lambda: {**validate_graphs(self),
                                      **(detect_frozen_values(self) if self.config.detect_frozen else {})})

    def detect_frozen(self) -> dict[GraphKey, str]:
        """Capture every graph again on other dummy data and compare kernel nodes (see
        ``graphcap.verify.replay_checks.detect_frozen_values``)."""
        return self._checked(lambda: detect_frozen_values(self))

    def _checked(self, check: Callable[[], dict[GraphKey, str]]) -> dict[GraphKey, str]:
        try:
            return check()
        finally:
            self.source.release_dummies()

