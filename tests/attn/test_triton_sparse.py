"""Triton block-sparse attention (prefill tiles, split-K decode), the dense fallback and the
TritonAttention backend, against the torch references in ``attention.sparse`` / ``attention.dense``.

On CPU the kernels run in the Triton interpreter (tiny shapes); on a GPU the same cases run
compiled, plus real MiniMax-M3 shapes and capture -> re-plan -> replay tests.
"""

from __future__ import annotations

import pytest
import torch
from helpers.paged import DEV, PagedScenario, planned
from helpers.triton_compile import run_compile_reports

from attention.backends.torch import TorchAttention
from attention.backends.triton import TritonAttention
from attention.dims import AttentionDims
from attention.kernels import sparse as sparse_triton
from attention.reference.dense import dense_attention_ref
from attention.reference.indexer import index_topk_ref
from attention.reference.sparse import sparse_attention_ref
from graphcap import GraphKey, Padding, step_context
from steps import TokenChunk

# bf16 operands with fp32 accumulation; fp32 inputs run fp32 ("ieee") dots, also on a GPU.
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


class Scenario(PagedScenario):
    """Random paged K/V/index-K (stale slots too), one step, q/iq, and reference selections.

    specs: [(context length incl. this step, query tokens this step)]. Layer 0 is dense, layer 1 sparse.
    """

    def __init__(self, specs, hq, hkv, d, bs, topk, seed, dtype=torch.bfloat16, spare_pages=2, max_tokens=None):
        super().__init__(specs, hq=hq, hkv=hkv, d=d, bs=bs, seed=seed, dtype=dtype, spare_pages=spare_pages,
                         max_tokens=max_tokens)
        self.topk = topk

    def ref_selection(self):
        sel = torch.full((self.cache.config.num_kv_heads, self.T, self.topk), -7, dtype=torch.int32, device=DEV)
        index_topk_ref(self.iq, self.cache.index_k_cache[0], self.meta, self.topk, self.cache.page_size, sel)
        return sel

    def sparse_ref(self, sel):
        ref = torch.zeros((self.T,) + self.q.shape[1:], dtype=torch.float32, device=DEV)
        sparse_attention_ref(self.q[: self.T].float(), self.cache.k_cache[1], self.cache.v_cache[1], sel, self.meta,
                             ref, self.scale, self.cache.page_size)
        return ref

    def dense_ref(self):
        ref = torch.zeros((self.T,) + self.q.shape[1:], dtype=torch.float32, device=DEV)
        dense_attention_ref(self.q[: self.T].float(), self.cache.k_cache[0], self.cache.v_cache[0], self.meta, ref,
                            self.scale)
        return ref

    def dims(self, max_tokens=None):
        return AttentionDims.for_cache(self.cache, self.hq, self.topk, max_tokens or self.builder.max_tokens)


