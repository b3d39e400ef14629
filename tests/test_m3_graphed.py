"""MiniMax-M3 through CaptureManager: graphed steps equal eager steps (CPU: debug-eager path;
GPU: real capture, whole decode graphs where the backend is graph-safe)."""

import pytest
import torch

from graphcap import CaptureConfig
from graphcap.validation import relative_error
from models.minimax_m3.graphed import GraphedM3Runner
from models.minimax_m3.runner import TokenChunk, build_from_preset


def make_pair(device, dtype, backend, buckets=(1, 2, 4, 8, 24), debug=False, preset="tiny", layers=None):
    from models.minimax_m3.config import MiniMaxM3Config

    config = MiniMaxM3Config.preset(preset)
    if layers:
        config = config.first_layers(layers)
    runner = build_from_preset(config, device, dtype, backend=backend, max_tokens=64, max_seqs=6, max_seq_len=160)
    graphed = GraphedM3Runner(runner, CaptureConfig(enabled=True, max_tokens=buckets[-1], buckets=buckets, debug_eager=debug))
    eager = GraphedM3Runner(runner, CaptureConfig(enabled=False, max_tokens=buckets[-1]))
    return runner, graphed, eager


def drive(runner, graphed, eager, tol, steps=6, seed=0):
    """Prefill 5 requests in chunks, then decode and mixed steps; every step runs eagerly and
    graphed on the same cache state and must agree."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.model.config.vocab_size
    lens = {}
    for i in range(5):
        runner.add_request(i)
        lens[i] = 0
    def chunk(i, n):
        return TokenChunk(i, lens[i], torch.randint(0, vocab, (n,), generator=g).tolist())
    plans = [[chunk(i, 20) for i in range(3)]]  # 60 tokens: above the ceiling, eager fallback
    for s in range(steps):
        if s % 3 == 2:
            plans.append([chunk(i, 1) for i in range(4)] + [chunk(4, 17)])  # mixed
        else:
            plans.append([chunk(i, 1) for i in range(1 + s % 4)])  # uniform decode
    for chunks in plans:
        # Both runs write the same slots with the same values, so they see the same cache.
        ref = eager.step(chunks, all_logits=True).logits
        out = graphed.step(chunks, all_logits=True)
        assert relative_error(out.logits.float(), ref.float()) < tol
        for ch in chunks:
            lens[ch.seq_id] = ch.start_pos + len(ch.token_ids)
        # the next plan's chunks start where this step ended
        plans = [[TokenChunk(c.seq_id, lens[c.seq_id], c.token_ids) for c in p] for p in plans]
    return graphed.manager.stats


def test_debug_eager_steps_equal_eager_steps():
    runner, graphed, eager = make_pair("cpu", torch.float32, "torch", debug=True)
    stats = drive(runner, graphed, eager, tol=1e-5)
    assert stats.fallbacks == 1  # the 60-token prefill step
    assert sum(s.hits for s in stats.buckets.values()) == 6


def test_graphed_runner_rejects_a_ceiling_above_capacity():
    runner = build_from_preset("tiny", "cpu", torch.float32, max_tokens=16, max_seqs=4, max_seq_len=64)
    with pytest.raises(ValueError, match="max_tokens"):
        GraphedM3Runner(runner, CaptureConfig(enabled=True, max_tokens=32))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_captured_steps_equal_eager_steps_on_gpu(backend):
    runner, graphed, eager = make_pair("cuda", torch.bfloat16, backend, preset="rank_of_8", layers=4)
    graphed.capture()
    assert graphed.validate() == {}
    assert not runner.has_dummies
    stats = drive(runner, graphed, eager, tol=2e-2)
    whole = [s for (b, full), s in stats.buckets.items() if full]
    if backend == "torch":  # host loops: no whole decode graph may pass through them
        assert all(s.status == "skipped" for s in whole)
    else:
        assert any(s.status == "captured" and s.hits for s in whole)
    assert all(s.status == "captured" for (b, full), s in stats.buckets.items() if not full)


def test_fused_triton_producer_matches_torch_producer():
    """The model with the fused norm+RoPE+cache-write kernel (Triton interpreter on CPU) gives
    the torch producer's logits and cache contents."""
    runs = {}
    for producer in ("torch", "triton"):
        runner = build_from_preset("tiny", "cpu", torch.float32, producer=producer, max_tokens=32, max_seqs=2, max_seq_len=64)
        assert runner.model.producer == producer
        runner.add_request(0)
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, runner.model.config.vocab_size, (14,), generator=g).tolist()
        first = runner.step([TokenChunk(0, 0, prompt)], all_logits=True).logits
        second = runner.step([TokenChunk(0, 14, [5])], all_logits=True).logits
        runs[producer] = (first, second, runner.cache.k_cache.clone(), runner.cache.index_k_cache.clone())
    for a, b in zip(runs["torch"], runs["triton"]):
        assert relative_error(b, a) < 1e-4


def test_unknown_producer_is_rejected():
    with pytest.raises(ValueError, match="producer"):
        build_from_preset("tiny", "cpu", torch.float32, producer="cuda-magic")


def test_dummy_sequences_never_outlive_a_step():
    """Warm-up, capture and validation run on private dummy sequences; none stay in the cache."""
    runner, graphed, eager = make_pair("cpu", torch.float32, "torch", debug=True)
    free_pages = runner.cache.num_free_pages
    graphed.capture()
    graphed.validate()
    assert not runner.has_dummies and runner.cache.num_free_pages == free_pages
    runner.add_request("r")
    graphed.step([TokenChunk("r", 0, [1, 2, 3])])
    assert not runner.has_dummies
