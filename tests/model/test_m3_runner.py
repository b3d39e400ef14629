"""MiniMax-M3 steps through the runner: graphed (GPU) or debug-eager (CPU) steps equal eager
steps; the padding sweep over every request capacity; refused chunks leave the cache exactly
as a history without them; no request reads another's cache contents."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphcap import CaptureConfig, GraphKey, Purpose, decode_graph_buckets
from graphcap.verify.compare import relative_error
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config
from models.runner import ModelRunner
from steps import TokenChunk

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_pair(device, dtype, backend, buckets=(1, 2, 4, 8, 24), debug=False, preset="tiny", layers=None,
              max_seqs=6, max_tokens=64, max_seq_len=160) -> tuple[ModelRunner, ModelRunner]:
    """A graphed runner and an eager one over the same model, cache and backend."""
    config = MiniMaxM3Config.preset(preset)
    if layers:
        config = config.first_layers(layers)
    capture = CaptureConfig(enabled=True, max_tokens=buckets[-1] if buckets else max_tokens, buckets=buckets,
                            debug_eager=debug)
    graphed = build_from_preset(config, device, dtype, backend=backend, max_tokens=max_tokens, max_seqs=max_seqs,
                                max_seq_len=max_seq_len, capture=capture)
    return graphed, graphed.with_capture(CaptureConfig(max_tokens=max_tokens))


def twice(graphed: ModelRunner, eager: ModelRunner, chunks, tol: float) -> torch.Tensor:
    """Run ``chunks`` eagerly, rewind, run them graphed: both see the same cache state.

    ``tol`` bounds the relative logit error; ``0`` asks for bit-identical logits (a reference
    that runs the same kernels at the same shapes: the padded debug-eager path)."""
    ref = eager.step(chunks, all_logits=True)
    for ch in chunks:
        eager.rewind_request(ch.seq_id, ch.start_pos)
    out = graphed.step(chunks, all_logits=True)
    if tol == 0:
        assert torch.equal(out.logits, ref.logits), relative_error(out.logits.float(), ref.logits.float())
    else:
        assert out.next_tokens == ref.next_tokens or tol > 1e-4
        assert relative_error(out.logits.float(), ref.logits.float()) < tol
    return out.logits


def drive(graphed, eager, tol, steps=6, seed=0):
    """Prefill 5 requests in chunks, then decode and mixed steps, each graphed and eager."""
    g = torch.Generator().manual_seed(seed)
    vocab = graphed.model.config.vocab_size
    for i in range(5):
        graphed.add_request(i)

    def chunk(i, n):
        return TokenChunk(i, graphed.num_written(i), torch.randint(0, vocab, (n,), generator=g).tolist())

    twice(graphed, eager, [chunk(i, 20) for i in range(3)], tol)  # 60 tokens: above the ceiling, eager
    for s in range(steps):
        if s % 3 == 2:
            twice(graphed, eager, [chunk(i, 1) for i in range(4)] + [chunk(4, 17)], tol)  # mixed
        else:
            twice(graphed, eager, [chunk(i, 1) for i in range(1 + s % 4)], tol)  # uniform decode
    return graphed.manager.stats


def test_debug_eager_steps_equal_eager_steps():
    graphed, eager = make_pair("cpu", torch.float32, "torch", debug=True)
    stats = drive(graphed, eager, tol=1e-5)
    assert stats.fallbacks == 1  # the 60-token prefill step
    assert sum(s.hits for s in stats.buckets.values()) == 6


def test_runner_rejects_a_ceiling_above_capacity():
    with pytest.raises(ValueError, match="max_tokens"):
        build_from_preset("tiny", "cpu", torch.float32, max_tokens=16, max_seqs=4, max_seq_len=64,
                          capture=CaptureConfig(enabled=True, max_tokens=32))


def sweep(max_seqs: int, buckets, device: str, dtype: torch.dtype, backend: str, layers: int = 2) -> dict:
    """Uniform decode at every batch size up to ``max_seqs``, then a mixed step at capacity;
    each step graphed (or debug-eager) and eager on the same cache state."""
    max_tokens = 64
    graphed, eager = make_pair(device, dtype, backend, buckets=buckets, debug=device == "cpu", layers=layers,
                               preset="tiny" if device == "cpu" else "rank_of_8", max_seqs=max_seqs,
                               max_tokens=max_tokens, max_seq_len=96)
    graphed.capture()
    tol = 1e-5
    if device == "cuda":  # replay must equal the padded eager path bit for bit
        eager, tol = graphed.with_capture(dataclasses.replace(graphed.manager.config, debug_eager=True)), 0.0
    for i in range(max_seqs):
        graphed.add_request(i)
    twice(graphed, eager, [TokenChunk(i, 0, [i % 7 + 1]) for i in range(max_seqs)], tol)
    for b in range(1, max_seqs + 1):
        twice(graphed, eager, [TokenChunk(i, graphed.num_written(i), [(b + i) % 11]) for i in range(b)], tol)
    prefill = min(max_tokens - (max_seqs - 1), 20)  # every request in one step, a prefill chunk among them
    mixed = [TokenChunk(i, graphed.num_written(i), [3]) for i in range(max_seqs - 1)]
    mixed.append(TokenChunk(max_seqs - 1, graphed.num_written(max_seqs - 1), [5] * prefill))
    twice(graphed, eager, mixed, tol)
    return graphed.manager.stats.buckets


BUCKET_LISTS = [None, (1, 2, 3, 6, 8, 24, 64), (1, 2, 4, 8, 24, 64), (5, 7, 64)]


@pytest.mark.parametrize("buckets", BUCKET_LISTS, ids=["default", "non-default", "1248-24", "sparse"])
def test_every_request_capacity_decodes_up_to_capacity(buckets):
    """The bug this guards: a decode batch between the largest decode-graph bucket and
    ``max_seqs`` landed on a piecewise bucket whose request rows exceeded capacity."""
    hit_piecewise_decode = False
    for max_seqs in range(1, 41):
        stats = sweep(max_seqs, buckets, "cpu", torch.float32, "torch")
        hit_piecewise_decode |= any(not key.decode and key.rows > max_seqs for key, s in stats.items() if s.hits)
    assert hit_piecewise_decode  # the sweep did reach piecewise buckets above the request capacity


@pytest.mark.cuda
@pytest.mark.parametrize("buckets", [None, (1, 2, 3, 6, 8, 24, 64)], ids=["default", "non-default"])
@pytest.mark.parametrize("max_seqs", [1, 3, 5, 6, 9, 10, 17, 40])
def test_every_request_capacity_replays_on_gpu(max_seqs, buckets):
    stats = sweep(max_seqs, buckets, "cuda", torch.bfloat16, "auto", layers=4)
    decode = {key.rows for key, s in stats.items() if key.decode and s.status == "captured"}
    # The one rule (graphcap.buckets): default decode buckets run up to the request capacity itself.
    want = set(decode_graph_buckets(CaptureConfig(max_tokens=64, buckets=buckets), max_seqs))
    assert decode == want, "every decode-graph bucket, non-default sizes included, captures on flashinfer + Triton"
    assert all(s.status == "captured" for s in stats.values() if s.hits)


# ---- refused steps ----------------------------------------------------------------------


def cache_state(r: ModelRunner) -> list:
    c = r.cache
    return [c.k_cache.clone(), c.v_cache.clone(), c.index_k_cache.clone(), c.block_tables.clone(),
            c.num_free_pages, {s: (c.pages(s), c.num_written(s)) for s in c._row}]


def assert_same_state(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


BAD_STEPS = {
    "gap": (lambda r: [TokenChunk("a", r.num_written("a") + 3, [1])], ValueError, "request 'a'.*skips past"),
    "duplicate": (lambda r: [TokenChunk("a", r.num_written("a"), [1]), TokenChunk("a", r.num_written("a") + 1, [2])],
                  ValueError, "request 'a' appears twice"),
    "out of vocab": (lambda r: [TokenChunk("b", r.num_written("b"), [1, 256])], ValueError,
                     r"request 'b': token id 256 is outside the vocabulary \[0, 256\)"),
    "negative id": (lambda r: [TokenChunk("b", r.num_written("b"), [-1])], ValueError, "token id -1"),
    "unknown": (lambda r: [TokenChunk("zz", 0, [1])], ValueError, r"add it first \(runner.add_request\('zz'\)\)"),
    "rewrite": (lambda r: [TokenChunk("a", 0, [1])], ValueError, "rewind_request"),
    "too long": (lambda r: [TokenChunk("b", r.num_written("b"), [1] * 70)], ValueError, "max_tokens=64"),
    "out of pages": (lambda r: [TokenChunk("c", 0, [1] * 60)], RuntimeError, "new KV pages"),
}


@pytest.mark.parametrize("bad", sorted(BAD_STEPS))
def test_refused_step_leaves_the_cache_as_a_history_without_it(bad):
    make, exc, msg = BAD_STEPS[bad]
    runs = []
    for with_bad in (False, True):
        r = build_from_preset("tiny", "cpu", torch.float32, max_tokens=64, max_seqs=3, max_seq_len=96, num_pages=16)
        for s in "abc":
            r.add_request(s)
        outs = [r.step([TokenChunk("a", 0, list(range(1, 30))), TokenChunk("b", 0, [4, 5, 6])])]
        if with_bad:
            before = cache_state(r)
            with pytest.raises(exc, match=msg):
                r.step(make(r))
            assert_same_state(before, cache_state(r))
        outs.append(r.step([TokenChunk("a", 29, [7]), TokenChunk("b", 3, [8, 9])]))
        runs.append((outs, cache_state(r)))
    (outs_a, state_a), (outs_b, state_b) = runs
    assert_same_state(state_a, state_b)
    for x, y in zip(outs_a, outs_b):
        assert x.next_tokens == y.next_tokens and torch.equal(x.logits, y.logits)


def test_bools_and_floats_are_refused_where_ints_are_meant():
    with pytest.raises(ValueError, match="start_pos must be an integer"):
        TokenChunk("a", True, [1])
    with pytest.raises(ValueError, match="not an integer token id"):
        TokenChunk("a", 0, [8.7])
    with pytest.raises(ValueError, match="max_tokens"):
        build_from_preset("tiny", "cpu", torch.float32, max_tokens=True)
    r = build_from_preset("tiny", "cpu", torch.float32, max_tokens=32, max_seqs=2, max_seq_len=64)
    r.add_request("a")
    r.step([TokenChunk("a", 0, [1, 2])])
    for bad in (True, 3, -1):
        with pytest.raises(ValueError, match="rewind to"):
            r.rewind_request("a", bad)


def test_a_request_never_reads_a_previous_owners_pages():
    """The same request's logits do not depend on who used its pages before."""
    fresh = build_from_preset("tiny", "cpu", torch.float32, max_tokens=32, max_seqs=2, max_seq_len=64, num_pages=4)
    fresh.add_request("x")
    want = [fresh.step([TokenChunk("x", 0, [3, 1, 4])]).logits, fresh.step([TokenChunk("x", 3, [1])]).logits]
    used = build_from_preset("tiny", "cpu", torch.float32, max_tokens=32, max_seqs=2, max_seq_len=64, num_pages=4)
    used.add_request("old")
    used.step([TokenChunk("old", 0, list(range(9, 25)))])  # fills every page with its K/V
    used.cache.k_cache.mul_(100)  # and makes any stale read loud
    used.free_request("old")
    used.add_request("x")
    with pytest.raises(ValueError, match="skips past"):
        used.step([TokenChunk("x", 5, [1])])  # a gap would read the old owner's slots 0..4
    got = [used.step([TokenChunk("x", 0, [3, 1, 4])]).logits, used.step([TokenChunk("x", 3, [1])]).logits]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_rewind_rewrites_earlier_positions():
    r = build_from_preset("tiny", "cpu", torch.float32, max_tokens=32, max_seqs=2, max_seq_len=64)
    r.add_request("s")
    r.step([TokenChunk("s", 0, [5, 6, 7, 8])])
    want = r.step([TokenChunk("s", 4, [9])]).logits
    r.rewind_request("s", 2)  # drop positions 2.. (e.g. rejected speculative tokens)
    assert r.num_written("s") == 2
    r.step([TokenChunk("s", 2, [1, 1])])  # different tokens at 2, 3
    r.rewind_request("s", 2)
    r.step([TokenChunk("s", 2, [7, 8])])
    # positions 2, 3 were computed in a 2-token chunk this time: GEMMs of another shape round differently
    torch.testing.assert_close(r.step([TokenChunk("s", 4, [9])]).logits, want, atol=1e-5, rtol=1e-5)


