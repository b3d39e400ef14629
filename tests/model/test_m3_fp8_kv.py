"""MiniMax-M3 with an fp8 e4m3 KV cache (main K/V and index-K, unit scale): ``kv_dtype`` on the
builders, the tiny model against its bf16-KV twin within the fp8 bound, against the float64
reference of the same maths with K, V and index-K rounded as the cache stores them, and (GPU)
graph replay bit-identical to the padded eager path.

CPU runs use the torch attention backend: it reads any cache dtype (gather, then upcast).
"""

from __future__ import annotations

import dataclasses
import math

import m3_reference
import pytest
import torch
from helpers.checkpoints import language_model_weights, write_tiny_checkpoint

from graphcap import CaptureConfig
from graphcap.verify.compare import relative_error
from kvcache.paged import FP8_E4M3
from models.minimax_m3 import build_from_checkpoint, build_from_preset
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.ops import norm_rope_write_triton
from models.runner import ModelRunner
from steps import TokenChunk

TINY = MiniMaxM3Config.tiny()
E4M3_HALF_ULP = 2.0**-4  # e4m3's relative rounding bound (3 mantissa bits)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory, "m3_fp8_kv", TINY)


@pytest.fixture(scope="module")
def ref_weights(ckpt):
    return language_model_weights(ckpt)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def logits_of(runner: ModelRunner, ids: list[int], decode: int = 4) -> torch.Tensor:
    """fp64 logits ``[len(ids), vocab]``: a prefill of all but the last ``decode`` tokens, then
    one decode step per token (those read the K/V the earlier steps left in the cache)."""
    runner.add_request("s")
    n = len(ids) - decode
    first = runner.step([TokenChunk("s", 0, ids[:n])], all_logits=True).logits
    rest = [runner.step([TokenChunk("s", p, [ids[p]])]).logits for p in range(n, len(ids))]
    return torch.cat([first, *rest]).double()


def run(ckpt, dtype, kv_dtype, ids, fused_producer: bool = False, **kw) -> torch.Tensor:
    """Logits of ``ids`` (``logits_of``) on the torch op table and backend; ``fused_producer``
    swaps in the Triton norm+RoPE+cache-write kernel alone (the rest of the Triton table in
    the interpreter would take half a minute)."""
    kw = dict(max_seq_len=64, max_tokens=96, max_seqs=2, backend="torch", producer="torch", **kw)
    runner = build_from_checkpoint(ckpt, dtype=dtype, kv_dtype=kv_dtype, **kw)
    if fused_producer:
        runner.model.ops = dataclasses.replace(runner.model.ops, norm_rope_write=norm_rope_write_triton)
    return logits_of(runner, ids)


# ---- the builders -----------------------------------------------------------------------


