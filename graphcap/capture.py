"""Capturer: how a manager's graphs are built, one phase at a time.

The manager decides which graphs to build and keeps them; this does the building: the
source's prebuild (with forward kernels compiled ahead inside it), the guarded warm-up, one
graph's capture on the side stream, and extra captures for frozen-value detection.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .buckets import GraphKey, Padding
from .config import CaptureConfig
from .eager import EagerPath
from .segments import BreakableGraph, EagerDriver, capture_graph, run_eager
from .source import CaptureSource, Purpose
from .splice import Step
from .startup.compile_ahead import compile_ahead, launching


def padding_of(step: Step, key: GraphKey) -> Padding:
    """A dummy step of ``key`` run as that graph."""
    return Padding.for_graph(step.num_tokens, step.num_seqs, key)


class Capturer:
    """Builds graphs for one manager.

    Args:
        eager: the manager's eager path (warm-up runs, staged inputs).
        source: dummy steps and the prebuild.
        config: ``warmup_steps``.
        device: the CUDA device.
    """

    def __init__(self, eager: EagerPath, source: CaptureSource, config: CaptureConfig, device: torch.device) -> None:
        self.eager, self.source, self.config, self.device = eager, source, config, device
        self._stream: torch.cuda.Stream | None = None

    @property
    def stream(self) -> torch.cuda.Stream:
        """The side stream warm-up and capture run on: one per manager, since libraries keep
        per-stream state alive (cuBLAS a 32 MiB workspace per stream), so a new stream per
        recapture would leak it. Ordered after the current stream's work."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream

    def drop_stream(self) -> None:
        self._stream = None

    def prebuild(self, keys: list[GraphKey]) -> None:
        """The source's builds for ``keys``, and inside them the forward kernels it asks for."""
        with self.source.prebuild(keys) as plan:
            if plan.compile_forward:
                self.compile_forwards(plan.compile_forward, plan.workers)
        torch.cuda.synchronize(self.device)

    def compile_forwards(self, keys: Iterable[GraphKey], workers: int) -> None:
        """Build every Triton kernel the warm-up of ``keys`` would build, many at once: each
        key's dummy step runs once eagerly, its host plan as usual and its forward under
        ``graphcap.startup.compile_ahead`` (Triton launches compile in ``workers`` threads
        instead of running). The forward must not read a device result on the host nor index
        a torch op with a Triton kernel's output (those outputs stay as allocated); the dummy
        steps sit on the capture reserve, so nothing here touches live requests."""
        with compile_ahead(workers):  # one pool for every key: compiles overlap across graphs
            for key in keys:
                step = self.source.dummy_step(key, Purpose.CAPTURE)
                padding = padding_of(step, key)
                with launching():  # the host plan's own kernels (if any) run
                    views = self.eager.staged(step, padding)
                run_eager(self.eager.forward, views, step, padding, None)
        torch.cuda.synchronize(self.device)

    def warm_up(self, key: GraphKey, guard: bool, steps: int | None = None) -> EagerDriver:
        """``steps`` (default ``warmup_steps``) eager runs of ``key``'s dummy step on the side
        stream (allocator warm-up, lazy init, the last JIT builds), the first guarded when
        ``guard``. Returns the last run's driver (which splices ran, which are not graph-safe)."""
        step = self.source.dummy_step(key, Purpose.CAPTURE)
        with torch.cuda.stream(self.stream):
            for i in range(steps or self.config.warmup_steps):
                _, driver = self.eager.padded(step, padding_of(step, key), guard=guard and i == 0)
        return driver

    def capture(self, key: GraphKey, purpose: Purpose, pool: Any, keep_graph: bool) -> BreakableGraph:
        """Capture ``key`` on the source's dummy step for ``purpose``: the host plan, the
        copy-in, the capture (producers unguarded: warm-up guarded the same shapes)."""
        step = self.source.dummy_step(key, purpose)
        padding = padding_of(step, key)
        views = self.eager.staged(step, padding)
        return capture_graph(self.eager.forward, views, step, padding, pool, self.stream, keep_graph)

    def nodes(self, key: GraphKey, purpose: Purpose) -> list[list[Any]]:
        """The kernel nodes of one more capture of ``key`` on ``purpose``'s dummy data, in a pool
        of its own (freed with the graph on return); for frozen-value detection."""
        return self.capture(key, purpose, torch.cuda.graph_pool_handle(), keep_graph=True).segment_nodes()


__all__ = ["Capturer", "padding_of"]