def rel_err(out, ref):
    assert not out.isnan().any(), "NaN in a row that must be written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def gather_sparse_ref(q, k_l, v_l, sel, meta, scale, T, chunk=32):
    """fp32 sparse attention gathering only the selected pages (scales to 128K contexts)."""
    buf, bt = meta.buffers, meta.block_tables
    Hq, D = q.shape[1:]
    Hkv, B = k_l.shape[2], k_l.shape[1]
    kp, vp = k_l.permute(0, 2, 1, 3), v_l.permute(0, 2, 1, 3)  # [P, Hkv, B, D]
    out = torch.empty(T, Hq, D, dtype=torch.float32, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        s = sel[:, t0:t1].long().permute(1, 0, 2)  # [n, Hkv, K]
        srow = buf.table_rows[buf.token_seq[t0:t1].long()].long()
        pages = bt[srow[:, None, None], s.clamp(min=0)].long()
        grp = torch.arange(Hkv, device=q.device)[None, :, None]
        k, v = kp[pages, grp].float(), vp[pages, grp].float()  # [n, Hkv, K, B, D]
        j = s[..., None] * B + torch.arange(B, device=q.device)
        vis = (s >= 0)[..., None] & (j <= buf.positions[t0:t1, None, None, None])
        qq = q[t0:t1].float().view(t1 - t0, Hkv, Hq // Hkv, D)
        sc = torch.einsum("nhgd,nhkbd->nhgkb", qq, k) * scale
        sc = sc.masked_fill(~vis[:, :, None], float("-inf"))
        p = torch.softmax(sc.flatten(-2), dim=-1).view_as(sc)
        out[t0:t1] = torch.einsum("nhgkb,nhkbd->nhgd", p, v).reshape(t1 - t0, Hq, D)
    return out


# (specs, Hq, Hkv, D, block, topk, block_t)
PREFILL_CASES = [
    ([(13, 13), (1, 1), (30, 1), (22, 5)], 4, 2, 32, 4, 3, 4),  # tiles straddle sequences
    ([(60, 12), (100, 3)], 6, 2, 32, 8, 4, 2),
    ([(9, 3), (17, 17)], 2, 1, 32, 4, 1, 1),  # topk 1: local block only
    ([(75, 6)], 4, 4, 16, 16, 3, None),  # no GQA sharing, default tile
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_matches_reference(case, dtype):
    specs, hq, hkv, d, bs, topk, block_t = PREFILL_CASES[case]
    sc = Scenario(specs, hq, hkv, d, bs, topk, seed=case, dtype=dtype)
    sel = sc.ref_selection()
    out = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill(sc.q, sc.cache.k_cache[1], sc.cache.v_cache[1], sel, sc.meta, out,
                                           sc.scale, block_t)
    assert out[sc.T :].isnan().all(), "rows past the real tokens must stay untouched"
    assert rel_err(out[: sc.T], sc.sparse_ref(sel)) < TOL[dtype]


@pytest.mark.parametrize("nsplit", [1, 2, 3])
def test_decode_split_matches_reference(nsplit):
    sc = Scenario([(41, 1), (7, 1), (64, 1), (1, 1)], 6, 2, 32, 4, 4, seed=20 + nsplit, dtype=torch.float32)
    sel = torch.full((2, sc.q.shape[0], 4), 3, dtype=torch.int32, device=DEV)  # junk in the pad rows
    sel[:, : sc.T] = sc.ref_selection()
    out = sc.poisoned_out()
    sparse_triton.sparse_attention_decode(sc.q, sc.cache.k_cache[1], sc.cache.v_cache[1], sel, sc.meta, out,
                                          sc.scale, nsplit)
    assert out[sc.T :].isnan().all(), "pad rows (slot -1) must not be written"
    assert rel_err(out[: sc.T], sc.sparse_ref(sel)) < TOL[torch.float32]


@pytest.mark.parametrize("nsplit", [2, 4])
def test_decode_merge_in_last_split_equals_merge_launch(nsplit):
    """The last split of a row merges it (``arrival``): the same bits as the merge kernel, pad
    rows untouched, every counter back at zero (the next launch counts from it)."""
    from attention.kernels.arrival import arrival_counters

    sc = Scenario([(41, 1), (7, 1), (64, 1), (1, 1)], 6, 2, 32, 4, 4, seed=50 + nsplit, dtype=torch.float32)
    sel = torch.full((2, sc.q.shape[0], 4), 3, dtype=torch.int32, device=DEV)
    sel[:, : sc.T] = sc.ref_selection()
    outs = []
    for merge_last in (False, True, True):  # twice: the counters the first launch left must be zeros
        out = sc.poisoned_out()
        sparse_triton.sparse_attention_decode(sc.q, sc.cache.k_cache[1], sc.cache.v_cache[1], sel, sc.meta, out,
                                              sc.scale, nsplit, merge_last=merge_last)
        outs.append(out)
    assert outs[1][sc.T :].isnan().all(), "pad rows (slot -1) must not be written"
    assert torch.equal(outs[0][: sc.T], outs[1][: sc.T]) and torch.equal(outs[1][: sc.T], outs[2][: sc.T])
    assert int(arrival_counters(DEV, 1).abs().sum()) == 0


@pytest.mark.parametrize("graph_safe", [False, True])
def test_dense_fallback_matches_reference(graph_safe):
    sc = Scenario([(13, 13), (30, 1), (22, 5)], 4, 2, 32, 4, 3, seed=30, dtype=torch.bfloat16)
    out = sc.poisoned_out()
    sparse_triton.dense_attention_triton(sc.q, sc.cache.k_cache[0], sc.cache.v_cache[0], sc.meta, out, sc.scale,
                                         graph_safe)
    assert out[sc.T :].isnan().all()
    assert rel_err(out[: sc.T], sc.dense_ref()) < TOL[torch.bfloat16]


def test_gather_reference_matches_sparse_reference():
    sc = Scenario([(30, 7), (17, 2)], 4, 2, 16, 4, 3, seed=40, dtype=torch.float32)
    sel = sc.ref_selection()
    got = gather_sparse_ref(sc.q, sc.cache.k_cache[1], sc.cache.v_cache[1], sel, sc.meta, sc.scale, sc.T, chunk=4)
    assert rel_err(got, sc.sparse_ref(sel)) < 1e-5


@pytest.mark.parametrize("decode,prefill_attention", [(False, "per_token"), (False, "tiles"), (False, "blocks"),
                                                       (True, "per_token"), (True, "blocks")])
def test_backend_matches_torch_backend(decode, prefill_attention):
    specs = [(37, 1), (12, 1), (50, 1)] if decode else [(37, 9), (12, 1), (50, 2)]
    sc = Scenario(specs, 4, 2, 32, 4, 3, seed=50 + decode, dtype=torch.float32)
    tri = TritonAttention(sc.cache, sc.dims(), prefill_attention=prefill_attention)
    ref = TorchAttention(sc.cache, sc.dims())
    rows = sc.q.shape[0] if decode else sc.T  # a decode graph carries pad rows
    n, b = sc.T, sc.meta.num_seqs
    padding = Padding.for_graph(n, b, GraphKey(rows, True)) if decode else Padding.unpadded(n, b)
    outs = {}
    for name, be in (("triton", tri), ("torch", ref)):
        o_sparse, o_dense = sc.poisoned_out(rows), sc.poisoned_out(rows)
        with planned(be, sc.step(), padding):
            be.sparse(1, sc.q[:rows], sc.iq[:rows], o_sparse)
            be.dense(0, sc.q[:rows], o_dense)
        outs[name] = (o_sparse, o_dense)
    assert torch.equal(tri.topk_buf[:, : sc.T], ref.topk_buf[:, : sc.T])  # random data: no near-ties
    for a, b in zip(outs["triton"], outs["torch"]):
        assert a[sc.T :].isnan().all()
        assert rel_err(a[: sc.T], b[: sc.T]) < TOL[torch.float32]


def test_decode_reads_only_device_buffers():
    """Graph-safety on CPU: after a re-plan (new contexts, pages, batch), the decode ops run
    with the *old* metadata object must compute the new step from the persistent buffers."""
    sc = Scenario([(30, 1), (9, 1), (45, 1)], 4, 2, 32, 4, 3, seed=60, dtype=torch.float32, spare_pages=4,
                  max_tokens=4)
    be = TritonAttention(sc.cache, sc.dims(4))
    q, iq = sc.q.clone(), sc.iq.clone()
    o_sparse, o_dense = sc.poisoned_out(), sc.poisoned_out()
    old_step, old_padding = sc.step(), Padding.for_graph(3, 3, GraphKey(4, True))
    with planned(be, old_step, old_padding):
        be.sparse(1, q, iq, o_sparse)
        be.dense(0, q, o_dense)
    sc.cache.reserve(0, 38)
    sc.plan([TokenChunk(2, 44, [0]), TokenChunk(0, 37, [0])])  # new metadata in the same buffers
    sc.refill()
    q.copy_(torch.randn(q.shape, device=DEV))
    iq.copy_(torch.randn(iq.shape, device=DEV))
    sc.q, sc.iq = q, iq
    o_sparse.fill_(float("nan"))
    o_dense.fill_(float("nan"))
    with step_context(old_step, old_padding):  # the ops still hold the old metadata object, as a graph would
        be.sparse(1, q, iq, o_sparse)
        be.dense(0, q, o_dense)
    sel = sc.ref_selection()
    assert torch.equal(be.topk_buf[:, :2], sel)
    assert rel_err(o_sparse[:2], sc.sparse_ref(sel)) < TOL[torch.float32]
    assert rel_err(o_dense[:2], sc.dense_ref()) < TOL[torch.float32]


def test_rejects_bad_arguments():
    sc = Scenario([(9, 2)], 4, 2, 16, 4, 3, seed=70)
    sel = sc.ref_selection()
    k, v = sc.cache.k_cache[1], sc.cache.v_cache[1]
    with pytest.raises(ValueError, match="int32"):
        sparse_triton.sparse_attention_prefill(sc.q, k, v, sel.long(), sc.meta, sc.poisoned_out(), sc.scale)
    with pytest.raises(ValueError, match="multiple"):
        sparse_triton.sparse_attention_decode(sc.q[:, :3], k, v, sel, sc.meta, sc.poisoned_out()[:, :3], sc.scale)
    with pytest.raises(ValueError, match="out"):
        sparse_triton.sparse_attention_prefill(sc.q, k, v, sel, sc.meta, sc.poisoned_out()[:, :2], sc.scale)


# ---- compile for Hopper (no GPU needed) -------------------------------------------------


ATTN_PTRS = dict(sel_ptr="i32", bt_ptr="i32", table_rows_ptr="i32", token_seq_ptr="i32", pos_ptr="i64", slot_ptr="i64",
                 po_ptr="fp32", plse_ptr="fp32", count_ptr="i32")


def test_kernels_compile_for_hopper():
    def attn(bt, g, nsplit, dense=False, d=128, bn=128, f32=False, merge_last=False):
        bm = max(16, 1 << (bt * g - 1).bit_length())
        c = dict(G=g, D=d, TOPK=16, K_PAD=16, BLOCK_T=bt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, NSPLIT=nsplit, DENSE=dense,
                 DOT_F32=f32, BT_PAD=1 << (bt - 1).bit_length(),
                 **(dict(MERGE_LAST=True, G_PAD=g, S_PAD=nsplit, S_CHUNK=max(1, 8192 // (g * d)))
                    if merge_last else {}))
        ptrs = dict(ATTN_PTRS,
                    **({"q_ptr": "fp32", "k_ptr": "fp32", "v_ptr": "fp32", "out_ptr": "fp32"} if f32 else {}))
        return ["attention.kernels.sparse", "_attn_kernel", c, ptrs, ["qk_scale"], 4 if bm <= 64 else 8, 2]

    merge = dict(G=16, D=128, G_PAD=16, BLOCK_D=128, NSPLIT=16, S_PAD=16, S_CHUNK=4)
    cases = [attn(1, 16, 16), attn(4, 16, 1), attn(8, 8, 1), attn(1, 16, 8, dense=True),
             attn(4, 2, 1, d=32, bn=16, f32=True),
             ["attention.kernels.sparse", "_merge_kernel", merge, ATTN_PTRS, [], 4, 3],
             attn(1, 16, 16, merge_last=True), attn(1, 8, 16, merge_last=True), attn(1, 8, 16)]
    # block-major prefill's merge at rank-of-8: bf16 partials, every split of a row in one load
    bf16_merge = dict(G=8, D=128, BLOCK_D=128, NSPLIT=16, **sparse_triton._merge_tiles(8, 16, 128, elem_bytes=2))
    assert bf16_merge["S_CHUNK"] == 16
    cases.append(["attention.kernels.sparse", "_merge_kernel", bf16_merge, dict(ATTN_PTRS, po_ptr="bf16"), [], 4, 3])
    reports = run_compile_reports(cases)
    assert reports.pop()["spill_bytes"] == 0
    assert reports[1]["wgmma"], "the 64-row prefill tile should use Hopper wgmma"
    for rep, plain in ((reports[6], reports[0]), (reports[7], reports[8])):  # the merge in the last split
        # a GPU-scope count; the merge's registers stay below where 4 warps would bound occupancy
        assert rep["acq_rel_atomics"] and not plain["acq_rel_atomics"], (rep, plain)
        assert rep["spill_bytes"] == 0 and rep["regs"] <= max(128, plain["regs"] + 8), (rep, plain)


# ---- GPU: real shapes -----------------------------------------------------------------------


def random_selection(meta, T, hkv, topk, bs, g, share=4):
    """Valid selections (local last), shared by runs of ``share`` neighbouring tokens where
    visibility allows: prefill neighbours mostly pick the same blocks."""
    pos = meta.buffers.positions[:T]
    local = pos // bs
    nblk = int(local.max()) + 1
    scores = torch.rand(hkv, -(-T // share), nblk, generator=g, device=DEV).repeat_interleave(share, 1)[:, :T]
    blk = torch.arange(nblk, device=DEV)
    scores = scores.masked_fill(blk[None, :] >= local[:, None], -1.0)  # the local block is placed last
    n_other = torch.clamp(local, max=topk - 1)
    k = min(topk - 1, nblk)
    sel = torch.full((hkv, T, topk), -1, dtype=torch.int64, device=DEV)
    if k > 0:
        sel[..., :k] = scores.topk(k, dim=-1).indices
    col = torch.arange(topk, device=DEV)
    sel = sel.masked_fill(col >= n_other[:, None], -1)
    sel.scatter_(-1, n_other[None, :, None].expand(hkv, T, 1), local[None, :, None].expand(hkv, T, 1))
    return sel.to(torch.int32)


@pytest.mark.cuda
@pytest.mark.parametrize("ctx", [1024, 8192, 32768, 131072])
def test_cuda_real_shapes(ctx):
    hq, hkv, d, bs, topk = 64, 4, 128, 128, 16
    for specs in ([(ctx, 1), (ctx - 37, 1), (ctx // 2 + 5, 1)], [(ctx, min(256, ctx))]):
        sc = Scenario(specs, hq, hkv, d, bs, topk, seed=ctx)
        sel = torch.full((hkv, sc.q.shape[0], topk), -1, dtype=torch.int32, device=DEV)  # pad rows: -1
        sel[:, : sc.T] = random_selection(sc.meta, sc.T, hkv, topk, bs, sc.g)
        k, v = sc.cache.k_cache[1], sc.cache.v_cache[1]
        ref = gather_sparse_ref(sc.q, k, v, sel, sc.meta, sc.scale, sc.T)
        out = sc.poisoned_out()
        if len(specs) > 1:
            sparse_triton.sparse_attention_decode(sc.q, k, v, sel, sc.meta, out, sc.scale)
        else:
            sparse_triton.sparse_attention_prefill(sc.q, k, v, sel, sc.meta, out, sc.scale)
        assert out[sc.T :].isnan().all()
        assert rel_err(out[: sc.T], ref) < 1e-2
        if ctx == 1024:  # the paged torch reference is cheap here: check the gather reference too
            assert rel_err(ref, sc.sparse_ref(sel)) < 1e-5
        if len(specs) == 1 and ctx <= 8192:
            out_d = sc.poisoned_out()
            sparse_triton.dense_attention_triton(sc.q, sc.cache.k_cache[0], sc.cache.v_cache[0], sc.meta, out_d,
                                                 sc.scale, graph_safe=False)
            assert rel_err(out_d[: sc.T], sc.dense_ref()) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 32])
def test_cuda_merge_in_last_split_is_exact_under_load(rows):
    """Decode rows at ~32K context, every (row, group)'s splits at once on shared counters: the
    merge in the last split gives the merge launch's bits, in each of 20 graph replays (a missed
    ordering would read a stale partial now and then)."""
    hq, hkv, d, bs, topk = 64, 4, 128, 128, 16
    sc = Scenario([(32768 - 97 * i, 1) for i in range(rows)], hq, hkv, d, bs, topk, seed=90 + rows)
    sel = random_selection(sc.meta, sc.T, hkv, topk, bs, sc.g)
    k, v, q = sc.cache.k_cache[1], sc.cache.v_cache[1], sc.q[: sc.T]
    ref = sc.poisoned_out()[: sc.T]
    sparse_triton.sparse_attention_decode(q, k, v, sel, sc.meta, ref, sc.scale, merge_last=False)
    out = sc.poisoned_out()[: sc.T]
    sparse_triton.sparse_attention_decode(q, k, v, sel, sc.meta, out, sc.scale)  # compile outside the capture
    assert torch.equal(out, ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_triton.sparse_attention_decode(q, k, v, sel, sc.meta, out, sc.scale)
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


@pytest.mark.cuda
def test_cuda_graph_replay_with_new_metadata():
    hq, hkv, d, bs, topk, bucket = 64, 4, 128, 128, 16, 8
    sc = Scenario([(5000, 1), (300, 1), (9000, 1), (130, 1)], hq, hkv, d, bs, topk, seed=80, spare_pages=80,
                  max_tokens=bucket)
    be = TritonAttention(sc.cache, sc.dims(bucket))
    q, iq = sc.q[:bucket].clone(), sc.iq[:bucket].clone()
    o_sparse, o_dense = sc.poisoned_out(bucket), sc.poisoned_out(bucket)

    def step():
        be.sparse(1, q, iq, o_sparse)
        be.dense(0, q, o_dense)

    with planned(be, sc.step(), Padding.for_graph(4, 4, GraphKey(bucket, True))):
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    sc.cache.reserve(0, 5700)
    sc.cache.reserve(2, 9129)
    sc.plan([TokenChunk(2, 9128, [0]), TokenChunk(0, 5600, [0]), TokenChunk(1, 299, [0])])
    sc.refill()
    q.copy_(torch.randn(q.shape, device=DEV))
    iq.copy_(torch.randn(iq.shape, device=DEV))
    sc.q, sc.iq = q, iq
    o_sparse.fill_(float("nan"))
    o_dense.fill_(float("nan"))
    with planned(be, sc.step(), Padding.for_graph(3, 3, GraphKey(bucket, True))):
        graph.replay()
    torch.cuda.synchronize()
    sel = be.topk_buf[:, : sc.T].clone()
    ref_sel = sc.ref_selection()
    assert ((sel.sort(-1).values != ref_sel.sort(-1).values).any(-1).float().mean() < 0.02), "selection differs"
    assert rel_err(o_sparse[: sc.T], sc.sparse_ref(sel)) < 1e-2
    assert rel_err(o_dense[: sc.T], sc.dense_ref()) < 1e-2
    assert o_sparse[sc.T :].isnan().all() and o_dense[sc.T :].isnan().all()


def test_backend_refuses_an_unknown_prefill_attention():
    sc = Scenario([(12, 3)], 4, 2, 32, 4, 3, seed=70, dtype=torch.float32)
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        TritonAttention(sc.cache, sc.dims(), prefill_attention="tiled")