def test_producer_reading_step_metadata_raises_naming_the_read():
    """A Python int read from the attention metadata in producer code would be frozen into a
    graph: the guarded step context refuses it (debug-eager runs the capture path's checks)."""
    r = build_from_preset("tiny", "cpu", torch.float32, max_tokens=32, max_seqs=2, max_seq_len=64,
                          capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=32))
    layer = r.model.model.layers[1]
    orig = layer.self_attn.o_proj.forward
    layer.self_attn.o_proj.forward = lambda x: orig(x) * (1 + 0 * r.backend.meta.num_tokens)
    r.add_request("a")
    with pytest.raises(RuntimeError,
                       match=r"AttentionBackend.meta was read by captured producer code at .*test_m3_runner"):
        r.step([TokenChunk("a", 0, [1, 2, 3])])
    assert r.num_written("a") == 0  # the failed step did not advance the request


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_captured_steps_equal_eager_steps_on_gpu(backend):
    graphed, eager = make_pair("cuda", torch.bfloat16, backend, preset="rank_of_8", layers=4)
    graphed.capture()
    assert graphed.validate() == {}
    assert not graphed.has_dummies
    stats = drive(graphed, eager, tol=2e-2)
    decode = [s for key, s in stats.buckets.items() if key.decode]
    if backend == "torch":  # host loops: no decode graph may pass through them
        assert decode and all(s.status == "skipped" for s in decode)
    else:
        assert any(s.status == "captured" and s.hits for s in decode)
    piecewise = [s for key, s in stats.buckets.items() if not key.decode]
    assert piecewise and all(s.status == "captured" for s in piecewise)


