"""flashinfer dense paged attention.

CPU: the host page table (indptr, last_page_len) and the on-device page-id gather against the
cache's own page lists; clear errors without flashinfer or off CUDA. GPU: flashinfer against
the fp32 torch reference at real MiniMax-M3 shapes (64 q heads, 4 kv heads, head_dim 128,
page 128) for mixed and decode batches at 1K/8K/32K context, and a decode CUDA graph that is
captured, re-planned with other lengths and block tables, replayed and compared.
"""

from __future__ import annotations

import math
import random
import sys
import types

import pytest
import torch
from helpers.paged import planned

from attention.backends.flashinfer import (
    FlashinferAttention,
    flashinfer_available,
    gather_page_indices,
    paged_kv_layout,
)
from attention.base import AttentionBackend
from attention.dims import AttentionDims
from attention.metadata import MetadataBuilder
from attention.reference.dense import dense_attention_ref
from graphcap import GraphKey, Padding, Step
from graphcap.verify.compare import relative_error
from kvcache.paged import KVCacheConfig, PagedKVCache
from steps import TokenChunk

HQ, HKV, D, PAGE = 64, 4, 128, 128


def dims(cache, hq=HQ, max_tokens=1024):
    return AttentionDims.for_cache(cache, hq, 16, max_tokens)


def new_cache(num_pages, page, max_seqs, max_pages_per_seq, device="cpu", hkv=HKV, d=D, dtype=torch.bfloat16,
              num_layers=1, sparse_layers=()):
    return PagedKVCache(KVCacheConfig(
        num_layers=num_layers, sparse_layers=sparse_layers, num_kv_heads=hkv, head_dim=d, index_dim=d,
        page_size=page, num_pages=num_pages, max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq,
        dtype=dtype, index_dtype=dtype, device=device))


