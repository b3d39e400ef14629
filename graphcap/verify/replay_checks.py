"""Checks of every captured graph after capture: replay vs eager, and frozen host values.

``validate_graphs``: for each graph, the source's validation step (other data than the
capture's) runs once eagerly and unpadded, and once through the graph; outputs must agree
within the dtype's tolerance, mutable state (caches) must match, and the graph may not touch
any element eager left unchanged (padded rows write nothing). State is restored after each
comparison.

``detect_frozen_values``: each graph is captured again on the source's frozen-check data and
once more on the capture's own data; bytes that change between captures of one data set are
noise; a difference found is confirmed on one more capture of the other data
(``graphcap.verify.frozen``). A kernel name, launch or parameter that differs is a host value
frozen into the graph.

Failing graphs are dropped (their steps run eagerly) and returned with the reason; under
several ranks a graph failing on one rank is dropped on all (``graphcap.peers``).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_map

from ..buckets import GraphKey
from ..capture import Capturer
from ..eager import EagerPath
from ..graph_table import GraphTable
from ..peers import Peers
from ..registry import StorageRegistry
from ..segments import BreakableGraph, gc_paused, rows_of
from ..source import CaptureSource, Purpose
from ..splice import Step
from ..stats import CaptureStats
from .compare import compare_outputs, compare_state
from .frozen import compare_segments


class CheckedManager(Protocol):
    """What the checks use of a ``CaptureManager`` (its public parts)."""

    table: GraphTable
    eager: EagerPath
    capturer: Capturer
    registry: StorageRegistry
    peers: Peers
    stats: CaptureStats
    source: CaptureSource
    device: torch.device

    @property
    def uses_graphs(self) -> bool: ...

    def replay(self, key: GraphKey, step: Step) -> Any: ...


def _clone(out: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def validate_graphs(manager: CheckedManager) -> dict[GraphKey, str]:
    """Replay vs eager for every captured graph (see the module docstring)."""
    t0 = time.perf_counter()
    failures: dict[GraphKey, str] = {}
    state = manager.registry.mutable_state()
    for key in list(manager.table):
        step = manager.source.dummy_step(key, Purpose.VALIDATE)
        before = {k: t.clone() for k, t in state.items()}
        eager_out = _clone(manager.eager.unpadded(step))
        eager_state = {k: t.clone() for k, t in state.items()}
        for k, t in state.items():
            t.copy_(before[k])
        graph_out = rows_of(manager.replay(key, step), step.num_tokens)
        problems = compare_outputs(eager_out, graph_out) + compare_state(before, eager_state, state)
        for k, t in state.items():
            t.copy_(before[k])
        if problems:
            failures[key] = "; ".join(problems)
    failures = manager.peers.union(failures)
    for key, reason in failures.items():
        manager.table.drop(key, reason)
    manager.stats.validate_s = time.perf_counter() - t0
    return failures


def detect_frozen_values(manager: CheckedManager) -> dict[GraphKey, str]:
    """Capture every graph again on other dummy data and compare kernel nodes (see the module
    docstring); ``stats.frozen_s`` is the time taken.

    Raises:
        ValueError: the graphs were captured without ``CaptureConfig.detect_frozen`` (their
            nodes were not kept).
    """
    if not manager.uses_graphs or not len(manager.table):
        return {}
    t0 = time.perf_counter()
    failures: dict[GraphKey, str] = {}
    with gc_paused():
        for key in sorted(manager.table, key=lambda k: -k.rows):
            problems = _recapture_and_compare(manager, key, manager.table[key])
            if problems:
                failures[key] = "frozen host value: " + "; ".join(problems)
    torch.cuda.current_stream(manager.device).wait_stream(manager.capturer.stream)
    torch.cuda.synchronize(manager.device)
    torch.cuda.empty_cache()
    failures = manager.peers.union(failures)
    for key, reason in failures.items():
        manager.table.drop(key, reason)
    manager.stats.frozen_s = time.perf_counter() - t0
    return failures


def _recapture_and_compare(manager: CheckedManager, key: GraphKey, graph: BreakableGraph) -> list[str]:
    if not graph.kept:
        raise ValueError("frozen-value detection needs the captured graphs' nodes: capture with "
                         "CaptureConfig(detect_frozen=True)")
    capturer = manager.capturer
    other = capturer.nodes(key, Purpose.FROZEN_CHECK)
    same = capturer.nodes(key, Purpose.CAPTURE)
    first, labels = graph.segment_nodes(), graph.segment_labels()
    problems = compare_segments(first, other, labels, same_data=same)
    if problems:  # confirm: a difference counts only where the other data's twin agrees too
        again = capturer.nodes(key, Purpose.FROZEN_CHECK)
        problems = compare_segments(first, other, labels, same_data=same, second_again=again)
    return problems


__all__ = ["detect_frozen_values", "validate_graphs"]
