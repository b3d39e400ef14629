"""GraphTable: a manager's graphs, and the ones it will not replay (skipped or dropped) and why."""

from __future__ import annotations

from typing import Iterator

from .buckets import GraphKey
from .segments import BreakableGraph
from .stats import CaptureStats


class GraphTable:
    """The captured graphs by key, the keys that are unavailable (a decode graph whose splices
    are not graph-safe: ``skipped``; a graph that failed a check: ``dropped``, with the reason in
    ``failures``), and their per-graph stats (``CaptureStats.buckets``)."""

    def __init__(self, stats: CaptureStats) -> None:
        self.stats = stats
        self.failures: dict[GraphKey, str] = {}
        self._graphs: dict[GraphKey, BreakableGraph] = {}
        self._unavailable: set[GraphKey] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def __getitem__(self, key: GraphKey) -> BreakableGraph:
        return self._graphs[key]

    def __len__(self) -> int:
        return len(self._graphs)

    def __iter__(self) -> Iterator[GraphKey]:
        return iter(sorted(self._graphs))

    def get(self, key: GraphKey) -> BreakableGraph | None:
        return self._graphs.get(key)

    def unavailable(self, key: GraphKey) -> bool:
        return key in self._unavailable

    def add(self, key: GraphKey, graph: BreakableGraph) -> None:
        """Keep a captured graph and count its capture time and memory."""
        self._graphs[key] = graph
        stats = self.stats.graph(key)
        stats.status, stats.reason = "captured", ""
        stats.capture_ms, stats.memory_mib = graph.capture_ms, graph.memory_bytes / 2**20
        stats.segments, stats.splices = graph.num_segments, len(graph.splice_names)
        self.stats.capture_ms += graph.capture_ms
        self.stats.memory_mib += stats.memory_mib

    def skip(self, key: GraphKey, splices: str) -> None:
        """A decode graph whose splices (named) are not graph-safe for it: never captured."""
        stats = self.stats.graph(key)
        stats.status, stats.reason = "skipped", f"splices not graph-safe for decode: {splices}"
        self._unavailable.add(key)

    def drop(self, key: GraphKey, reason: str) -> None:
        """A graph that failed a check: freed, its steps run eagerly, ``failures`` keeps why."""
        self._graphs.pop(key, None)
        self._unavailable.add(key)
        self.failures[key] = reason
        stats = self.stats.graph(key)
        stats.status, stats.reason = "dropped", reason

    def clear(self) -> None:
        """Forget every graph and every skip or drop (before a capture: stale addresses are
        never replayed, and a recapture decides again)."""
        self._graphs.clear()
        self._unavailable.clear()


__all__ = ["GraphTable"]
