"""Audits while serving: one graph step in N runs again through the padded eager path.

Start-up checks (``validate``, frozen-value detection, validated kernel choices) run once, on
dummy data. Some failures appear only later, on real data and after hours: a graph reading a
buffer that was swapped without telling the registry, a kernel choice wrong at one shape. An
audit reruns a graph step's forward eagerly on the same staged inputs and plan (the padded
path of the same padding decision) and compares the two outputs bit for bit; the step then
returns the eager output, so a bad replay never reaches a request, and the manager drops the
graph. Which step of each window of ``every`` is audited is drawn from a seeded generator:
reproducible, and not aliased with a workload that repeats every few steps.

What an audit cannot see: cache writes outside the step's own slots (the eager rerun rewrites
the step's slots with correct values; start-up validation checks stray writes).
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..buckets import GraphKey
from ..segments import EagerDriver
from ..splice import Step
from ..stats import AuditFinding, CaptureStats
from .compare import relative_error


class Auditor:
    """Picks the audited steps and compares their two runs.

    Args:
        every: one graph step in ``every`` is audited (0: none).
        seed: seeds the step picked in each window.
        stats: where audits, their time and findings are counted.
    """

    def __init__(self, every: int, seed: int, stats: CaptureStats) -> None:
        self.every, self.stats = every, stats
        self._rng = random.Random(seed)
        self._count = 0
        self._next = self._rng.randrange(every) if every else -1

    def due(self) -> bool:
        """Whether the next graph step is audited (call once per graph step)."""
        if not self.every:
            return False
        i, self._count = self._count, self._count + 1
        if i != self._next:
            return False
        self._next = (i // self.every + 1) * self.every + self._rng.randrange(self.every)
        return True

    def audit(self, key: GraphKey, step: Step, graph_out: Any, rerun: Callable[[], tuple[Any, EagerDriver]],
              tolerance: float) -> tuple[Any, AuditFinding | None]:
        """Compare ``graph_out`` with ``rerun()`` (the padded eager run of the same step).
        Returns the eager output and the finding (``None``: they agree: bit for bit, or within
        ``tolerance`` relative error where the source declares one). Syncs with the host."""
        t0 = time.perf_counter()
        graph_out = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, graph_out)
        eager_out, driver = rerun()
        diff = _difference(graph_out, eager_out, tolerance)
        finding = None
        if diff is not None:
            splices = tuple(dict.fromkeys(op.name for op in driver.splices))
            finding = AuditFinding(key, self._count, step.num_tokens, step.num_seqs, diff, splices)
            self.stats.audit_findings.append(finding)
        self.stats.audits += 1
        self.stats.graph(key).audits += 1
        self.stats.audit_s += time.perf_counter() - t0
        return eager_out, finding


def _difference(graph: Any, eager: Any, tolerance: float) -> float | None:
    """The largest absolute difference between two outputs when they disagree, else ``None``."""
    g_leaves, _ = tree_flatten(graph)
    e_leaves, _ = tree_flatten(eager)
    worst: float | None = None
    for g, e in zip(g_leaves, e_leaves):
        if not isinstance(g, torch.Tensor):
            continue
        if g.shape != e.shape:
            return float("inf")
        same = torch.equal(g, e) if tolerance == 0 else relative_error(g.float(), e.float()) <= tolerance
        if not same:
            d = (g.double() - e.double()).abs().nan_to_num(float("inf")).max().item() if g.numel() else 0.0
            worst = max(worst or 0.0, d)
    return worst


__all__ = ["Auditor"]