@pytest.mark.cuda
def test_reallocated_flashinfer_buffer_invalidates_never_replays_stale():
    """Every buffer the graphs read is registered: a flashinfer workspace or indptr buffer
    replaced after capture triggers a recapture (new wrappers on the new buffers)."""
    pytest.importorskip("flashinfer")
    graphed, eager = make_pair("cuda", torch.bfloat16, "flashinfer", preset="rank_of_8", layers=4)
    graphed.capture()
    for i in range(3):
        graphed.add_request(i)
    twice(graphed, eager, [TokenChunk(i, 0, [1, 2, 3, 4, 5]) for i in range(3)], 2e-2)
    dense = graphed.backend.dense_part
    for name in ("_indptr_buf", "_workspace_buf"):
        before = graphed.manager.stats.invalidations
        setattr(dense, name, getattr(dense, name).clone())
        dense._decode.clear()  # wrappers hold views of the old buffers: init_capture rebuilds them
        twice(graphed, eager, [TokenChunk(i, graphed.num_written(i), [7]) for i in range(3)], 2e-2)
        assert graphed.manager.stats.invalidations == before + 1, name


def test_fused_triton_producer_matches_torch_producer():
    """The model with the fused norm+RoPE+cache-write kernel (Triton interpreter on CPU) gives
    the torch producer's logits and cache contents."""
    runs = {}
    for producer in ("torch", "triton"):
        r = build_from_preset("tiny", "cpu", torch.float32, producer=producer, max_tokens=32, max_seqs=2,
                              max_seq_len=64)
        assert r.model.ops.name.startswith(producer)
        r.add_request(0)
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, r.model.config.vocab_size, (14,), generator=g).tolist()
        first = r.step([TokenChunk(0, 0, prompt)], all_logits=True).logits
        second = r.step([TokenChunk(0, 14, [5])], all_logits=True).logits
        runs[producer] = (first, second, r.cache.k_cache.clone(), r.cache.index_k_cache.clone())
    for a, b in zip(runs["torch"], runs["triton"]):
        assert relative_error(b, a) < 1e-4


