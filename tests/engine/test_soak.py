"""CPU soak: thousands of serving steps with arrivals and departures in the same steps,
chunked prefill mixed with decode, recaptures while requests are live; at the end no page or
slot leak, flat memory, and every request's tokens equal to serving it alone (fp32)."""

import resource

import torch

from engine import Engine, EngineConfig, SchedulerConfig, Status, make_requests, serve
from graphcap import CaptureConfig
from models.minimax_m3 import build_from_preset

STEPS = 3000


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_soak_3000_steps_no_leak_and_every_request_equals_alone():
    torch.manual_seed(0)
    capture = CaptureConfig(enabled=True, debug_eager=True, max_tokens=16)
    runner = build_from_preset("tiny", max_tokens=16, max_seqs=3, max_seq_len=96, capture=capture)
    eager = runner.with_capture(CaptureConfig(max_tokens=16))  # plain eager twin for the alone runs
    sched = SchedulerConfig(chunk_size=10)
    engine = Engine(runner, EngineConfig(sched))
    marks: dict[str, float] = {}
    both = 0

    def on_step(eng, ended):
        nonlocal both
        n = len(eng.stats.steps)
        both += bool(ended) and eng.stats.steps[-1].admitted > 0
        if n % 700 == 0:
            runner.manager.invalidate("soak")  # a recapture while requests are live
        if n == 1000:
            marks["early"] = rss_mib()

    requests, batch = [], 0
    while len(engine.stats.steps) < STEPS:
        more = make_requests(150, (1, 40), (1, 30), runner.vocab_size, seed=batch, prefix=f"b{batch}-")
        requests += more
        serve(engine, more, concurrency=5, on_step=on_step)
        batch += 1
    marks["late"] = rss_mib()

    steps = engine.stats.steps
    assert len(steps) >= STEPS and {s.kind for s in steps} == {"decode", "mixed", "prefill"}
    assert both > 50, "completions and admissions should meet in one engine step"
    assert runner.manager.stats.recaptures >= 4
    assert runner.num_free_pages == runner.num_pages and runner.cache.num_live_seqs == 0
    assert not runner.has_dummies
    assert marks["late"] - marks["early"] < 64, f"memory grew {marks['late'] - marks['early']:.1f} MiB"
    for r in requests:
        s = engine.states[r.request_id]
        assert s.status is Status.FINISHED and len(s.output) == r.max_new_tokens
        solo = Engine(eager, EngineConfig(sched, overlap=False))
        serve(solo, [r], concurrency=1)
        assert solo.states[r.request_id].output == s.output, r.request_id
    assert runner.num_free_pages == runner.num_pages
