"""Audits on the real capture (H200): a captured graph made wrong by a stale buffer (its kernels
read a tensor the program has since replaced, without telling the registry, and whose memory
now holds something else) is caught on its first audited step, dropped and reported, while
serving goes on with exactly the tokens of the padded eager path."""

import dataclasses

import pytest
import torch

from engine import Engine, EngineConfig, SchedulerConfig, make_requests, serve
from graphcap import CaptureConfig, GraphKey
from graphcap.report import stats_table
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config

pytestmark = pytest.mark.cuda

BAD = GraphKey(8, True)  # the decode graph of 8 requests


class StaleBias:
    """A bias the forward adds to its output: zeros, held outside every registered source, one
    tensor for 8-row forwards and one for the rest. ``go_stale`` replaces the 8-row tensor by
    new zeros (what eager reads from then on) and fills the old one with fours: graphs captured
    before still read it, as a kernel reads a freed buffer that something else reused."""

    def __init__(self, hidden: int) -> None:
        self.eight, self.other = (torch.zeros(hidden, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        self.old: list[torch.Tensor] = []

    def __call__(self, rows: int) -> torch.Tensor:
        return self.eight if rows == 8 else self.other

    def go_stale(self) -> None:
        self.old.append(self.eight)
        self.eight = torch.zeros_like(self.eight)
        self.old[-1].fill_(4.0)


def runners(audit_every: int):
    """A graphed runner and its padded debug-eager reference over one model whose forward adds
    the stale bias; the bias goes stale after both captured."""
    config = MiniMaxM3Config.preset("rank_of_8").first_layers(4)
    capture = CaptureConfig(enabled=True, max_tokens=72, audit_every=audit_every)
    base = build_from_preset(config, "cuda", torch.bfloat16, backend="auto", max_tokens=72, max_seqs=8,
                             max_seq_len=256)
    bias = StaleBias(config.hidden_size)
    forward = base.model.hidden_states

    def biased(inputs):
        return forward(inputs) + bias(inputs["input_ids"].shape[0])

    base.model.hidden_states = biased  # the managers made below capture this forward
    graphed = base.with_capture(capture)
    reference = base.with_capture(dataclasses.replace(capture, debug_eager=True, audit_every=0))
    graphed.capture()
    reference.capture()
    bias.go_stale()
    return graphed, reference


def drop_after_first_use(runner, key: GraphKey) -> None:
    """Route ``runner`` as the audited run will be routed: ``key`` runs once, then is dropped."""
    manager = runner.manager
    run_graph = manager._run_graph

    def once(k, step, padding):
        out = run_graph(k, step, padding)
        if k == key:
            manager.table.drop(key, "mirrors the audited run's drop")
        return out

    manager._run_graph = once


def serve_all(runner) -> dict:
    engine = Engine(runner, EngineConfig(SchedulerConfig(chunk_size=64, max_running=8), overlap=True))
    serve(engine, make_requests(12, (20, 60), (12, 24), runner.vocab_size, seed=3), concurrency=8)
    return {rid: s.output for rid, s in engine.states.items()}


def test_the_stale_graph_really_differs_without_audits():
    graphed, reference = runners(audit_every=0)
    assert serve_all(graphed) != serve_all(reference)  # the same routes; the stale read reaches the tokens
    assert graphed.manager.stats.graph(BAD).hits > 0


def test_a_stale_graph_is_caught_dropped_reported_and_no_wrong_token_is_committed():
    graphed, reference = runners(audit_every=1)
    drop_after_first_use(reference, BAD)
    want = serve_all(reference)
    got = serve_all(graphed)
    stats = graphed.manager.stats
    assert [f.key for f in stats.audit_findings] == [BAD]  # caught on its first (audited) step, once
    finding = stats.audit_findings[0]
    assert finding.max_abs_diff >= 3.9 and "attention.sparse" in finding.splices
    assert stats.graph(BAD).status == "dropped" and graphed.manager.graph(BAD) is None
    assert stats.graph(BAD).hits == 1  # never replayed again
    assert stats.audits > 20 and sum(s.audits for s in stats.buckets.values()) == stats.audits
    assert got == want and all(got.values())  # every committed token is the padded eager path's
    assert "mismatches 1" in str(stats_table(graphed.manager).caption)
    graphed.destroy()
    reference.destroy()