def test_kv_dtype_sets_both_caches_and_defaults_to_the_model_dtype():
    r = build_from_preset("tiny", "cpu", torch.bfloat16, kv_dtype="fp8", max_tokens=16, max_seqs=2, max_seq_len=32)
    fp8 = r.cache.config
    assert fp8.dtype == fp8.index_dtype == FP8_E4M3
    assert r.cache.k_cache.dtype == r.cache.index_k_cache.dtype == FP8_E4M3
    default = build_from_preset("tiny", "cpu", torch.bfloat16, max_tokens=16, max_seqs=2, max_seq_len=32).cache.config
    assert default.dtype == default.index_dtype == torch.bfloat16
    assert default.bytes_per_token == 2 * fp8.bytes_per_token
    c = TINY.kv_cache_config(4, 2, 2, kv_dtype=torch.float8_e4m3fn, index_dtype=torch.bfloat16)
    assert (c.dtype, c.index_dtype) == (FP8_E4M3, torch.bfloat16)  # index_dtype still overrides index-K
    with pytest.raises(ValueError, match="give kv_dtype .* or dtype/index_dtype .*, not both"):
        TINY.kv_cache_config(4, 2, 2, dtype=torch.bfloat16, kv_dtype="fp8")
    with pytest.raises(ValueError, match=r"torch.float8_e5m2 is not a supported cache dtype \(fp8 caches are e4m3"):
        build_from_preset("tiny", "cpu", kv_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int8'"):
        build_from_preset("tiny", "cpu", kv_dtype="int8")


# ---- numerics -----------------------------------------------------------------------------


def test_fp8_kv_tracks_bf16_kv_within_the_fp8_bound(ckpt):
    """bf16 model, 12 tokens (sparse selects every block there, so no selection can flip) with
    the balanced routing simulation (expert ids independent of the hidden states, so no
    near-tied top-2 can flip): what is left is the rounding of K, V and index-K, which stays
    within e4m3's bound and is not zero (the cache really is fp8)."""
    ids = prompt(12, 12)
    fp8 = run(ckpt, torch.bfloat16, "fp8", ids, routing="balanced")
    bf16 = run(ckpt, torch.bfloat16, None, ids, routing="balanced")
    err = relative_error(fp8, bf16)
    rows = [relative_error(fp8[i], bf16[i]) for i in range(len(ids))]
    assert 2.0**-9 < err < E4M3_HALF_ULP, err
    assert max(rows) < 2 * E4M3_HALF_ULP, rows


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp64 ``x`` as an fp8 cache holds it."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).double()


def attention_fp8_kv(c, w: dict, pre: str, a: torch.Tensor, sparse: bool) -> torch.Tensor:
    """``m3_reference.attention`` (spec maths, fp64, token-level masks) with K, V and index-K
    rounded where the cache holds them: post-norm-and-RoPE K and index-K, raw V."""
    R, L = m3_reference, a.shape[0]
    nq, nkv, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps

    def normed(name: str, heads: int, width: int) -> torch.Tensor:
        x = (a @ w[pre + f"{name}_proj.weight"].T).view(L, heads, width)
        return R.rope(R.gemma_norm(x, w[pre + f"{name}_norm.weight"], eps), c.rotary_dim, c.rope_theta)

    q, k = normed("q", nq, d), e4m3(normed("k", nkv, d))
    v = e4m3((a @ w[pre + "v_proj.weight"].T).view(L, nkv, d))
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None].repeat(nkv, 1, 1)
    if sparse and pre + "index_q_proj.weight" in w:
        di, B = c.sparse_index_dim, c.sparse_block_size
        iq, ik = normed("index_q", nkv, di), e4m3(normed("index_k", 1, di)[:, 0])
        allowed.zero_()
        for g in range(nkv):
            for p in range(L):
                for b in R.selected_blocks(iq[p, g], ik, p, B, c.sparse_topk_blocks):
                    allowed[g, p, b * B : min((b + 1) * B, p + 1)] = True
    grp = nq // nkv
    s = torch.einsum("lhd,mhd->hlm", q, k.repeat_interleave(grp, 1)) / math.sqrt(d)
    s = s.masked_fill(~allowed.repeat_interleave(grp, 0), float("-inf"))
    out = torch.einsum("hlm,mhd->lhd", torch.softmax(s, -1), v.repeat_interleave(grp, 1))
    return out.reshape(L, nq * d) @ w[pre + "o_proj.weight"].T


@pytest.mark.parametrize("fused_producer, length", [(False, 30), (True, 16)], ids=["torch_writer", "fused_producer"])
def test_fp8_kv_matches_the_float64_reference_of_rounded_kv(ckpt, ref_weights, monkeypatch, fused_producer, length):
    """fp32 model, fp8 KV, past 12 tokens (block selection drops blocks there): the logits are
    the float64 spec maths with K, V and index-K rounded to e4m3, up to fp32 rounding, while the
    unrounded reference is far off: the cache's rounding is the whole difference. The fused
    producer (interpreter on CPU; fewer tokens, it is slow there) stores what the torch writer
    stores."""
    ids = prompt(length, length)
    got = run(ckpt, torch.float32, "fp8", ids, fused_producer)
    exact = m3_reference.reference_logits(TINY, ref_weights, ids)
    monkeypatch.setattr(m3_reference, "attention", attention_fp8_kv)
    rounded = m3_reference.reference_logits(TINY, ref_weights, ids)
    torch.testing.assert_close(got, rounded, atol=2e-4, rtol=2e-4)
    assert relative_error(got, exact) > 0.01


