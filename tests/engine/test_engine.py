"""The serving engine on CPU: batched serving equals each request alone, overlap changes
nothing, stop tokens, refusals, a failing step, admission bounds, the reference check and the
metrics."""

import pytest

from engine import (
    Engine,
    EngineConfig,
    Request,
    SamplingParams,
    SchedulerConfig,
    Status,
    make_requests,
    request_figures,
    serve,
)
from engine.request import RequestState
from graphcap import CaptureConfig
from models.minimax_m3 import build_from_preset

SCHED = SchedulerConfig(token_budget=20, chunk_size=12)


def tiny(max_seqs=3, num_pages=None, capture=None, seed=0):
    return build_from_preset("tiny", max_tokens=24, max_seqs=max_seqs, max_seq_len=256, num_pages=num_pages,
                             capture=capture, seed=seed)


def alone(runner, request: Request) -> list[int]:
    eng = Engine(runner, EngineConfig(SCHED, overlap=False))
    serve(eng, [request], concurrency=1)
    return eng.states[request.request_id].output


def assert_no_leak(runner):
    assert runner.num_free_pages == runner.num_pages and runner.cache.num_live_seqs == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_batched_serving_equals_each_request_alone(overlap):
    runner = tiny(capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=24))
    requests = make_requests(10, (3, 40), (1, 12), runner.vocab_size, seed=3)
    eng = Engine(runner, EngineConfig(SCHED, overlap=overlap))
    serve(eng, requests, concurrency=4)
    assert {s.kind for s in eng.stats.steps} >= {"decode", "mixed"}
    assert_no_leak(runner)
    for r in requests:
        s = eng.states[r.request_id]
        assert s.status is Status.FINISHED and len(s.output) == r.max_new_tokens
        assert s.output == alone(runner, r), r.request_id
    assert_no_leak(runner)


def test_stop_token_ends_a_request_and_its_row_is_freed_after_the_step_in_flight():
    runner = tiny()
    base = make_requests(3, (5, 9), (10, 10), runner.vocab_size, seed=5)
    want = alone(runner, base[0])
    stop = want[3]
    first = want.index(stop)
    requests = [Request(base[0].request_id, base[0].prompt, 10, stop_token_ids={stop}), *base[1:]]
    eng = Engine(runner, EngineConfig(SCHED, overlap=True))
    serve(eng, requests, concurrency=3)
    assert eng.states[base[0].request_id].output == want[: first + 1]
    assert eng.stats.dropped_tokens >= 1  # the overlapped step had already scheduled one more
    assert_no_leak(runner)


def test_requests_the_runner_can_never_serve_fail_at_submit_and_others_run():
    runner = tiny(num_pages=4)
    eng = Engine(runner, EngineConfig(SCHED))
    cases = {
        "empty": Request("empty", (), 3),
        "vocab": Request("vocab", (1, runner.vocab_size), 3),
        "long": Request("long", (1,) * 250, 10),
        "pages": Request("pages", (1,) * 200, 1),
    }
    states = {k: eng.submit(r) for k, r in cases.items()}
    ok = eng.submit(Request("ok", (1, 2, 3), 4))
    eng.drain()
    msgs = {k: s.error for k, s in states.items()}
    assert all(s.status is Status.FAILED for s in states.values())
    assert "prompt is empty" in msgs["empty"] and f"[0, {runner.vocab_size})" in msgs["vocab"]
    assert "max_seq_len" in msgs["long"] and "num_pages" in msgs["pages"]
    assert ok.status is Status.FINISHED and len(ok.output) == 4
    with pytest.raises(ValueError, match="already submitted"):
        eng.submit(Request("ok", (1,), 1))
    assert_no_leak(runner)


class RefusingRunner:
    """A runner that refuses any step holding request ``bad`` (as its checks would a bad
    chunk), before anything is reserved."""

    def __init__(self, runner):
        self._r = runner

    def __getattr__(self, name):
        return getattr(self._r, name)

    def check(self, chunks):
        if any(ch.seq_id == "bad" for ch in chunks):
            raise ValueError("request 'bad': refused by the test runner")
        self._r.check(chunks)

    def run_chunks(self, chunks, feed=None, commit=True):
        self.check(chunks)
        return self._r.run_chunks(chunks, feed, commit)


def test_a_refused_step_fails_only_the_refused_request():
    runner = tiny()
    requests = make_requests(4, (4, 20), (3, 8), runner.vocab_size, seed=9)
    want = {r.request_id: alone(runner, r) for r in requests}
    eng = Engine(RefusingRunner(runner), EngineConfig(SCHED))
    bad = Request("bad", (1, 2, 3, 4), 5)
    serve(eng, [requests[0], bad, *requests[1:]], concurrency=3)
    assert eng.states["bad"].status is Status.FAILED and "refused by the test runner" in eng.states["bad"].error
    for r in requests:
        assert eng.states[r.request_id].output == want[r.request_id]
    assert_no_leak(runner)


