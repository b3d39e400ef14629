"""The serving engine on the GPU: graphs under arrivals and departures stay exact, and a
steady decode step never syncs the host."""

import dataclasses

import pytest
import torch

from engine import Engine, EngineConfig, SchedulerConfig, Status, make_requests, serve
from graphcap import CaptureConfig
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config

pytestmark = pytest.mark.cuda


def graphed_runner(layers: int = 4, max_seqs: int = 8, budget: int = 264):
    config = MiniMaxM3Config.preset("rank_of_8").first_layers(layers)
    capture = CaptureConfig(enabled=True, max_tokens=budget)
    runner = build_from_preset(config, "cuda", torch.bfloat16, backend="auto", max_tokens=budget, max_seqs=max_seqs,
                               max_seq_len=1024, capture=capture)
    reference = runner.with_capture(dataclasses.replace(capture, debug_eager=True))
    runner.capture()
    reference.capture()
    return runner, reference


def test_300_serving_steps_match_padded_eager_bit_for_bit():
    runner, reference = graphed_runner()
    engine = Engine(runner, EngineConfig(SchedulerConfig(chunk_size=256), check_every=4), reference=reference)
    requests = make_requests(70, (20, 400), (10, 60), runner.vocab_size, seed=0)
    serve(engine, requests, concurrency=10)
    assert len(engine.stats.steps) >= 300 and {s.kind for s in engine.stats.steps} >= {"decode", "mixed"}
    assert engine.stats.checked_steps >= 75
    assert engine.stats.mismatches == []
    assert len(engine.states) == len(requests) and all(
        s.status is Status.FINISHED and len(s.output) == s.request.max_new_tokens for s in engine.states.values())
    assert runner.num_free_pages == runner.num_pages and runner.cache.num_live_seqs == 0
    hits = sum(b.hits for b in runner.manager.stats.buckets.values())
    assert hits >= len(engine.stats.steps) - 5, "steps should replay graphs, not run eagerly"


def test_steady_decode_step_never_syncs_the_host():
    runner, _ = graphed_runner(layers=2)
    engine = Engine(runner, EngineConfig(SchedulerConfig(chunk_size=256)))
    for r in make_requests(8, (30, 200), (200, 200), runner.vocab_size, seed=1):
        engine.submit(r)
    for _ in range(12):  # prefill, first decodes, kernel choices for every size seen
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert {s.kind for s in engine.stats.steps[-20:]} == {"decode"}
    engine.drain()