def test_unknown_producer_is_rejected():
    with pytest.raises(ValueError, match="producer"):
        build_from_preset("tiny", "cpu", torch.float32, producer="cuda-magic")


def test_dummy_requests_never_outlive_a_step():
    """Warm-up, capture and validation run on private dummy requests; none stay in the cache."""
    graphed, _ = make_pair("cpu", torch.float32, "torch", debug=True)
    free_pages = graphed.cache.num_free_pages
    graphed.capture()
    graphed.validate()
    assert not graphed.has_dummies and graphed.cache.num_free_pages == free_pages
    graphed.add_request("r")
    graphed.step([TokenChunk("r", 0, [1, 2, 3])])
    assert not graphed.has_dummies


def test_fused_moe_validates_its_configuration_and_rejects_a_corrupt_candidate():
    """Kernel choices are checked against the torch reference on a probe input before use: a
    deliberately corrupt candidate is rejected and reported, never chosen."""
    r = build_from_preset("tiny", "cpu", torch.float32, producer="triton", max_tokens=16, max_seqs=2, max_seq_len=32)
    ops, H = r.model.ops, r.model.config.hidden_size
    ops.moe.choose(r.model, 5, extra={"corrupt": lambda: torch.zeros(5, H), "broken": lambda: 1 / 0})
    choice = ops.tuner.choices[("moe", 5)]
    assert choice.chosen == "config0"
    assert "relative error" in choice.rejected["corrupt"] and "ZeroDivisionError" in choice.rejected["broken"]
    r.add_request("a")
    r.step([TokenChunk("a", 0, [1, 2, 3, 4, 5])])  # unpadded eager: the 5-row choice is the one used
    assert set(ops.tuner.choices) == {("moe", 5)}
    from rich.console import Console

    from graphcap.report import choices_table

    console = Console(record=True, width=200)
    console.print(choices_table(ops.tuner.choices))
    assert "corrupt" in console.export_text()


