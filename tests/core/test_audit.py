"""Audits while serving (``CaptureConfig.audit_every``), on CPU through the debug-eager path: the
seeded choice of audited steps, and the drop path with an injected corrupt replay (a graph run
whose output is perturbed): caught on its first audited step, dropped, reported, and the step
returns the eager result, so no request sees the bad output."""

import pytest
import torch

from engine import Engine, EngineConfig, SchedulerConfig, make_requests, serve
from graphcap import CaptureConfig, CaptureManager, GraphKey
from graphcap.report import stats_table
from graphcap.stats import CaptureStats
from graphcap.verify.audit import Auditor
from models.toy import ToyConfig, build_toy_runner
from models.toy.bare import ToySource, ToyTransformer, make_step, toy_static_inputs

CFG = ToyConfig(num_layers=2, hidden=32, num_heads=4, vocab=64, max_seqs=6, max_len=32, max_tokens=32)


def audited_positions(every: int, seed: int, steps: int) -> list[int]:
    auditor = Auditor(every, seed, CaptureStats())
    return [i for i in range(steps) if auditor.due()]


@pytest.mark.parametrize("every", [1, 3, 10])
def test_one_step_per_window_reproducibly(every):
    pos = audited_positions(every, seed=7, steps=10 * every)
    assert len(pos) == 10
    assert [p // every for p in pos] == list(range(10))  # exactly one in each window of `every` steps
    assert pos == audited_positions(every, seed=7, steps=10 * every)  # the seed reproduces the run
    if every > 1:
        assert any(audited_positions(every, seed=s, steps=10 * every) != pos for s in range(8))


def test_audit_every_zero_audits_nothing():
    assert audited_positions(0, seed=0, steps=100) == []


def toy_manager(audit_every: int):
    torch.manual_seed(0)
    model = ToyTransformer(CFG)
    config = CaptureConfig(enabled=True, debug_eager=True, max_tokens=32, buckets=(4, 8, 16, 32),
                           audit_every=audit_every)
    manager = CaptureManager(model.forward, toy_static_inputs(CFG, "cpu"), config, ToySource(model))
    manager.register("model", model)
    manager.register("kv_cache", model.cache_tensors, mutable=True)
    return model, manager


def corrupt(manager: CaptureManager, bad: GraphKey) -> list[int]:
    """Perturb the output of graph ``bad`` whenever it runs as a graph; returns the count."""
    runs = []
    run_graph = manager._run_graph

    def perturbed(key, step, padding):
        out = run_graph(key, step, padding)
        if key == bad:
            runs.append(1)
            return out + 1.0
        return out

    manager._run_graph = perturbed
    return runs


def test_a_correct_graph_passes_every_audit():
    model, manager = toy_manager(audit_every=1)
    manager.capture()
    for n in (3, 5, 9, 17):
        manager.run(make_step(CFG, [(0, 0, n)]))
    assert manager.stats.audits == 4 and manager.stats.audit_mismatches == 0
    assert not manager.failures and sum(s.audits for s in manager.stats.buckets.values()) == 4


def test_a_corrupt_replay_is_caught_dropped_reported_and_never_returned():
    model, manager = toy_manager(audit_every=1)
    manager.capture()
    bad = GraphKey(8, False)
    runs = corrupt(manager, bad)
    step = make_step(CFG, [(1, 0, 5), (2, 0, 2)], torch.Generator().manual_seed(3))  # 7 tokens: graph 8
    k_before = model.k_cache.clone()
    out = manager.run(step)
    # The step returned the eager result: the same as an unpadded eager run of the same step.
    k_after = model.k_cache.clone()
    model.k_cache.copy_(k_before)
    padded, _ = manager.eager.padded(step, manager.padding_for(step), guard=False)
    assert torch.equal(out, padded[:7])  # bit for bit the padded eager path of the same padding
    real = slice(0, CFG.max_seqs)  # the last row is the sink padded rows write to (never read)
    assert torch.equal(k_after[:, real], model.k_cache[:, real])  # the cache holds what that path writes
    model.k_cache.copy_(k_before)
    torch.testing.assert_close(out, manager.eager.unpadded(step), rtol=1e-5, atol=1e-5)
    assert runs == [1]
    finding, = manager.stats.audit_findings
    assert finding.key == bad and (finding.num_tokens, finding.num_seqs) == (7, 2)
    assert finding.max_abs_diff == pytest.approx(1.0) and finding.splices == ("toy.attention",)
    stats = manager.stats.graph(bad)
    assert stats.status == "dropped" and manager.failures[bad].startswith("audit: graph 8 piecewise")
    # The graph is not run again: its steps run eagerly from now on, counted as dropped fallbacks.
    manager.run(step)
    assert runs == [1] and manager.stats.dropped_fallbacks == 1
    caption = str(stats_table(manager).caption)
    assert "mismatches 1" in caption and "audit: graph 8 piecewise" in caption


def test_unaudited_steps_of_a_corrupt_graph_still_replay_until_the_first_audit():
    """audit_every=N: the corruption is caught on the graph's first audited step, not before."""
    model, manager = toy_manager(audit_every=4)
    manager.capture()
    bad = GraphKey(4, False)
    runs = corrupt(manager, bad)
    audits = []
    for _ in range(12):
        manager.run(make_step(CFG, [(0, 0, 3)]))
        audits.append(manager.stats.audits)
        if manager.stats.audit_mismatches:
            break
    assert manager.stats.audit_mismatches == 1 and audits[-1] == 1  # caught by the first audit
    assert len(runs) == len(audits) <= 4  # the first window holds the first audited step


def test_serving_with_overlap_commits_no_token_from_a_corrupt_graph():
    """The engine (host overlap on) serves the same requests with and without a corrupt graph:
    with every step audited, each request's tokens equal the clean run's."""
    def serve_tokens(corrupt_key: GraphKey | None) -> tuple[dict, CaptureStats]:
        capture = CaptureConfig(enabled=True, debug_eager=True, max_tokens=32, audit_every=1)
        runner = build_toy_runner(CFG, max_tokens=32, max_seqs=4, max_seq_len=64, capture=capture)
        runner.capture()
        if corrupt_key is not None:
            corrupt(runner.manager, corrupt_key)
        engine = Engine(runner, EngineConfig(SchedulerConfig(chunk_size=16, max_running=4), overlap=True))
        serve(engine, make_requests(8, (5, 20), (4, 10), runner.vocab_size, seed=5), concurrency=4)
        return {rid: s.output for rid, s in engine.states.items()}, runner.manager.stats

    clean, clean_stats = serve_tokens(None)
    dirty, stats = serve_tokens(GraphKey(4, False))
    assert clean_stats.audit_mismatches == 0 and clean_stats.audits > 0
    assert stats.audit_mismatches == 1 and stats.graph(GraphKey(4, False)).status == "dropped"
    assert dirty == clean and all(len(t) > 0 for t in clean.values())
