"""Compiles after capture and chunk-step figures in the engine's stats (CPU): the runner marks
its capture, the engine takes the compiles of its own steps (attributed to the step that
launched them), summarize reports counts and kernels, and chunk steps are compared within
one context bin."""

import math

import pytest

from engine import Engine, EngineConfig, SchedulerConfig, StepRecord, make_requests, serve, summarize
from engine.metrics import chunk_step_figures
from graphcap import CaptureConfig
from graphcap.startup.compile_counter import CompileEvent, compile_counter
from models.minimax_m3 import build_from_preset

SCHED = SchedulerConfig(token_budget=20, chunk_size=12)


def tiny_captured():
    runner = build_from_preset("tiny", max_tokens=24, max_seqs=3, max_seq_len=256,
                               capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=24))
    runner.capture()
    return runner


def event(kernel: str, cached: bool = False) -> CompileEvent:
    return CompileEvent(kernel, f"{kernel}[BLOCK=64](x: *fp32) warps=4 stages=3", cached, 0.25, "MainThread")


class CompilingRunner:
    """The runner, where launching step ``at`` compiles (records) ``events``, as a first launch
    of a new Triton specialization would."""

    def __init__(self, runner, at: int, events):
        self._r, self.at, self.events, self.launches = runner, at, events, 0

    def __getattr__(self, name):
        return getattr(self._r, name)

    def run_chunks(self, chunks, feed=None, commit=True):
        if self.launches == self.at:
            for e in self.events:
                compile_counter().record(e)
        self.launches += 1
        return self._r.run_chunks(chunks, feed, commit)


def test_the_runner_counts_from_the_end_of_its_capture():
    runner = build_from_preset("tiny", max_tokens=24, max_seqs=3, max_seq_len=256,
                               capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=24))
    assert runner.compiles_after_capture() is None and runner.compiles_during_capture() == []
    capture = runner.manager.capture
    runner.manager.capture = lambda: (compile_counter().record(event("_warmup_kernel")), capture())[1]
    runner.capture()
    assert [e.kernel for e in runner.compiles_during_capture()] == ["_warmup_kernel"]
    assert runner.compiles_after_capture() == []
    compile_counter().record(event("_late"))
    assert [e.kernel for e in runner.compiles_after_capture()] == ["_late"]
    assert runner.compiles_after_capture(1) == []
    twin = runner.with_capture(CaptureConfig(max_tokens=24))
    assert twin.compiles_after_capture() is None  # its own capture has not run


@pytest.mark.parametrize("overlap", [True, False])
def test_compiles_of_an_engines_steps_are_in_its_stats_with_the_step_that_launched_them(overlap):
    runner = tiny_captured()
    compile_counter().record(event("_before_this_engine"))  # after capture, before the engine: not its
    wrapped = CompilingRunner(runner, at=2, events=[event("_attn_kernel"), event("_attn_kernel", cached=True),
                                                    event("_router")])
    eng = Engine(wrapped, EngineConfig(SCHED, overlap=overlap))
    serve(eng, make_requests(3, (20, 30), (3, 4), runner.vocab_size, seed=1), concurrency=3)
    assert eng.stats.counting_compiles
    assert [e.kernel for e in eng.stats.compiles] == ["_attn_kernel", "_attn_kernel", "_router"]
    assert [s.compiles for s in eng.stats.steps[:4]] == [0, 0, 3, 0]
    figures = summarize(eng, 1.0)
    assert figures["compiles_after_capture"] == 2 and figures["disk_loads_after_capture"] == 1
    assert figures["compiled_kernels"] == {"_attn_kernel": 2, "_router": 1}
    assert figures["compile_s_after_capture"] == pytest.approx(0.75)
    assert figures["compile_steps"] == [eng.stats.steps[2].step_id]


def test_an_uncaptured_runner_counts_none_and_serving_without_compiles_reports_zero():
    runner = build_from_preset("tiny", max_tokens=24, max_seqs=3, max_seq_len=256)
    eng = Engine(runner, EngineConfig(SCHED))
    serve(eng, make_requests(2, (5, 9), (2, 3), runner.vocab_size, seed=2), concurrency=2)
    assert not eng.stats.counting_compiles and summarize(eng, 1.0)["compiles_after_capture"] is None
    captured = tiny_captured()
    eng = Engine(captured, EngineConfig(SCHED))
    serve(eng, make_requests(2, (5, 9), (2, 3), runner.vocab_size, seed=2), concurrency=2)
    figures = summarize(eng, 1.0)
    assert figures["compiles_after_capture"] == 0 and figures["compiled_kernels"] == {}  # nothing builds on a CPU


def test_steps_record_the_context_their_prompt_chunks_reach():
    runner = tiny_captured()
    eng = Engine(runner, EngineConfig(SchedulerConfig(token_budget=20, chunk_size=12), overlap=False))
    serve(eng, make_requests(1, (30, 30), (3, 3), runner.vocab_size, seed=4), concurrency=1)
    assert [(s.kind, s.context) for s in eng.stats.steps] == [("prefill", 12), ("prefill", 24), ("prefill", 30),
                                                               ("decode", 0), ("decode", 0)]


def steps_at(contexts_and_ms):
    """Step records completing one after the other, ``ms`` apart (a decode first)."""
    out, t = [StepRecord(0, 1, 1, 1, 0.0, t_done=1.0)], 1.0
    for i, (context, ms) in enumerate(contexts_and_ms, 1):
        t += ms / 1e3
        out.append(StepRecord(i, 13, 2, 1 if context else 2, t, t_done=t, context=context))
    return out


def test_chunk_steps_are_compared_within_a_context_bin():
    eng = Engine(build_from_preset("tiny", max_tokens=24, max_seqs=3, max_seq_len=256), EngineConfig(SCHED))
    # bin (0, 100]: 10, 10, 12, 30 ms; bin (100, 200]: 40, 44, 42 ms; decode steps (context 0) left out.
    eng.stats.steps = steps_at([(20, 10), (40, 10), (0, 5), (60, 12), (100, 30), (120, 40), (150, 44), (200, 42)])
    f = chunk_step_figures(eng, context_bin=100)
    assert f["chunk_steps"] == 7 and f["context_bin"] == 100
    first, second = f["chunk_step_bins"]
    assert (first["context_from"], first["context_to"], first["steps"]) == (0, 100, 4)
    assert first["median_ms"] == pytest.approx(11) and first["worst_ms"] == pytest.approx(30)
    assert first["worst_context"] == 100 and first["worst_step"] == 5
    assert second["ratio"] == pytest.approx(44 / 42)
    assert f["chunk_step_worst_ratio"] == pytest.approx(30 / 11) and f["chunk_step_worst_bin"] == first
    assert f["chunk_step_ms_max"] == pytest.approx(44)
    # a bin of fewer than min_steps steps is listed but not ranked
    assert math.isnan(chunk_step_figures(eng, context_bin=100, min_steps=5)["chunk_step_worst_ratio"])
    assert chunk_step_figures(eng)["context_bin"] == 8 * SCHED.chunk_size  # the default: 8 chunks