def test_moe_tuner_probes_spread_a_small_step_over_layers_and_routings():
    """At decode sizes the MoE tuner times its candidates on several probes (16 rows in all),
    probe i on the i-th MoE layer's weights with its own hidden states and uniform routing: the
    timing covers the steps that route to none of a rank's experts and those that route to some,
    and reads weights that do not stay in L2. One probe from 16 rows up."""
    from models.minimax_m3.layers import BlockSparseMoE
    from models.minimax_m3.ops import MOE_PROBE_ROWS, moe_probe_count

    assert MOE_PROBE_ROWS == 16 and [moe_probe_count(t) for t in (1, 2, 5, 16, 1054)] == [16, 8, 4, 1, 1]
    r = build_from_preset("tiny", "cpu", torch.float32, producer="triton", max_tokens=16, max_seqs=2, max_seq_len=32)
    layers = [m for m in r.model.modules() if isinstance(m, BlockSparseMoE)]
    probes = r.model.ops.moe._probes(r.model, 1, 8)
    assert [p.moe for p in probes] == [layers[i % len(layers)] for i in range(8)]
    assert probes[0].x.shape == (1, r.model.config.hidden_size)
    assert len({tuple(p.x.flatten().tolist()) for p in probes}) == 8  # each probe its own rows
    for p in probes:  # the uniform simulation's picks: k distinct experts, weights the router's
        assert p.ids.shape == (1, 2) and len(set(p.ids.flatten().tolist())) == 2
        assert torch.allclose(p.w.sum(-1), torch.full((1,), p.moe.scale))
    picked = {tuple(sorted(p.ids.flatten().tolist())) for p in probes}
    assert len(picked) >= 4, picked  # the probes route apart, not all to one pair
    first = r.model.ops.moe._probes(r.model, 1, 1)[0]  # the first probe is the single probe of before
    assert torch.equal(first.x, probes[0].x) and torch.equal(first.ids, probes[0].ids)


@pytest.mark.parametrize("quantization", [None, "mxfp8"])
def test_moe_probe_reference_runs_only_the_experts_it_routes_to(quantization, monkeypatch):
    """The tuner's reference for a probe runs ``fused_moe_torch`` on the local experts the probe
    routes to only (an MXFP8 layer dequantises those, not all), and equals the reference over
    every expert: with no local expert routed, some (one picked twice by a row), and all."""
    from models.minimax_m3.kernels import moe as moe_kernels
    from models.minimax_m3.kernels.moe import fused_moe_torch
    from models.minimax_m3.layers import BlockSparseMoE
    from models.minimax_m3.ops import MoEProbe, moe_scales

    config = MiniMaxM3Config.tiny(quantization=quantization)
    r = build_from_preset(config, "cpu", torch.float32, producer="torch", max_tokens=16, max_seqs=2, max_seq_len=32)
    moe = next(m for m in r.model.modules() if isinstance(m, BlockSparseMoE))
    ex, sh = moe.experts, moe.shared_experts
    E, H = ex.w13.shape[0], ex.w13.shape[2]
    assert ex.quantized == (quantization == "mxfp8")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(E, H, generator=gen)
    cases = {
        "none": torch.full((E, 2), -1),
        "some": torch.tensor([[3, -1], [5, 3], [-1, -1], [5, 5]] + [[-1, -1]] * (E - 4)),
        "all": torch.stack([torch.arange(E), torch.arange(E).flip(0)], 1),
    }
    dequantised = []  # the expert count of each [E, N, K] tensor the reference dequantises
    dequantize = moe_kernels.dequantize_mxfp8

    def counting(w: torch.Tensor, sc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        dequantised.append(w.shape[0] if w.dim() == 3 else None)
        return dequantize(w, sc, dtype)

    monkeypatch.setattr(moe_kernels, "dequantize_mxfp8", counting)
    seen = []
    for name, ids in cases.items():
        ids = ids.to(torch.int32).contiguous()
        w = torch.where(ids >= 0, torch.rand(ids.shape, generator=gen) + 0.1, 0.0).contiguous()
        full = fused_moe_torch(x, ids, w, ex.w13, ex.w2, sh.gate_up_proj.weight, sh.down_proj.weight, moe.alpha,
                               moe.limit, torch.empty_like(x), scales=moe_scales(moe))
        dequantised.clear()
        got = MoEProbe(moe, x, ids, w).reference()
        assert torch.equal(got, full), name
        if quantization:  # w13 and w2 of the routed experts (at least one), the shared expert's two
            routed = max(1, len(set(ids.flatten().tolist()) - {-1}))
            assert dequantised == [routed, routed, None, None], (name, dequantised)
        seen.append(got)
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])  # the routed experts count


