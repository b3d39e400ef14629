"""RunnerSource: the capture source of a ``ModelRunner`` (``graphcap.source``).

It plans each step (kernel choices for the padding decision's row count, then the attention
plan), builds dummy steps on the cache's capture reserve, and runs the runner's start-up
builds; it never reads the manager.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol, Sequence

from attention.base import AttentionBackend
from graphcap import CaptureSource, GraphKey, Padding, Prebuild, Purpose, Step
from graphcap.verify.compare import TOLERANCE
from kvcache.paged import PagedKVCache
from steps import TokenChunk

from .dummy_steps import DummySteps
from .prebuild import KernelPrebuild
from .protocol import RunnerModel


class RunnerParts(Protocol):
    """What the source uses of its runner."""

    model: RunnerModel
    cache: PagedKVCache
    backend: AttentionBackend
    max_seqs: int
    kernel_prebuild: KernelPrebuild

    @property
    def vocab_size(self) -> int: ...

    def make_step(self, chunks: Sequence[TokenChunk]) -> Step: ...

    def forward_signature(self) -> str: ...


class RunnerSource(CaptureSource):
    """What one runner's manager asks for (see the module docstring).

    Args:
        runner: the ``ModelRunner`` (its model, cache, backend, step builder and start-up builds).
    """

    def __init__(self, runner: RunnerParts) -> None:
        self.runner = runner
        self.dummies = DummySteps(runner.cache, runner.max_seqs, runner.vocab_size, runner.make_step)
        # Deterministic backends (every kernel of a step gives the same bits for the same
        # inputs) are audited bit for bit; others within the model dtype's tolerance.
        dtype = next(runner.model.parameters()).dtype
        self.audit_tolerance = 0.0 if runner.backend.deterministic else TOLERANCE.get(dtype, 1e-3)

    def plan(self, step: Step, padding: Padding) -> None:
        """Kernel choices for ``padding.rows`` (timed only for graph sizes: eager steps of any
        other size must not autotune mid-serving), then the attention plan."""
        r = self.runner
        r.model.ops.choose_kernels(r.model, padding.rows, tune=padding.graph_size)
        r.backend.plan(step, padding)

    def dummy_step(self, key: GraphKey, purpose: Purpose) -> Step:
        return self.dummies.build(key, purpose)

    def release_dummies(self) -> None:
        self.dummies.release()

    @contextlib.contextmanager
    def prebuild(self, keys: Sequence[GraphKey]) -> Iterator[Prebuild]:
        r = self.runner
        with r.kernel_prebuild.run(keys, r.model, r.model.ops, r.backend, r.max_seqs, r.forward_signature()) as plan:
            yield plan