def add_seqs(cache, ids, lens):
    """Add sequences and grow them round-robin, one page at a time, so their pages interleave."""
    for s in ids:
        cache.add_sequence(s)
    page = cache.page_size
    for npg in range(1, -(-max(lens) // page) + 1):
        for s, length in zip(ids, lens):
            cache.reserve(s, min(length, npg * page))


def pages_needed(lens, page):
    return sum(-(-n // page) for n in lens)


# ---- CPU: page table and gather -----------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_paged_kv_layout_matches_a_loop(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 4, 16, 128])
    lens = [rng.randint(1, 5 * page) for _ in range(rng.randint(1, 6))]
    rows = len(lens) + rng.randint(0, 3)
    indptr, last = paged_kv_layout(torch.tensor(lens, dtype=torch.int32), rows, page)
    want_indptr, want_last = [0], []
    for i in range(rows):
        n = lens[i] if i < len(lens) else 0
        pages = -(-n // page)
        want_indptr.append(want_indptr[-1] + pages)
        want_last.append(n - (pages - 1) * page if pages else 0)
    assert indptr.dtype == last.dtype == torch.int32
    assert indptr.tolist() == want_indptr and last.tolist() == want_last
    with pytest.raises(ValueError, match="real requests"):
        paged_kv_layout(torch.tensor(lens, dtype=torch.int32), len(lens) - 1, page)


@pytest.mark.parametrize("seed", range(4))
def test_gathered_page_ids_are_the_cache_pages(seed):
    rng = random.Random(seed)
    page, nseq = 4, rng.randint(1, 5)
    lens = [rng.randint(1, 30) for _ in range(nseq)]
    cache = new_cache(pages_needed(lens, page) + 5, page, max_seqs=6, max_pages_per_seq=8, hkv=1, d=4,
                      dtype=torch.float32)
    ids = [f"s{i}" for i in range(nseq)]
    add_seqs(cache, ids, lens)
    decode = rng.random() < 0.5
    chunks = [TokenChunk(s, n - 1, [0]) if decode else TokenChunk(s, max(0, n - 3), [0] * min(n, 3))
              for s, n in zip(ids, lens)]
    meta = MetadataBuilder(cache, max_tokens=32, max_seqs=6).build(chunks)
    rows = meta.num_seqs + (1 if decode else 0)  # a decode graph pads request rows
    indptr, _ = paged_kv_layout(meta.kv_lens_host, rows, page)
    out = torch.full((int(indptr[-1]),), -7, dtype=torch.int32)
    gather_page_indices(indptr, meta.buffers.table_rows[:rows], meta.block_tables, out)
    want = [p for s, n in zip(ids, lens) for p in cache.pages(s)[: -(-n // page)]]
    assert out.tolist() == want


# ---- CPU: errors ------------------------------------------------------------------------


def test_missing_flashinfer_names_it_and_the_cuda_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    assert not flashinfer_available()
    cache = new_cache(4, 4, max_seqs=2, max_pages_per_seq=2, hkv=1, d=8)
    with pytest.raises(ImportError, match=r"flashinfer.*'cuda' extra"):
        FlashinferAttention(cache, dims(cache, 2))


def test_cpu_cache_is_refused_even_with_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    cache = new_cache(4, 4, max_seqs=2, max_pages_per_seq=2, hkv=1, d=8)
    with pytest.raises(RuntimeError, match="CUDA"):
        FlashinferAttention(cache, dims(cache, 2))


def test_dense_is_the_base_splice_graph_safe_per_bucket():
    """The splice is declared once in the base; flashinfer answers per bucket: a decode
    graph is safe exactly for the batch sizes init_capture made graph-mode wrappers for."""
    assert FlashinferAttention.dense is AttentionBackend.dense
    op = AttentionBackend.dense.graphcap_splice
    assert op.name == "attention.dense"
    fake = FlashinferAttention.__new__(FlashinferAttention)
    fake._decode = {1: object(), 6: object()}
    assert op.graph_safe((fake,), Padding.for_graph(5, 5, GraphKey(6, True)))
    assert not op.graph_safe((fake,), Padding.for_graph(3, 3, GraphKey(4, True)))


# ---- GPU: flashinfer against the reference ------------------------------------------------


def batch(mode, ctx):
    """(kv lengths, chunks) of a step whose longest context is ``ctx``."""
    if mode == "mixed":
        # a late prefill chunk, a decode, a fresh prompt, a decode, a middle chunk
        specs = [(ctx - 128, 128), (ctx - 1, 1), (0, min(ctx, 300)), (ctx // 2 + 6, 1), (ctx // 3, 77)]
    else:
        specs = [(n - 1, 1) for n in (ctx, ctx - 1, ctx - 129, ctx // 2 + 7, 3)]
    return [s + n for s, n in specs], [TokenChunk(i, s, [0] * n) for i, (s, n) in enumerate(specs)]


def reference(q, cache, meta):
    ref = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    dense_attention_ref(q, cache.k_cache[0], cache.v_cache[0], meta, ref, 1 / math.sqrt(D))
    return ref


def check(out, ref, meta):
    t = meta.num_tokens
    err = relative_error(out[:t], ref[:t])
    assert err < 1e-2, f"relative error {err}"
    pad = out[t:]
    assert torch.isnan(pad).all() or (pad == 0).all(), "padded rows must be zero or untouched"


def step_of(meta, uniform):
    return Step(meta.num_tokens, meta.num_seqs, {}, uniform, meta)


@pytest.mark.cuda
@pytest.mark.parametrize("ctx", [1024, 8192, 32768])
@pytest.mark.parametrize("mode", ["mixed", "decode", "decode_padded", "decode_eager"])
def test_flashinfer_dense_matches_reference(mode, ctx):
    pytest.importorskip("flashinfer")
    torch.manual_seed(ctx + len(mode))
    lens, chunks = batch(mode, ctx)
    cache = new_cache(pages_needed(lens, PAGE) + 4, PAGE, max_seqs=8, max_pages_per_seq=-(-ctx // PAGE), device="cuda")
    add_seqs(cache, list(range(len(lens))), lens)
    cache.k_cache.normal_(), cache.v_cache.normal_()
    meta = MetadataBuilder(cache, max_tokens=1024, max_seqs=8, device="cuda").build(chunks)
    n, b = meta.num_tokens, meta.num_seqs
    # decode_padded: a decode graph of 8 with 3 padded requests; decode_eager: batch 5 has no wrapper
    padding = Padding.for_graph(n, b, GraphKey(8, True)) if mode == "decode_padded" else Padding.unpadded(n, b)
    attn = FlashinferAttention(cache, dims(cache))
    attn.init_capture((1,) if mode == "decode_eager" else (1, 2, 4, 5, 8), 8)
    q = torch.randn(padding.rows, HQ, D, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    with planned(attn, step_of(meta, mode != "mixed"), padding):
        attn.dense(0, q, out)
    torch.cuda.synchronize()
    check(out, reference(q, cache, meta), meta)


@pytest.mark.cuda
def test_decode_graph_without_a_wrapper_is_refused_in_plan():
    pytest.importorskip("flashinfer")
    lens, chunks = batch("decode", 1024)
    cache = new_cache(pages_needed(lens, PAGE) + 4, PAGE, max_seqs=8, max_pages_per_seq=8, device="cuda")
    add_seqs(cache, list(range(len(lens))), lens)
    meta = MetadataBuilder(cache, max_tokens=64, max_seqs=8, device="cuda").build(chunks)
    attn = FlashinferAttention(cache, dims(cache))
    attn.init_capture((1, 2), 8)
    with pytest.raises(ValueError, match="no graph-mode flashinfer wrapper"):
        with planned(attn, step_of(meta, True), Padding.for_graph(5, 5, GraphKey(6, True))):
            pass
    with pytest.raises(ValueError, match="exceed the flashinfer buffers"):
        attn.init_capture((16,), 8)


@pytest.mark.cuda
def test_decode_graph_replays_a_new_plan():
    """Capture decode at bucket 4 (3 requests + 1 pad), re-plan with other lengths and block
    tables (4 real requests), replay, compare."""
    pytest.importorskip("flashinfer")
    torch.manual_seed(11)
    lens_a, lens_b = [8192, 1000, 4097], [3000, 16385, 1, 555]
    cache = new_cache(pages_needed(lens_b, PAGE) + 8, PAGE, max_seqs=4, max_pages_per_seq=130, device="cuda")
    cache.k_cache.normal_(), cache.v_cache.normal_()
    builder = MetadataBuilder(cache, max_tokens=16, max_seqs=4, device="cuda")
    attn = FlashinferAttention(cache, dims(cache, max_tokens=16))
    attn.init_capture((1, 4), 4)
    attn.warmup()

    a = ["a0", "a1", "a2"]
    add_seqs(cache, a, lens_a)
    meta_a = builder.build([TokenChunk(s, n - 1, [0]) for s, n in zip(a, lens_a)])
    q = torch.randn(4, HQ, D, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    with planned(attn, step_of(meta_a, True), Padding.for_graph(3, 3, GraphKey(4, True))):
        attn.dense(0, q, out)  # eager run of the plan the graph is captured with
        torch.cuda.synchronize()
        check(out, reference(q, cache, meta_a), meta_a)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attn.dense(0, q, out)

    pages_a = [cache.pages(s) for s in a]
    for s in a:
        cache.free(s)
    add_seqs(cache, ["shift"], [3 * PAGE])  # later sequences get other pages and rows
    b = ["b0", "b1", "b2", "b3"]
    add_seqs(cache, b, lens_b)
    assert [cache.pages(s)[0] for s in b[:3]] != [p[0] for p in pages_a]
    meta_b = builder.build([TokenChunk(s, n - 1, [0]) for s, n in zip(b, lens_b)])
    with planned(attn, step_of(meta_b, True), Padding.for_graph(4, 4, GraphKey(4, True))):
        q.copy_(torch.randn(4, HQ, D, device="cuda").to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    check(out, reference(q, cache, meta_b), meta_b)
    tensors = attn.graph_tensors()
    assert {"workspace", "indptr", "indices", "last_page_len"} <= set(tensors)
    assert any(k.startswith("decode4.") and "int_workspace" in k for k in tensors), sorted(tensors)


@pytest.mark.cuda
def test_backend_dense_splice_matches_reference():
    pytest.importorskip("flashinfer")
    torch.manual_seed(5)
    lens, chunks = batch("mixed", 1024)
    cache = new_cache(pages_needed(lens, PAGE) + 4, PAGE, max_seqs=8, max_pages_per_seq=8, device="cuda",
                      num_layers=2, sparse_layers=(1,))
    add_seqs(cache, list(range(len(lens))), lens)
    cache.k_cache.normal_(), cache.v_cache.normal_()
    meta = MetadataBuilder(cache, max_tokens=1024, max_seqs=8, device="cuda").build(chunks)
    backend = FlashinferAttention(cache, dims(cache))
    q = torch.randn(meta.num_tokens, HQ, D, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    with planned(backend, step_of(meta, False)):
        backend.dense(0, q, out)
    torch.cuda.synchronize()
    check(out, reference(q, cache, meta), meta)