def test_fused_moe_validates_once_not_once_per_eager_step_size():
    """An eager step of a size no graph has takes the configuration chosen for the nearest size
    of its kind (decode- or prefill-sized tiles) with no probe (a probe, the reference and the
    host sync would stall that step), even where that choice is not the default; a kind no size
    has chosen for yet validates its default once."""
    from models.minimax_m3.kernels.moe import MoEConfig, default_moe_config

    r = build_from_preset("tiny", "cpu", torch.float32, producer="triton", max_tokens=80, max_seqs=2, max_seq_len=96)
    ops = r.model.ops
    ops.moe.choose(r.model, 4)  # graph sizes: their candidates validated
    ops.moe.choose(r.model, 16)
    stored = MoEConfig(gu_block_n=16)  # as a warm start's stored choice may be: not the default
    ops.moe._configs[16] = stored
    ops.moe.choose(r.model, 7, tune=False)  # the next chosen size of its kind: 16
    ops.moe.choose(r.model, 40, tune=False)  # none above: the largest below
    ops.moe.choose(r.model, 3, tune=False)
    assert set(ops.tuner.choices) == {("moe", 4), ("moe", 16)}
    assert ops.moe._configs[7] == ops.moe._configs[40] == stored and ops.moe._configs[3] == ops.moe._configs[4]
    assert default_moe_config(70) != default_moe_config(4)
    ops.moe.choose(r.model, 70, tune=False)  # no prefill-sized choice yet: its default validated, once
    ops.moe.choose(r.model, 75, tune=False)
    assert set(ops.tuner.choices) == {("moe", 4), ("moe", 16), ("moe", 70)}
    assert ops.moe._configs[75] == default_moe_config(70)
    r.add_request("a")
    r.step([TokenChunk("a", 0, list(range(1, 76)))])  # unpadded eager at 75 rows: nothing new validated
    assert set(ops.tuner.choices) == {("moe", 4), ("moe", 16), ("moe", 70)}


def test_runner_lists_the_kernel_choices_made_after_its_capture():
    """A kernel choice made inside a serving step (a probe, the reference, a host sync) stalls it
    like a compile: the runner lists those made since its capture returned, for the serving
    simulation to print. Debug-eager on the CPU makes no choice at capture, so the first step's
    bucket (5 tokens pad to the piecewise bucket of 8) is validated then."""
    r = build_from_preset("tiny", "cpu", torch.float32, producer="triton", max_tokens=16, max_seqs=2,
                          max_seq_len=32, capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=16))
    assert r.kernel_choices_after_capture() is None
    r.capture()
    assert r.kernel_choices_after_capture() == []
    r.add_request("a")
    r.step([TokenChunk("a", 0, [1, 2, 3, 4, 5])])
    assert r.kernel_choices_after_capture() == ["moe 8"]
    twin = r.with_capture(CaptureConfig(max_tokens=16))
    assert twin.kernel_choices_after_capture() is None  # counted from its own capture


