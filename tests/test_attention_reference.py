"""Paged reference attention (dense, index top-k, sparse) and the torch backend against
brute force written straight from the spec: per token, per head, contiguous K/V per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from attention.base import BACKENDS, TorchAttention, make_backend
from attention.reference.dense import dense_attention_ref
from attention.reference.indexer import index_topk_ref
from kvcache.paged import KVCacheConfig, PagedKVCache
from attention.metadata import MetadataBuilder, RequestChunk
from attention.reference.sparse import sparse_attention_ref
from graphcap.splice import Step, call_splice, step_context

# (Hq, Hkv, D, Di, B, topk, [(context L, query tokens n), ...]); queries are the last n positions.
CASES = [
    (4, 2, 8, 8, 4, 3, [(13, 13), (1, 1), (30, 1), (22, 5)]),  # mixed: prefill, decodes, a chunk
    (6, 3, 16, 8, 4, 2, [(9, 3), (17, 17)]),
    (2, 1, 8, 4, 8, 4, [(20, 20), (40, 2)]),  # first sequence: sparse == dense everywhere
    (8, 2, 8, 8, 2, 1, [(7, 7), (4, 1)]),  # topk 1: only the local block
    (4, 4, 8, 8, 4, 3, [(26, 26)]),  # no GQA sharing
]


class Scenario:
    """Sequences with contiguous fp64 K/V/index-K, the same data in a paged fp32 cache, and a step."""

    def __init__(self, hq, hkv, d, di, bs, specs, seed, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.hq, self.hkv, self.d, self.bs, self.specs = hq, hkv, d, bs, specs
        self.scale = 1 / math.sqrt(d)
        maxlen = max(length for length, _ in specs)
        self.cache = PagedKVCache(KVCacheConfig(
            num_layers=2, sparse_layers=(1,), num_kv_heads=hkv, head_dim=d, index_dim=di, page_size=bs,
            num_pages=sum(-(-length // bs) for length, _ in specs) + 3, max_seqs=len(specs),
            max_pages_per_seq=-(-maxlen // bs), dtype=dtype, index_dtype=dtype))
        c = self.cache
        for i in range(len(specs)):
            c.add_sequence(i)
        # Round-robin page growth so each sequence's pages are scattered in the pool.
        for npg in range(1, -(-maxlen // bs) + 1):
            for i, (length, _) in enumerate(specs):
                c.reserve(i, min(length, npg * bs))
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).double()  # noqa: E731
        self.K = [r(length, hkv, d) for length, _ in specs]
        self.V = [r(length, hkv, d) for length, _ in specs]
        self.IK = [r(length, di) for length, _ in specs]
        for layer in (0, 1):
            for i, (length, _) in enumerate(specs):
                sm = torch.tensor(c.slots(i, 0, length), dtype=torch.int64)
                c.write(layer, sm, self.K[i].float(), self.V[i].float(), self.IK[i].float() if layer else None)
        self.chunks = [RequestChunk(i, length - n, n) for i, (length, n) in enumerate(specs)]
        self.meta = MetadataBuilder(c, max_tokens=sum(n for _, n in specs) + 4, max_seqs=len(specs)).build(self.chunks)
        self.T = self.meta.num_tokens
        self.tok = [(i, length - n + j) for i, (length, n) in enumerate(specs) for j in range(n)]  # (seq, pos)
        self.q = r(self.T, hq, d)
        self.iq = r(self.T, hkv, di)
        self.dtype = dtype

    def poisoned_out(self, pad=3):
        return torch.full((self.T + pad, self.hq, self.d), float("nan"), dtype=self.dtype)


def brute_dense(sc, t):
    s, p = sc.tok[t]
    grp = sc.hq // sc.hkv
    o = torch.empty(sc.hq, sc.d, dtype=torch.float64)
    for h in range(sc.hq):
        k, v = sc.K[s][: p + 1, h // grp], sc.V[s][: p + 1, h // grp]
        o[h] = torch.softmax(k @ sc.q[t, h] * sc.scale, 0) @ v
    return o


def brute_select(sc, t, topk):
    """Per group: (selected block set, local block, number of visible blocks)."""
    s, p = sc.tok[t]
    bs, local = sc.bs, p // sc.bs
    out = []
    for g in range(sc.hkv):
        score = {b: max(float(sc.IK[s][j] @ sc.iq[t, g]) for j in range(b * bs, min((b + 1) * bs, p + 1)))
                 for b in range(local + 1)}
        others = sorted((b for b in score if b != local), key=lambda b: -score[b])[: topk - 1]
        out.append({local, *others})
    return out, local, local + 1


def brute_sparse(sc, t, sel):
    s, p = sc.tok[t]
    grp = sc.hq // sc.hkv
    o = torch.empty(sc.hq, sc.d, dtype=torch.float64)
    for h in range(sc.hq):
        keys = [j for j in range(p + 1) if j // sc.bs in sel[h // grp]]
        k, v = sc.K[s][keys, h // grp], sc.V[s][keys, h // grp]
        o[h] = torch.softmax(k @ sc.q[t, h] * sc.scale, 0) @ v
    return o


@pytest.mark.parametrize("case", range(len(CASES)))
def test_dense_matches_brute_force(case):
    hq, hkv, d, di, bs, topk, specs = CASES[case]
    sc = Scenario(hq, hkv, d, di, bs, specs, seed=case)
    out = sc.poisoned_out()
    dense_attention_ref(sc.q.float(), sc.cache.k_cache[0], sc.cache.v_cache[0], sc.meta, out, sc.scale)
    assert out[sc.T:].isnan().all(), "padded rows must stay untouched"
    want = torch.stack([brute_dense(sc, t) for t in range(sc.T)])
    torch.testing.assert_close(out[: sc.T].double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_topk_selection_and_sparse_match_brute_force(case):
    hq, hkv, d, di, bs, topk, specs = CASES[case]
    sc = Scenario(hq, hkv, d, di, bs, specs, seed=100 + case)
    idx = torch.full((hkv, sc.T + 2, topk), -7, dtype=torch.int32)
    index_topk_ref(sc.iq.float(), sc.cache.index_k_cache[0], sc.meta, topk, bs, idx)
    assert (idx[:, sc.T:] == -7).all(), "padded columns must stay untouched"
    sels = []
    for t in range(sc.T):
        want, local, nb = brute_select(sc, t, topk)
        sels.append(want)
        nvalid = min(topk, nb)
        for g in range(hkv):
            row = idx[g, t].tolist()
            assert all(x >= 0 for x in row[:nvalid]) and all(x == -1 for x in row[nvalid:]), row
            assert row[nvalid - 1] == local, f"local block {local} must be the last valid entry: {row}"
            assert len(set(row[:nvalid])) == nvalid and set(row[:nvalid]) == want[g], (row, want[g])
    out = sc.poisoned_out()
    sparse_attention_ref(sc.q.float(), sc.cache.k_cache[1], sc.cache.v_cache[1], idx, sc.meta, out, sc.scale, bs)
    assert out[sc.T:].isnan().all()
    want = torch.stack([brute_sparse(sc, t, sels[t]) for t in range(sc.T)])
    torch.testing.assert_close(out[: sc.T].double(), want, atol=2e-5, rtol=2e-5)

    # Where every visible block fits in topk, sparse attention is dense attention.
    dense = sc.poisoned_out()
    dense_attention_ref(sc.q.float(), sc.cache.k_cache[1], sc.cache.v_cache[1], sc.meta, dense, sc.scale)
    small = [t for t in range(sc.T) if sc.tok[t][1] // bs + 1 <= topk]
    large = [t for t in range(sc.T) if sc.tok[t][1] // bs + 1 > topk]
    torch.testing.assert_close(out[small], dense[small], atol=1e-6, rtol=1e-6)
    if large:  # and where it does not, selection really drops keys
        assert not torch.allclose(out[large], dense[large], atol=1e-3)


def test_groups_select_different_blocks():
    sc = Scenario(8, 4, 8, 8, 4, [(64, 64)], seed=7)
    idx = torch.empty(4, sc.T, 3, dtype=torch.int32)
    index_topk_ref(sc.iq.float(), sc.cache.index_k_cache[0], sc.meta, 3, 4, idx)
    differ = sum(len({frozenset(idx[g, t].tolist()) for g in range(4)}) > 1 for t in range(sc.T))
    assert differ > sc.T // 2


def test_low_precision_output_dtype():
    sc = Scenario(4, 2, 16, 8, 4, [(18, 6), (5, 1)], seed=11, dtype=torch.bfloat16)
    q = sc.q.to(torch.bfloat16)
    sc.q = q.double()  # brute force sees the rounded values
    out = sc.poisoned_out()
    dense_attention_ref(q, sc.cache.k_cache[0], sc.cache.v_cache[0], sc.meta, out, sc.scale)
    assert out.dtype == torch.bfloat16
    want = torch.stack([brute_dense(sc, t) for t in range(sc.T)])
    torch.testing.assert_close(out[: sc.T].double(), want, atol=2e-2, rtol=2e-2)


def test_reference_argument_errors():
    sc = Scenario(4, 2, 8, 8, 4, [(6, 2)], seed=3)
    out = sc.poisoned_out()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dense_attention_ref(sc.q.float()[:, :3], sc.cache.k_cache[0], sc.cache.v_cache[0], sc.meta, out[:, :3], 1.0)
    with pytest.raises(ValueError, match="page_size"):
        index_topk_ref(sc.iq.float(), sc.cache.index_k_cache[0], sc.meta, 2, 8, torch.empty(2, sc.T, 2, dtype=torch.int32))


# ---- backend ---------------------------------------------------------------------------


def test_torch_backend_matches_references_and_leaves_padding():
    hq, hkv, d, di, bs, topk, specs = CASES[0]
    sc = Scenario(hq, hkv, d, di, bs, specs, seed=21)
    be = make_backend("torch", sc.cache, num_qo_heads=hq, topk=topk, max_tokens=sc.T + 8)
    assert isinstance(be, TorchAttention) and be.topk_buf.shape == (hkv, sc.T + 8, topk)
    with pytest.raises(RuntimeError, match="before plan"):
        be.dense(0, sc.q.float(), sc.poisoned_out())
    be.plan(sc.meta)
    q, iq = sc.q.float(), sc.iq.float()
    out_d, out_s = sc.poisoned_out(), sc.poisoned_out()
    be.dense(0, q, out_d)
    be.sparse(1, q, iq, out_s)
    ref_d, ref_s = sc.poisoned_out(), sc.poisoned_out()
    dense_attention_ref(q, sc.cache.k_cache[0], sc.cache.v_cache[0], sc.meta, ref_d, sc.scale)
    idx = torch.empty(hkv, sc.T, topk, dtype=torch.int32)
    index_topk_ref(iq, sc.cache.index_k_cache[0], sc.meta, topk, bs, idx)
    sparse_attention_ref(q, sc.cache.k_cache[1], sc.cache.v_cache[1], idx, sc.meta, ref_s, sc.scale, bs)
    assert torch.equal(be.topk_buf[:, : sc.T], idx)
    assert (be.topk_buf[:, sc.T:] == -1).all()
    for got, ref in ((out_d, ref_d), (out_s, ref_s)):
        assert got[sc.T:].isnan().all()
        torch.testing.assert_close(got[: sc.T], ref[: sc.T], atol=0, rtol=0)


def test_backend_ops_are_splice_points():
    sc = Scenario(4, 2, 8, 8, 4, [(9, 2)], seed=5)
    be = make_backend("torch", sc.cache, num_qo_heads=4, topk=2, max_tokens=8)
    assert TorchAttention.dense.graphcap_splice.name == "attention.dense"
    assert TorchAttention.sparse.graphcap_splice.name == "attention.sparse"
    assert not TorchAttention.sparse.graphcap_splice.graph_safe_decode

    class Driver:
        seen: list[str] = []

        def on_splice(self, op, fn, args, kwargs):
            self.seen.append(op.name)
            return call_splice(op, fn, args, kwargs)

    drv = Driver()
    out = sc.poisoned_out()
    with step_context(Step(sc.T, {}, metadata=sc.meta), drv):
        be.plan(sc.meta)
        be.dense(0, sc.q.float(), out)
        be.sparse(1, sc.q.float(), sc.iq.float(), out)
    assert drv.seen == ["attention.dense", "attention.sparse"]
    assert not out[: sc.T].isnan().any()


def test_make_backend_errors_and_auto():
    sc = Scenario(4, 2, 8, 8, 4, [(5, 1)], seed=1)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        make_backend("nope", sc.cache, num_qo_heads=4)
    assert "torch" in BACKENDS
    assert isinstance(make_backend("auto", sc.cache, num_qo_heads=4, topk=2), TorchAttention)  # CPU cache
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        make_backend("torch", sc.cache, num_qo_heads=3)
    with pytest.raises(ValueError, match="page_size"):
        make_backend("torch", sc.cache, num_qo_heads=4, block_size=8)
    be = make_backend("torch", sc.cache, num_qo_heads=4, topk=2, max_tokens=1)
    big = MetadataBuilder(sc.cache, 4, 1).build([RequestChunk(0, 3, 2)])
    with pytest.raises(ValueError, match="max_tokens=1"):
        be.plan(big)
