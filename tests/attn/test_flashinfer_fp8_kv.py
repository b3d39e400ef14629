"""flashinfer dense paged attention over an fp8 e4m3 KV cache (GPU only): planned with
``kv_data_type=torch.float8_e4m3fn`` and bf16 q/out, against the torch reference reading the
same fp8 pages (the reference upcasts exactly, so the error is flashinfer's bf16 maths, not
fp8's), in the eager prefill wrapper and the graph-mode decode wrappers (padded too), and a
decode graph captured, re-planned and replayed.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.paged import planned

from attention.dims import AttentionDims
from attention.metadata import MetadataBuilder
from attention.reference.dense import dense_attention_ref
from graphcap import GraphKey, Padding, Step
from graphcap.verify.compare import relative_error
from kvcache.paged import FP8_E4M3, KVCacheConfig, PagedKVCache
from steps import TokenChunk

HQ, HKV, D, PAGE = 64, 4, 128, 128


def fp8_cache(lens: list[int], max_seqs: int = 8) -> PagedKVCache:
    """An fp8 cache holding sequences ``0..len(lens)-1`` (pages interleaved), random contents."""
    pages = sum(-(-n // PAGE) for n in lens) + 4
    cache = PagedKVCache(KVCacheConfig(
        num_layers=1, sparse_layers=(), num_kv_heads=HKV, head_dim=D, index_dim=D, page_size=PAGE,
        num_pages=pages, max_seqs=max_seqs, max_pages_per_seq=-(-max(lens) // PAGE), dtype=FP8_E4M3,
        index_dtype=FP8_E4M3, device="cuda"))
    for i in range(len(lens)):
        cache.add_sequence(i)
    for npg in range(1, -(-max(lens) // PAGE) + 1):
        for i, n in enumerate(lens):
            cache.reserve(i, min(n, npg * PAGE))
    for t in (cache.k_cache, cache.v_cache):
        t.copy_(torch.randn(t.shape, device="cuda") * 3)  # fp8 has no normal_; the copy casts
    return cache


def backend(cache: PagedKVCache, max_tokens: int = 1024):
    from attention.backends.flashinfer import FlashinferAttention

    attn = FlashinferAttention(cache, AttentionDims.for_cache(cache, HQ, 16, max_tokens))
    assert attn.kv_dtype == FP8_E4M3 and attn.dtype == torch.bfloat16  # fp8 pages, bf16 q and out
    return attn


def check(out: torch.Tensor, q: torch.Tensor, cache: PagedKVCache, meta) -> None:
    ref = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    dense_attention_ref(q, cache.k_cache[0], cache.v_cache[0], meta, ref, 1 / math.sqrt(D))
    t = meta.num_tokens
    err = relative_error(out[:t], ref[:t])
    assert err < 1e-2, f"relative error {err}"
    pad = out[t:]
    assert torch.isnan(pad).all() or (pad == 0).all(), "padded rows must be zero or untouched"


@pytest.mark.cuda
@pytest.mark.parametrize("ctx", [1024, 8192])
@pytest.mark.parametrize("mode", ["mixed", "decode", "decode_padded"])
def test_flashinfer_reads_fp8_pages_like_the_reference(mode, ctx):
    pytest.importorskip("flashinfer")
    torch.manual_seed(ctx + len(mode))
    if mode == "mixed":
        specs = [(ctx - 128, 128), (ctx - 1, 1), (0, 300), (ctx // 2 + 6, 1)]
    else:
        specs = [(n - 1, 1) for n in (ctx, ctx - 129, ctx // 2 + 7, 3, 130)]
    cache = fp8_cache([s + n for s, n in specs])
    meta = MetadataBuilder(cache, max_tokens=1024, max_seqs=8, device="cuda").build(
        [TokenChunk(i, s, [0] * n) for i, (s, n) in enumerate(specs)])
    n, b = meta.num_tokens, meta.num_seqs
    padding = Padding.for_graph(n, b, GraphKey(8, True)) if mode == "decode_padded" else Padding.unpadded(n, b)
    attn = backend(cache)
    attn.init_capture((1, 5, 8), 8)
    attn.warmup()  # builds the fp8 modules before any run, as before a capture
    q = torch.randn(padding.rows, HQ, D, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    with planned(attn, Step(n, b, {}, mode != "mixed", meta), padding):
        attn.dense(0, q, out)
    torch.cuda.synchronize()
    check(out, q, cache, meta)


@pytest.mark.cuda
def test_fp8_decode_graph_replays_a_new_plan():
    pytest.importorskip("flashinfer")
    torch.manual_seed(3)
    cache = fp8_cache([4097, 1000, 300, 2000], max_seqs=4)
    builder = MetadataBuilder(cache, max_tokens=16, max_seqs=4, device="cuda")
    attn = backend(cache, max_tokens=16)
    attn.init_capture((4,), 4)
    attn.warmup()
    first = builder.build([TokenChunk(i, n - 1, [0]) for i, n in enumerate([4097, 1000, 300])])
    q = torch.randn(4, HQ, D, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    with planned(attn, Step(3, 3, {}, True, first), Padding.for_graph(3, 3, GraphKey(4, True))):
        attn.dense(0, q, out)
        torch.cuda.synchronize()
        check(out, q, cache, first)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attn.dense(0, q, out)
    second = builder.build([TokenChunk(i, n - 1, [0]) for i, n in enumerate([2000, 17, 300, 2000])])
    with planned(attn, Step(4, 4, {}, True, second), Padding.for_graph(4, 4, GraphKey(4, True))):
        q.copy_(torch.randn(4, HQ, D, device="cuda").to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    check(out, q, cache, second)
