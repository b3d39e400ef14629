"""The generic runner is model-agnostic: the toy transformer on the paged cache runs through the
same ``ModelRunner`` as MiniMax-M3, with capture (debug-eager on CPU), checks and invalidation;
and the runner's capture source never reads its manager back."""

import ast
from pathlib import Path

import pytest
import torch

from graphcap import CaptureConfig, CaptureSource, GraphKey, Purpose
from graphcap.verify.compare import relative_error
from models.runner import ModelRunner
from models.toy import ToyConfig, build_toy_runner
from steps import TokenChunk

CFG = ToyConfig(num_layers=2, hidden=32, num_heads=4, vocab=64, page_size=8)


def pair() -> tuple[ModelRunner, ModelRunner]:
    graphed = build_toy_runner(CFG, max_tokens=32, max_seqs=4, max_seq_len=64,
                               capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    return graphed, graphed.with_capture(CaptureConfig(max_tokens=32))


def twice(graphed: ModelRunner, eager: ModelRunner, chunks: list[TokenChunk]) -> None:
    ref = eager.step(chunks, all_logits=True)
    for ch in chunks:
        eager.rewind_request(ch.seq_id, ch.start_pos)
    out = graphed.step(chunks, all_logits=True)
    assert out.next_tokens == ref.next_tokens
    assert relative_error(out.logits, ref.logits) < 1e-5


def test_the_toy_runs_through_the_model_runner_with_capture():
    graphed, eager = pair()
    graphed.capture()
    assert not graphed.has_dummies
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        graphed.add_request(i)

    def chunk(i: int, n: int) -> TokenChunk:
        return TokenChunk(i, graphed.num_written(i), torch.randint(0, CFG.vocab, (n,), generator=g).tolist())

    twice(graphed, eager, [chunk(i, 9) for i in range(3)])  # prefill, 27 tokens: piecewise 32
    for s in range(4):
        twice(graphed, eager, [chunk(i, 1) for i in range(1 + s % 3)])  # decodes
    twice(graphed, eager, [chunk(0, 1), chunk(1, 1), chunk(2, 6)])  # mixed
    stats = graphed.manager.stats
    decode = [s for k, s in stats.buckets.items() if k.decode]
    assert decode and all(s.status == "skipped" for s in decode)  # the torch backend loops on the host
    assert sum(s.hits for k, s in stats.buckets.items() if not k.decode) == 6
    assert graphed.num_written(2) == 9 + 1 + 6


def test_toy_invalidation_through_the_runner_on_cpu():
    graphed, _ = pair()
    graphed.capture()
    graphed.add_request("a")
    graphed.step([TokenChunk("a", 0, [1, 2, 3])])
    graphed.model.lm_head.weight.data = graphed.model.lm_head.weight.data.clone()  # reallocated
    graphed.step([TokenChunk("a", 3, [4])])
    assert graphed.manager.stats.invalidations == 1 and graphed.manager.stats.recaptures == 1
    assert not graphed.has_dummies  # the recapture's dummy requests were released


def test_dummy_steps_per_purpose_lie_on_the_capture_reserve():
    graphed, _ = pair()
    source = graphed.source
    assert isinstance(source, CaptureSource)
    steps = {p: source.dummy_step(GraphKey(8, False), p) for p in Purpose}
    assert graphed.has_dummies
    live = set(range(graphed.cache.config.max_live_seqs))
    for purpose, step in steps.items():
        assert step.num_tokens == (6 if purpose is Purpose.FROZEN_CHECK else 8)
        rows = step.metadata.table_rows_host.tolist()
        assert not set(rows) & live  # never a live request's row
    decode = source.dummy_step(GraphKey(4, True), Purpose.VALIDATE)
    assert decode.uniform_decode and decode.num_seqs == 4
    with pytest.raises(ValueError, match="max_seqs"):
        source.dummy_step(GraphKey(8, True), Purpose.CAPTURE)
    source.release_dummies()
    assert not graphed.has_dummies


RUNNER = Path(__file__).resolve().parents[2] / "models" / "runner"


@pytest.mark.parametrize("module", ["source.py", "dummy_steps.py", "prebuild.py"])
def test_the_capture_source_never_reads_the_manager(module):
    """What tuning, dummy steps and prebuilds need arrives as arguments (keys, the padding)."""
    tree = ast.parse((RUNNER / module).read_text())
    reads = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "manager"]
    assert not reads