def test_admission_keeps_within_pages_slots_and_running_limit():
    runner = tiny(max_seqs=4, num_pages=28)  # 28 pages of 4 positions; a request needs 4..12
    eng = Engine(runner, EngineConfig(SchedulerConfig(token_budget=20, chunk_size=12, max_running=3)))
    requests = make_requests(12, (10, 30), (5, 20), runner.vocab_size, seed=11)
    peak = {"running": 0, "pages": 0, "page_bound": 0}

    def watch(e, ended):
        active = [s for s in e.running if not s.stopped]
        peak["running"] = max(peak["running"], len(active))
        peak["page_bound"] += bool(e.waiting) and len(active) < 3
        assert e.scheduler.claimed_pages <= runner.num_pages
        assert runner.num_pages - runner.num_free_pages <= e.scheduler.claimed_pages
        assert len(e.running) <= runner.max_live_requests
        peak["pages"] = max(peak["pages"], e.scheduler.claimed_pages)

    serve(eng, requests, concurrency=12, on_step=watch)
    assert peak["running"] == 3 and peak["page_bound"] > 0 and peak["pages"] > 12
    assert len(eng.states) == len(requests) and all(s.status is Status.FINISHED for s in eng.states.values())
    assert_no_leak(runner)


def test_scheduler_limits_are_checked():
    runner = tiny()
    with pytest.raises(ValueError, match="token_budget=99 exceeds the runner's max_tokens=24"):
        Engine(runner, EngineConfig(SchedulerConfig(token_budget=99)))
    with pytest.raises(ValueError, match="max_running=9 exceeds"):
        Engine(runner, EngineConfig(SchedulerConfig(max_running=9)))
    with pytest.raises(ValueError, match="SchedulerConfig.chunk_size"):
        SchedulerConfig(chunk_size=0)
    with pytest.raises(ValueError, match="needs a reference runner"):
        Engine(runner, EngineConfig(check_every=2))


class Perturbed(RefusingRunner):
    """The runner's twin whose logits are off by a hair (a graph that is wrong by rounding)."""

    def run_chunks(self, chunks, feed=None, commit=True):
        return self._r.run_chunks(chunks, feed, commit) + 1e-4


def test_reference_check_passes_on_an_exact_twin_and_reports_one_that_disagrees():
    runner = tiny()
    requests = make_requests(3, (4, 10), (3, 5), runner.vocab_size, seed=2)
    twin = runner.with_capture(CaptureConfig(max_tokens=24))  # same weights and cache, the same eager path
    eng = Engine(runner, EngineConfig(SCHED, check_every=2), reference=twin)
    serve(eng, requests, concurrency=3)
    assert eng.stats.checked_steps >= 2 and eng.stats.mismatches == []
    eng = Engine(runner, EngineConfig(SCHED, check_every=2), reference=Perturbed(twin))
    serve(eng, make_requests(3, (4, 10), (3, 5), runner.vocab_size, seed=2, prefix="p"), concurrency=3)
    assert eng.stats.mismatches and "logits differ from the reference" in eng.stats.mismatches[0]
    assert_no_leak(runner)


def test_seeded_sampling_reproduces():
    runner = tiny()
    sp = SamplingParams(temperature=0.8, top_k=20, seed=1234)
    reqs = make_requests(3, (4, 10), (6, 6), runner.vocab_size, seed=4, sampling=sp)
    outs = []
    for _ in range(2):
        eng = Engine(runner, EngineConfig(SCHED))
        serve(eng, reqs, concurrency=3)
        outs.append([eng.states[r.request_id].output for r in reqs])
    assert outs[0] == outs[1]
    assert outs[0] != [alone(runner, Request(r.request_id, r.prompt, 6)) for r in reqs]


def test_request_figures_follow_their_definitions():
    s = RequestState(Request("a", (1,), 5), status=Status.FINISHED, output=[1, 2, 3, 4, 5], t_submit=0.0, t_first=0.5,
                     t_done=1.5)
    t = RequestState(Request("b", (1,), 3), status=Status.FINISHED, output=[1, 2, 3], t_submit=1.0, t_first=1.2,
                     t_done=2.2)
    f = request_figures([s, t, RequestState(Request("c", (1,), 1), status=Status.FAILED)])
    assert f["finished"] == 2 and f["failed"] == 1 and f["output_tokens"] == 8
    assert f["per_user_tok_s_mean"] == pytest.approx((4.0 + 2.0) / 2)
    assert f["ttft_s_p50"] == pytest.approx(0.35) and f["tpot_ms_mean"] == pytest.approx((250 + 500) / 2)
