"""Paged reference attention (dense, index top-k, sparse) and the torch backend against
brute force written straight from the spec: per token, per head, contiguous K/V per sequence."""

from __future__ import annotations

import pytest
import torch
from helpers.paged import PagedScenario, planned

from attention import BACKENDS, AttentionBackend, AttentionDims, make_backend
from attention.backends.split import LayerSplit
from attention.backends.torch import TorchAttention
from attention.backends.triton import TritonAttention
from attention.reference.dense import dense_attention_ref
from attention.reference.indexer import index_topk_ref
from attention.reference.sparse import sparse_attention_ref
from graphcap import GraphKey, Padding, Step, step_context
from graphcap.splice import call_splice
from kvcache.paged import PagedKVCache
from steps import TokenChunk

# (Hq, Hkv, D, Di, B, topk, [(context L, query tokens n), ...]); queries are the last n positions.
CASES = [
    (4, 2, 8, 8, 4, 3, [(13, 13), (1, 1), (30, 1), (22, 5)]),  # mixed: prefill, decodes, a chunk
    (6, 3, 16, 8, 4, 2, [(9, 3), (17, 17)]),
    (2, 1, 8, 4, 8, 4, [(20, 20), (40, 2)]),  # first sequence: sparse == dense everywhere
    (8, 2, 8, 8, 2, 1, [(7, 7), (4, 1)]),  # topk 1: only the local block
    (4, 4, 8, 8, 4, 3, [(26, 26)]),  # no GQA sharing
]


class Scenario(PagedScenario):
    """A paged fp32 cache and a step; brute force reads each sequence's K/V contiguously (fp64)."""

    def __init__(self, hq, hkv, d, di, bs, specs, seed, dtype=torch.float32):
        super().__init__(specs, hq=hq, hkv=hkv, d=d, di=di, bs=bs, seed=seed, dtype=dtype, device="cpu",
                         spare_pages=3, max_tokens=sum(n for _, n in specs) + 4)
        c = self.cache
        self.K = {layer: [self.sequence(c.k_cache[layer], i) for i in range(len(specs))] for layer in (0, 1)}
        self.V = {layer: [self.sequence(c.v_cache[layer], i) for i in range(len(specs))] for layer in (0, 1)}
        self.IK = [self.sequence(c.index_k_cache[0], i) for i in range(len(specs))]
        self.q, self.iq = self.q[: self.T].double(), self.iq[: self.T].double()

    def poisoned_out(self, pad=3):
        return torch.full((self.T + pad, self.hq, self.d), float("nan"), dtype=self.dtype)