@pytest.mark.parametrize("bucket, decode", [(1, True), (6, True), (5, False), (64, False)])
@pytest.mark.parametrize("purpose", list(Purpose), ids=[p.value for p in Purpose])
def test_dummy_steps_write_distinct_capture_slots_and_read_only_this_steps_writes(bucket, decode, purpose):
    """Dummy steps live on the capture reserve: every token at its own capture slot, each
    request starting where the step's earlier tokens end, nothing taken from live capacity."""
    r = build_from_preset("tiny", max_tokens=64, max_seqs=6, max_seq_len=48)
    c = r.cache.config
    free_pages, free_rows = r.cache.num_free_pages, len(r.cache._free_rows)
    step = r.source.dummy_step(GraphKey(bucket, decode), purpose)
    slots = step.metadata.slot_mapping[: step.num_tokens].tolist()
    assert len(set(slots)) == step.num_tokens
    assert all(c.num_pages * c.page_size <= s < c.total_pages * c.page_size for s in slots)  # capture pages only
    assert r.cache.num_free_pages == free_pages and len(r.cache._free_rows) == free_rows
    real = max(1, bucket - bucket // 4) if purpose is Purpose.FROZEN_CHECK else bucket
    assert step.num_tokens == real and step.uniform_decode == decode and r.has_dummies
    r.source.release_dummies()
    assert r.cache.num_live_seqs == 0 and not r.has_dummies


def test_recapture_at_full_capacity_leaves_live_requests_alone():
    """Every row and page in use by live requests: capture and validation still find room
    (the capture reserve), and the live requests' cache contents are untouched."""
    ps = MiniMaxM3Config.preset("tiny").sparse_block_size
    r = build_from_preset("tiny", max_tokens=64, max_seqs=4, max_seq_len=32, num_pages=4 * 32 // ps,
                          capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=64))
    g = torch.Generator().manual_seed(0)
    vocab = r.model.config.vocab_size
    seqs = list(range(r.cache.config.max_live_seqs))
    for s in seqs:
        r.add_request(s)
    for s in seqs[:4]:
        r.step([TokenChunk(s, 0, torch.randint(0, vocab, (32,), generator=g).tolist())])
    assert r.cache.num_free_pages == 0
    live = slice(0, r.cache.config.num_pages)
    k, ik = r.cache.k_cache[:, live].clone(), r.cache.index_k_cache[:, live].clone()
    r.capture()
    assert r.validate() == {}
    assert torch.equal(r.cache.k_cache[:, live], k) and torch.equal(r.cache.index_k_cache[:, live], ik)
    assert r.cache.num_live_seqs == len(seqs) and [r.num_written(s) for s in seqs[:4]] == [32] * 4


def test_every_layer_hands_the_splice_the_same_buffers():
    """q, index-q and the attention output come from one set of buffers for every layer."""
    r = build_from_preset("tiny", max_tokens=16, max_seqs=2)
    seen = []
    sparse, dense = r.backend.sparse, r.backend.dense
    r.backend.sparse = lambda layer, q, iq, out: (seen.append((q.data_ptr(), iq.data_ptr(), out.data_ptr())),
                                                  sparse(layer, q, iq, out))[1]
    r.backend.dense = lambda layer, q, out: (seen.append((q.data_ptr(), None, out.data_ptr())),
                                             dense(layer, q, out))[1]
    r.add_request("a")
    r.step([TokenChunk("a", 0, [1, 2, 3])])
    assert len(seen) == r.model.config.num_hidden_layers
    assert len({s[0] for s in seen}) == 1 and len({s[2] for s in seen}) == 1
    assert len({s[1] for s in seen if s[1] is not None}) <= 1
    bufs = r.model.splice_buffers
    assert seen[0][0] == bufs.view("q", 1).data_ptr() and bufs.max_rows == 16