def test_fp8_kv_graphs_validate_in_debug_eager():
    """Capture (debug-eager on CPU) and ``validate`` over fp8 caches: dummy steps write fp8
    pages, the replay-vs-eager comparison of the cache state handles fp8."""
    cap = CaptureConfig(enabled=True, max_tokens=24, buckets=(1, 2, 4, 8, 24), debug_eager=True)
    r = build_from_preset("tiny", "cpu", torch.float32, backend="torch", kv_dtype="fp8", max_tokens=64, max_seqs=6,
                          max_seq_len=160, capture=cap)
    r.capture()
    assert r.validate() == {}


# ---- GPU: graph replay equals the padded eager path ---------------------------------------


def cache_bytes(r: ModelRunner) -> list[torch.Tensor]:
    c = r.cache
    return [t.view(torch.uint8).clone() for t in (c.k_cache, c.v_cache, c.index_k_cache)]


def replay_equals_padded_eager(graphed: ModelRunner, eager: ModelRunner, chunks: list[TokenChunk]) -> None:
    """The step eagerly (padded, debug-eager), rewound, then replayed: identical logits and
    identical cache bytes (the replay rewrites the eager step's slots with the same values)."""
    ref = eager.step(chunks, all_logits=True)
    want = cache_bytes(eager)
    for ch in chunks:
        eager.rewind_request(ch.seq_id, ch.start_pos)
    out = graphed.step(chunks, all_logits=True)
    assert torch.equal(out.logits, ref.logits), relative_error(out.logits.float(), ref.logits.float())
    for got, exp in zip(cache_bytes(graphed), want):
        assert torch.equal(got, exp)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_fp8_kv_graph_replay_equals_padded_eager_on_gpu(backend):
    """rank_of_8 shapes (4 layers), fp8 KV: prefill chunks, uniform decodes and a mixed step,
    each replayed and run padded-eager on the same cache state. ``auto`` is flashinfer (dense
    layers, fp8 paged KV) + Triton (sparse layers)."""
    config = MiniMaxM3Config.preset("rank_of_8").first_layers(4)
    capture = CaptureConfig(enabled=True, max_tokens=24, buckets=(1, 2, 4, 8, 24))
    graphed = build_from_preset(config, "cuda", torch.bfloat16, backend=backend, kv_dtype="fp8", max_tokens=64,
                                max_seqs=6, max_seq_len=160, capture=capture)
    assert graphed.cache.config.dtype == graphed.cache.config.index_dtype == FP8_E4M3
    graphed.capture()
    eager = graphed.with_capture(dataclasses.replace(graphed.manager.config, debug_eager=True))
    g = torch.Generator().manual_seed(0)

    def chunk(i: int, n: int) -> TokenChunk:
        ids = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
        return TokenChunk(i, graphed.num_written(i), ids)

    for i in range(5):
        graphed.add_request(i)
    replay_equals_padded_eager(graphed, eager, [chunk(i, 7) for i in range(3)])  # 21 rows: bucket 24
    for s in range(6):
        if s % 3 == 2:
            replay_equals_padded_eager(graphed, eager, [chunk(i, 1) for i in range(4)] + [chunk(4, 13)])  # mixed
        else:
            replay_equals_padded_eager(graphed, eager, [chunk(i, 1) for i in range(1 + s % 4)])  # decode
    stats = graphed.manager.stats.buckets
    assert any(s.status == "captured" and s.hits for key, s in stats.items() if not key.decode)
    if backend == "auto":
        assert any(s.status == "captured" and s.hits for key, s in stats.items() if key.decode)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_fp8_kv_graphs_validate_on_gpu(backend):
    """``validate`` (replay vs unpadded eager: outputs within tolerance, cache state matching)
    passes over fp8 caches."""
    config = MiniMaxM3Config.preset("rank_of_8").first_layers(4)
    capture = CaptureConfig(enabled=True, max_tokens=24, buckets=(1, 2, 4, 8, 24))
    r = build_from_preset(config, "cuda", torch.bfloat16, backend=backend, kv_dtype="fp8", max_tokens=64,
                          max_seqs=6, max_seq_len=160, capture=capture)
    r.capture()
    assert r.validate() == {}