def brute_dense(sc, t, layer=0):
    s, p = sc.tok[t]
    grp = sc.hq // sc.hkv
    o = torch.empty(sc.hq, sc.d, dtype=torch.float64)
    for h in range(sc.hq):
        k, v = sc.K[layer][s][: p + 1, h // grp], sc.V[layer][s][: p + 1, h // grp]
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
        k, v = sc.K[1][s][keys, h // grp], sc.V[1][s][keys, h // grp]
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
    sc.q = q.double()  # brute force sees the rounded values (the cache is bf16 already)
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
        index_topk_ref(sc.iq.float(), sc.cache.index_k_cache[0], sc.meta, 2, 8,
                       torch.empty(2, sc.T, 2, dtype=torch.int32))


# ---- backend ---------------------------------------------------------------------------


def dims_for(sc, topk, max_tokens):
    return AttentionDims.for_cache(sc.cache, sc.hq, topk, max_tokens)


def test_torch_backend_matches_references_and_leaves_padding():
    hq, hkv, d, di, bs, topk, specs = CASES[0]
    sc = Scenario(hq, hkv, d, di, bs, specs, seed=21)
    be = make_backend("torch", sc.cache, dims_for(sc, topk, sc.T + 8))
    assert isinstance(be, TorchAttention) and be.topk_buf.shape == (hkv, sc.T + 8, topk)
    with pytest.raises(RuntimeError, match="outside a step"):
        be.dense(0, sc.q.float(), sc.poisoned_out())
    q, iq = sc.q.float(), sc.iq.float()
    out_d, out_s = sc.poisoned_out(), sc.poisoned_out()
    with planned(be, sc.step()):
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


def test_backend_ops_are_splice_points_declared_once():
    sc = Scenario(4, 2, 8, 8, 4, [(9, 2)], seed=5)
    be = make_backend("torch", sc.cache, dims_for(sc, 2, 8))
    for cls in (TorchAttention, TritonAttention, LayerSplit):
        assert cls.dense is AttentionBackend.dense and cls.sparse is AttentionBackend.sparse  # no per-backend copies
    assert AttentionBackend.dense.graphcap_splice.name == "attention.dense"
    assert AttentionBackend.sparse.graphcap_splice.name == "attention.sparse"
    decode = Padding.for_graph(2, 2, GraphKey(2, True))
    assert not AttentionBackend.sparse.graphcap_splice.graph_safe((be,), decode)  # torch: host loops

    class Driver:
        seen: list[str] = []

        def on_splice(self, op, fn, args, kwargs):
            self.seen.append(op.name)
            return call_splice(op, fn, args, kwargs)

    drv = Driver()
    out = sc.poisoned_out()
    step, padding = sc.step(), Padding.unpadded(sc.T, sc.meta.num_seqs)
    with step_context(step, padding, drv):
        be.plan(step, padding)
        be.dense(0, sc.q.float(), out)
        be.sparse(1, sc.q.float(), sc.iq.float(), out)
    assert drv.seen == ["attention.dense", "attention.sparse"]
    assert not out[: sc.T].isnan().any()


def test_layer_split_composes_and_answers_per_part():
    sc = Scenario(4, 2, 8, 8, 4, [(9, 2), (5, 1)], seed=6)
    dims = dims_for(sc, 2, 8)
    split = LayerSplit(dense=TorchAttention(sc.cache, dims), sparse=TritonAttention(sc.cache, dims))
    decode = Padding.for_graph(4, 4, GraphKey(4, True))
    assert not split.dense_graph_safe(decode) and split.sparse_graph_safe(decode)
    assert set(split.graph_tensors()) == {"dense.topk_buf", "sparse.topk_buf"}
    assert split.topk_buf is split.sparse_part.topk_buf
    q = sc.q.float()
    out, ref = sc.poisoned_out(), sc.poisoned_out()
    with planned(split, sc.step()):
        split.dense(0, q, out)
    dense_attention_ref(q, sc.cache.k_cache[0], sc.cache.v_cache[0], sc.meta, ref, sc.scale)
    torch.testing.assert_close(out[: sc.T], ref[: sc.T], atol=0, rtol=0)
    other = PagedKVCache(sc.cache.config)
    with pytest.raises(ValueError, match="share one cache"):
        LayerSplit(dense=TorchAttention(other, dims), sparse=TritonAttention(sc.cache, dims))


def test_make_backend_errors_and_auto_says_why():
    sc = Scenario(4, 2, 8, 8, 4, [(5, 1)], seed=1)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        make_backend("nope", sc.cache, dims_for(sc, 2, 8))
    assert {"torch", "triton", "flashinfer"} <= set(BACKENDS)
    auto = make_backend("auto", sc.cache, dims_for(sc, 2, 8))  # CPU cache
    assert isinstance(auto, TorchAttention) and auto.auto_choice.kind == "torch"
    assert set(auto.auto_choice.skipped) == {"flashinfer", "triton"} and "CUDA" in auto.auto_choice.skipped["triton"]
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        AttentionDims(3, 2, 8, 2, 4, 0.5, 8)
    with pytest.raises(ValueError, match="page_size"):
        TorchAttention(sc.cache, AttentionDims(4, 2, 8, 2, 8, 0.5, 8))
    with pytest.raises(ValueError, match="max_tokens"):
        AttentionDims(4, 2, 8, 2, 4, 0.5, True)
    be = make_backend("torch", sc.cache, dims_for(sc, 2, 1))
    big = sc.plan([TokenChunk(0, 3, [0, 0])])
    with pytest.raises(ValueError, match="max_tokens=1"):
        with planned(be, Step(2, 1, {}, metadata=big)):
            pass