def forwards_to_build(runner: ModelRunner) -> list[GraphKey]:
    """The graph keys whose forward kernels a capture compiles ahead: neither built by this
    process (``kernel_prebuild.built``: a recapture) nor recorded as built into this cache
    directory for the same forward (the choice store's ``forward kernels|<signature>`` entry:
    comma-separated graph keys)."""
    store = runner.model.ops.tuner.store
    entry = store.get(f"forward kernels|{runner.forward_signature()}") if store is not None else None
    recorded = set((entry or "").split(","))
    return [k for k in runner.manager.keys() if k not in runner.kernel_prebuild.built and str(k) not in recorded]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_capture_builds_every_triton_kernel_before_warm_up(backend, tmp_path, monkeypatch):
    """With compile threads, the prebuild builds every Triton kernel warm-up and capture
    launch (MoE candidates, then each graph key's forward, its dense layers served by torch
    while flashinfer may still build): no launch after it compiles. A recapture, and a new
    runner of the same forward on the same cache directory, skip the forward pass."""
    import contextlib
    import gc

    import triton
    from triton.runtime.jit import JITFunction

    if backend == "auto":
        pytest.importorskip("flashinfer")
    from graphcap.startup import jit_cache

    jit_cache.configure()  # Triton's and flashinfer's caches stay where they are; the choice store moves:
    monkeypatch.setenv("GRAPHCAP_CACHE_DIR", str(tmp_path))
    for obj in gc.get_objects():  # what a fresh process holds: no kernel in memory
        if isinstance(obj, JITFunction):
            obj.device_caches.clear()
    # flashinfer needs head_dim 128 (rank_of_8's), which the tiny preset does not have
    wide = {"preset": "rank_of_8", "layers": 2} if backend == "auto" else {}
    shape = dict(buckets=(3, 11, 29), max_tokens=29, **wide)
    graphed, eager = make_pair("cuda", torch.bfloat16, backend, max_seqs=5, **shape)
    assert graphed.model.ops.tuner.store is not None  # the record lives in the choice store
    assert graphed.compile_workers > 0 and forwards_to_build(graphed)
    misses = {"prebuild": 0, "after": 0}
    phase = {"now": "prebuild"}
    source = graphed.source
    inner = source.prebuild

    @contextlib.contextmanager
    def prebuild(keys):  # the source's prebuild, the manager's forward compile-ahead inside it
        phase["now"] = "prebuild"
        with inner(keys) as plan:
            yield plan
        phase["now"] = "after"

    def count(*args, **kwargs) -> bool:
        misses[phase["now"]] += 1
        return False  # compile as usual

    source.prebuild = prebuild
    old = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = count
    try:
        graphed.capture()
    finally:
        triton.knobs.runtime.jit_cache_hook = old
    assert misses["prebuild"] > 0 and misses["after"] == 0, misses
    assert phase["now"] == "after"  # the manager went through the source's prebuild
    assert graphed.prebuild_s["forward_compile_s"] > 0
    assert graphed.kernel_prebuild.built == set(graphed.manager.keys())
    assert graphed.validate() == {}
    for i in range(3):
        graphed.add_request(i)
    twice(graphed, eager, [TokenChunk(i, 0, [1 + i, 2, 3, 4]) for i in range(3)], 2e-2)
    twice(graphed, eager, [TokenChunk(i, 4, [5 + i]) for i in range(3)], 2e-2)
    assert forwards_to_build(graphed) == []  # a recapture skips the pass
    again, _ = make_pair("cuda", torch.bfloat16, backend, max_seqs=5, **shape)
    assert again.forward_signature() == graphed.forward_signature() and not again.kernel_prebuild.built
    assert forwards_to_build(again) == []  # recorded in the cache directory
    entry = again.model.ops.tuner.store.get(f"forward kernels|{again.forward_signature()}")
    assert set(entry.split(",")) == {str(k) for k in graphed.manager.keys()}
    other, _ = make_pair("cuda", torch.bfloat16, backend, max_seqs=6, **shape)
    assert forwards_to_build(other)  # another capacity: another forward


def test_run_chunks_is_the_one_entry_point_and_step_adds_greedy_tokens():
    """``run_chunks`` runs a step (``commit=False`` leaves the request where it was); ``step`` is
    ``run_chunks`` plus the greedy argmax; the previous release's runner name warns."""
    import models.minimax_m3 as m3

    r = build_from_preset("tiny", "cpu", torch.float32, max_tokens=32, max_seqs=2, max_seq_len=64)
    r.add_request("a")
    first = r.step([TokenChunk("a", 0, [1, 2, 3])], all_logits=True)
    assert first.logits.shape == (3, r.vocab_size) and first.next_tokens == [int(first.logits[-1].argmax())]
    every = r.run_chunks([TokenChunk("a", 3, [4, 5])], commit=False, all_logits=True)
    assert every.shape == (2, r.vocab_size) and r.num_written("a") == 3
    last = r.run_chunks([TokenChunk("a", 3, [4, 5])], commit=False)
    assert last.shape == (1, r.vocab_size) and r.num_written("a") == 3
    torch.testing.assert_close(last[0], every[-1], atol=1e-5, rtol=1e-5)  # lm_head on 1 row vs 2 rounds apart
    out = r.step([TokenChunk("a", 3, [4, 5])])
    assert torch.equal(out.logits, last) and out.next_tokens == last.argmax(-1).tolist()
    assert r.num_written("a") == 5
    with pytest.warns(DeprecationWarning, match="models.minimax_m3.M3Runner is deprecated"):
        assert m3.M3Runner is ModelRunner
