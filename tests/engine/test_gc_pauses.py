"""Garbage-collector pauses in the engine's step records (CPU): the process-wide record of
collections, the share of a collection that falls inside a step's wall, and the step that a
collection during its launch is charged to."""

import gc

import pytest

from engine import (
    STEP_LOG_COLUMNS,
    Engine,
    EngineConfig,
    SchedulerConfig,
    gc_figures,
    make_requests,
    serve,
    step_log,
)
from engine.gc_pauses import GcPause, GcTimeline, pause_ms, timeline
from models.minimax_m3 import build_from_preset

SCHED = SchedulerConfig(token_budget=20, chunk_size=12)


def tiny():
    return build_from_preset("tiny", max_tokens=24, max_seqs=3, max_seq_len=256)


def test_the_timeline_clips_collections_to_a_window():
    t = GcTimeline(keep=10)
    try:
        t.pauses.extend([GcPause(1.0, 1.5, 0), GcPause(2.0, 2.1, 2), GcPause(3.0, 3.4, 1)])
        assert [p.start for p in t.between(1.2, 3.1)] == [1.0, 2.0, 3.0]
        assert t.between(1.5, 2.0) == []  # (t0, t1]: one that ended at t0 and one that starts at t1 are outside
        assert pause_ms(t.between(1.2, 3.1), 1.2, 3.1) == pytest.approx(1e3 * (0.3 + 0.1 + 0.1))
        assert pause_ms(t.between(0.0, 10.0), 0.0, 10.0) == pytest.approx(1e3 * (0.5 + 0.1 + 0.4))
    finally:
        gc.callbacks.remove(t._on_gc)


def test_one_record_per_process():
    assert timeline() is timeline()
    assert gc.callbacks.count(timeline()._on_gc) == 1


class CollectingRunner:
    """The runner, where launching step ``at`` runs a full collection (as the collector would
    when its thresholds trip)."""

    def __init__(self, runner, at: int):
        self._r, self.at, self.launches = runner, at, 0

    def __getattr__(self, name):
        return getattr(self._r, name)

    def run_chunks(self, chunks, feed=None, commit=True):
        if self.launches == self.at:
            gc.collect()
        self.launches += 1
        return self._r.run_chunks(chunks, feed, commit)


def test_a_collection_is_charged_to_the_step_whose_wall_holds_it():
    runner = CollectingRunner(tiny(), at=3)
    gc.disable()  # only the runner's collection happens
    try:
        eng = Engine(runner, EngineConfig(SCHED, overlap=False))
        serve(eng, make_requests(3, (5, 20), (4, 6), runner.vocab_size, seed=2), concurrency=3)
    finally:
        gc.enable()
    steps = eng.stats.steps
    assert steps[3].gc_full == 1 and steps[3].gc_ms > 0
    assert all(s.gc_ms == 0 and s.gc_full == 0 for i, s in enumerate(steps) if i != 3)
    fig = gc_figures(eng)
    assert fig["gc_full_collections"] == 1 and fig["gc_ms_total"] == pytest.approx(steps[3].gc_ms)
    assert fig["gc_ms_max"] == pytest.approx(steps[3].gc_ms)
    log = step_log(eng)
    assert len(log) == len(steps) - 1 and all(len(row) == len(STEP_LOG_COLUMNS) for row in log)
    row = dict(zip(STEP_LOG_COLUMNS, log[2]))  # the log starts at the second completed step
    assert row["step"] == steps[3].step_id and row["gc_full"] == 1 and row["launch_ms"] >= 0
