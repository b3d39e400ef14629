"""Triton index top-k (prefill and graph-safe decode) against ``attention.indexer.index_topk_ref``.

On CPU the kernels run in the Triton interpreter (tiny shapes); on a GPU the same cases run
compiled, plus real MiniMax-M3 shapes and a capture -> re-plan -> replay test.
"""

from __future__ import annotations

import pytest
import torch
from helpers.paged import DEV, PagedScenario
from helpers.triton_compile import run_compile_reports

from attention.kernels import indexer as indexer_triton
from attention.reference.indexer import block_scores, fp8_query_split, index_topk_ref
from steps import TokenChunk


class Scenario(PagedScenario):
    """One sparse cache layer with random index-K (stale slots too) and one step's index queries.

    specs: [(context length incl. this step, query tokens this step)]; queries are the tail.
    """

    def __init__(self, specs, hkv, di, bs, seed, dtype=torch.bfloat16, spare_pages=2, max_tokens=None):
        super().__init__(specs, hq=hkv, hkv=hkv, d=16, di=di, bs=bs, seed=seed, dtype=dtype, layers=1,
                         sparse_layers=(0,), spare_pages=spare_pages, max_tokens=max_tokens)


def assert_same_selection(out, ref, scores=None, atol=0.0, near_ties=0.01):
    """Same valid count, valid prefix, same local block last, same set of blocks.

    With ``scores`` (``[H, T, nblk]`` reference block scores), a differing block is accepted
    when its score is within ``atol`` of the reference's weakest pick (near-ties), in at most
    a ``near_ties`` fraction of the rows.
    """
    H, T, K = ref.shape
    out, ref = out[:, :T].long().cpu(), ref.long().cpu()
    n_ref, n_out = (ref >= 0).sum(-1), (out >= 0).sum(-1)
    assert torch.equal(n_ref, n_out), "different numbers of selected blocks"
    col = torch.arange(K)
    assert ((out >= 0) == (col < n_out[..., None])).all(), "valid ids must form a prefix"
    last = (n_ref - 1).clamp(min=0)[..., None]
    assert torch.equal(out.gather(-1, last), ref.gather(-1, last)), "the local block must be the last valid entry"
    so, sr = out.sort(-1).values, ref.sort(-1).values
    assert (so[..., 1:] != so[..., :-1])[so[..., 1:] >= 0].all(), "duplicate block ids"
    bad = (so != sr).any(-1).nonzero().tolist()
    if scores is None:
        assert not bad, f"{len(bad)} (head, token) rows select different blocks, e.g. {bad[:3]}"
        return
    scores = scores.cpu()
    for h, t in bad:
        n = int(n_ref[h, t])
        picked_ref = scores[h, t, ref[h, t, : n - 1]]
        picked_out = scores[h, t, out[h, t, : n - 1]]
        assert picked_out.min() >= picked_ref.min() - atol, f"row ({h}, {t}) picked a clearly worse block"
    assert len(bad) <= max(1, int(H * T * near_ties)), f"too many near-tie differences: {len(bad)}"


def run_ref(sc, topk):
    ref = torch.full((sc.iq.shape[1], sc.T, topk), -7, dtype=torch.int32, device=sc.device)
    index_topk_ref(sc.iq, sc.cache.index_k_cache[0], sc.meta, topk, sc.cache.page_size, ref)
    return ref


def poisoned(sc, topk, rows):
    return torch.full((sc.iq.shape[1], rows, topk), -7, dtype=torch.int32, device=sc.device)


# (specs, Hkv, Di, block, topk, prefill block_t, chunk)
PREFILL_CASES = [
    ([(13, 13), (1, 1), (30, 1), (22, 5)], 2, 32, 4, 3, 4, 4),  # mixed batch, tiles straddle sequences
    ([(60, 12), (100, 3)], 1, 32, 8, 4, None, None),  # one index head, default tiling
    ([(9, 3), (17, 17)], 2, 16, 4, 1, 2, 4),  # topk 1: the local block only
    ([(75, 6)], 2, 32, 16, 3, 3, 2),  # several chunks of 2 blocks
]


@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_matches_reference(case):
    specs, hkv, di, bs, topk, block_t, chunk = PREFILL_CASES[case]
    sc = Scenario(specs, hkv, di, bs, seed=case)
    out = poisoned(sc, topk, sc.T + 2)
    indexer_triton.index_topk_prefill(sc.iq, sc.cache.index_k_cache[0], sc.meta, topk, out, block_t, chunk)
    assert (out[:, sc.T:] == -7).all(), "columns past the real tokens must stay untouched"
    assert_same_selection(out, run_ref(sc, topk))


@pytest.mark.parametrize("chunk", [None, 2])
def test_decode_matches_reference_and_pads(chunk):
    specs = [(41, 1), (7, 1), (64, 1), (1, 1)]
    sc = Scenario(specs, 2, 32, 4, seed=10 + (chunk or 0), spare_pages=12)  # capacity well past the contexts
    rows = sc.T + 3  # a padded decode bucket: rows past T are pad rows in the metadata buffers
    out = poisoned(sc, 4, rows)
    indexer_triton.index_topk_decode(sc.iq[:rows], sc.cache.index_k_cache[0], sc.meta, 4, out, chunk)
    assert (out[:, sc.T:] == -1).all(), "pad rows must select nothing"
    assert_same_selection(out, run_ref(sc, 4))


@pytest.mark.parametrize("chunk", [None, 2])
def test_decode_merge_in_last_program_equals_merge_launch(chunk):
    """The last chunk program of a row merges it (``arrival``): the same selections as the
    merge kernel, pad rows all ``-1``, every counter back at zero (the next launch counts
    from it)."""
    from attention.kernels.arrival import arrival_counters

    sc = Scenario([(41, 1), (7, 1), (64, 1), (1, 1)], 2, 32, 4, seed=30 + (chunk or 0), spare_pages=12)
    rows = sc.T + 3
    outs = []
    for merge_last in (False, True, True):  # twice: the counters the first launch left must be zeros
        out = poisoned(sc, 4, rows)
        indexer_triton.index_topk_decode(sc.iq[:rows], sc.cache.index_k_cache[0], sc.meta, 4, out, chunk,
                                         merge_last=merge_last)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert (outs[1][:, sc.T:] == -1).all()
    assert int(arrival_counters(sc.iq.device, 1).abs().sum()) == 0


@pytest.mark.parametrize(("rank_piece", "piece", "merge_last"), [(4, 4, True), (4, 4, False), (4, 64, True),
                                                                 (64, 4, True), (64, 4, False)])
def test_decode_merge_by_rank_or_rounds_of_max(monkeypatch, rank_piece, piece, merge_last):
    """A row whose written candidates fit one ranked piece takes its best by rank, a longer
    one by rounds of max over pieces (several per row at 4: the running list merged with
    each piece's). With ranked pieces of 4 the rows here take both paths (2 to 16 candidates);
    of 64, all are ranked. The reference's selections every way, in the merge launch and in
    the last chunk program."""
    monkeypatch.setattr(indexer_triton, "merge_piece", lambda n, stable: piece)
    monkeypatch.setattr(indexer_triton, "RANK_PIECE", rank_piece)
    sc = Scenario([(41, 1), (7, 1), (64, 1), (1, 1)], 2, 32, 4, seed=40 + piece + rank_piece, spare_pages=12)
    rows = sc.T + 3
    out = poisoned(sc, 4, rows)
    indexer_triton.index_topk_decode(sc.iq[:rows], sc.cache.index_k_cache[0], sc.meta, 4, out, 2,
                                     merge_last=merge_last)
    assert (out[:, sc.T:] == -1).all(), "pad rows must select nothing"
    assert_same_selection(out, run_ref(sc, 4))


@pytest.mark.parametrize(("chunk", "spare_pages", "merge_last", "rank_piece"),
                         [(8, 0, True, 64), (8, 0, False, 4), (8, 60, True, 64), (8, 60, False, 4), (4, 60, True, 4),
                          (4, 60, False, 64), (1, 60, True, 64)])
def test_decode_strided_chunks(monkeypatch, chunk, spare_pages, merge_last, rank_piece):
    """A decode row whose blocks fill less than half of the table's chunks strides them (chunk
    ``c`` holds blocks ``c, c + NC, ...``): in a block table far wider than the contexts (60
    spare pages, as a deployment's capacity) every row's blocks spread one or two to a
    program, which store their keys as they are, and the merge reads each block's key where
    its chunk put it. In a table as narrow as the longest context (two chunks of 8) the short
    rows stride and the long ones keep consecutive chunks, a full one taking rounds of max for
    its 3 best and a chunk of 2 blocks storing them as they are; the merge reads every chunk's
    3. Ranked pieces of 4 send most rows' merges through rounds of max, of 64 all through
    ranking. The reference's selections, in the last chunk program and in the merge launch."""
    monkeypatch.setattr(indexer_triton, "RANK_PIECE", rank_piece)
    sc = Scenario([(41, 1), (7, 1), (64, 1), (1, 1), (30, 1)], 2, 32, 4, seed=60 + chunk + spare_pages,
                  spare_pages=spare_pages)
    rows = sc.T + 2
    out = poisoned(sc, 4, rows)
    indexer_triton.index_topk_decode(sc.iq[:rows], sc.cache.index_k_cache[0], sc.meta, 4, out, chunk,
                                     merge_last=merge_last)
    assert (out[:, sc.T:] == -1).all(), "pad rows must select nothing"
    assert_same_selection(out, run_ref(sc, 4))


def test_decode_reads_only_device_buffers():
    """The graph-safety contract on CPU: after a re-plan (new contexts, pages, batch), a call
    holding the *old* metadata object must still see the new step through the buffers."""
    sc = Scenario([(30, 1), (9, 1), (45, 1)], 2, 16, 4, seed=5, spare_pages=4, max_tokens=4)
    iq, ik = sc.iq[:4].clone(), sc.cache.index_k_cache[0]
    old_meta, out = sc.meta, poisoned(sc, 3, 4)
    indexer_triton.index_topk_decode(iq, ik, old_meta, 3, out)
    sc.cache.reserve(0, 38)
    sc.meta = sc.builder.build([TokenChunk(2, 44, [0]), TokenChunk(0, 37, [0])])
    sc.T = 2
    sc.cache.index_k_cache.copy_(torch.randn(sc.cache.index_k_cache.shape, device=DEV))
    iq.copy_(torch.randn(iq.shape, device=DEV))
    sc.iq = iq
    out.fill_(-7)
    indexer_triton.index_topk_decode(iq, ik, old_meta, 3, out)
    assert_same_selection(out, run_ref(sc, 3))
    assert (out[:, 2:] == -1).all()


def test_ties_go_to_the_lower_block():
    sc = Scenario([(50, 2)], 2, 16, 4, seed=3, dtype=torch.float32)
    sc.cache.index_k_cache.copy_(torch.randn(16, device=DEV).expand_as(sc.cache.index_k_cache))  # all scores equal
    out = poisoned(sc, 4, sc.T)
    indexer_triton.index_topk_decode(sc.iq[: sc.T], sc.cache.index_k_cache[0], sc.meta, 4, out)
    want = torch.tensor([0, 1, 2, 12], dtype=torch.int32, device=DEV)  # positions 48, 49: local block 12
    assert (out == want).all(), out
    assert torch.equal(out, run_ref(sc, 4))


def test_fp8_query_split_is_a_power_of_two_scaled_bf16():
    """The fp8 kernels' query: ``hi + lo`` of each row scaled by a power of two that puts its
    largest entry in (224, 448]; a bf16 entry near the row's largest survives exactly (4 + 4
    significant bits), a small one to e4m3's subnormal step; an all-zero row stays zero."""
    g = torch.Generator().manual_seed(3)
    iq = (torch.randn(6, 2, 128, generator=g) * torch.logspace(-4, 4, 6)[:, None, None]).bfloat16()
    iq[2, 1] = 0
    split = fp8_query_split(iq)
    q = iq.float()
    amax, samax = q.abs().amax(-1), split.abs().amax(-1)
    factor = torch.where(amax > 0, samax / amax.clamp(min=1e-30), torch.ones_like(amax))
    assert torch.equal(factor, torch.exp2(factor.log2().round())), "the scale must be a power of two"
    assert ((samax > 224) & (samax <= 448))[amax > 0].all()
    assert (split[2, 1] == 0).all()
    err = (split - q * factor[..., None]).abs()
    big = q.abs() >= amax[..., None] / 8
    assert (err[big] == 0).all()
    assert (err <= 2.0**-10).all()  # below an eighth of the row's largest: e4m3's subnormal step / 2


def test_rejects_bad_arguments():
    sc = Scenario([(9, 2)], 2, 16, 4, seed=4)
    ik = sc.cache.index_k_cache[0]
    with pytest.raises(ValueError, match="int32"):
        indexer_triton.index_topk_prefill(sc.iq, ik, sc.meta, 3, torch.zeros(2, sc.T, 3, device=DEV))
    with pytest.raises(ValueError, match="topk"):
        indexer_triton.index_topk_prefill(sc.iq, ik, sc.meta, 3, poisoned(sc, 2, sc.T))
    with pytest.raises(ValueError, match="power of two"):
        indexer_triton.index_topk_decode(sc.iq, ik, sc.meta, 3, poisoned(sc, 3, sc.iq.shape[0]), chunk=3)
    with pytest.raises(ValueError, match="index dims"):
        indexer_triton.index_topk_decode(sc.iq[..., :8], ik, sc.meta, 3, poisoned(sc, 3, sc.T))


# ---- compile for Hopper (no GPU needed) -------------------------------------------------


IDX_PTRS = dict(bt_ptr="i32", table_rows_ptr="i32", token_seq_ptr="i32", pos_ptr="i64", slot_ptr="i64", part_ptr="i64",
                out_ptr="i32", count_ptr="i32")


def test_kernels_compile_for_hopper():
    def partial(bt, h, chunk, di=128, bn=128, f32=False, keep_all=False, fp8=False):
        bm = max(64 if fp8 else 16, 1 << (bt * h - 1).bit_length())  # as _launch pads
        c = dict(HIDX=h, DI=di, BLOCK_T=bt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=di, CHUNK=chunk,
                 KP=chunk if keep_all else min(15, chunk), DOT_F32=f32, TILED=keep_all, FULL_PAGE=bn == 128,
                 FP8_DOT=fp8, HP=indexer_triton.row_heads(h, fp8))
        ptrs = dict(IDX_PTRS, **({"iq_ptr": "fp32", "ik_ptr": "fp32"} if f32 else {}),
                    **({"ik_ptr": "fp8e4nv"} if fp8 else {}))
        return ["attention.kernels.indexer", "_partial_kernel", c, ptrs, [], 4 if bm <= 64 else 8,
                indexer_triton.TILE_STAGES]

    def merge(block_c, bucket=False):  # bucket: the merge that fills block-major attention's buckets
        c = dict(HIDX=1, BLOCK_C=block_c, BLOCK_R=indexer_triton.RANK_PIECE, TOPK=16, TOPK_PAD=16, CHUNK=16, KP=16,
                 **(dict(BUCKET=True, G=8, PAIRS=32) if bucket else {}))
        ptrs = dict(IDX_PTRS, req_ptr="i32", counts_ptr="i32", pairs_ptr="i32", plse_ptr="fp32", tiles_ptr="i32")
        return ["attention.kernels.indexer", "_merge_kernel", c, ptrs, [], 1, 3]

    def row(h, chunk, fp8=False, merge_last=False):  # the one-token (decode rows) kernel, as _launch runs it
        c = dict(HIDX=h, DI=128, HP=indexer_triton.row_heads(h, fp8), BLOCK_N=128, BLOCK_D=128, CHUNK=chunk,
                 KP=min(15, chunk), DOT_F32=False, FP8_DOT=fp8, STRIDED=True,
                 **(dict(MERGE_LAST=True, BLOCK_C=512, BLOCK_R=indexer_triton.RANK_PIECE, TOPK=16, TOPK_PAD=16)
                    if merge_last else {}))
        ptrs = dict(IDX_PTRS, **({"ik_ptr": "fp8e4nv"} if fp8 else {}))
        return ["attention.kernels.indexer", "_row_partial_kernel", c, ptrs, [], indexer_triton.ROW_CONFIG["num_warps"],
                indexer_triton.ROW_CONFIG["num_stages"]]

    tiled = partial(indexer_triton.tile_block_t(1), 1, indexer_triton.TILED_CHUNK, keep_all=True)
    fp8_tiled = partial(indexer_triton.tile_block_t(1), 1, indexer_triton.TILED_CHUNK, keep_all=True, fp8=True)
    cases = [partial(1, 4, 4), partial(16, 4, 64), row(1, 64), partial(4, 2, 4, di=32, bn=16, f32=True),
             tiled, merge(128), merge(512), row(4, 8), fp8_tiled, row(1, 64, fp8=True), row(8, 8, fp8=True),
             row(1, 64, merge_last=True), row(1, 64, fp8=True, merge_last=True), merge(128, bucket=True)]
    reports = run_compile_reports(cases)
    bucketing = reports.pop()
    assert bucketing["spill_bytes"] == 0 and bucketing["regs"] <= 128, bucketing
    merging, reports = reports[11:], reports[:11]
    for rep, plain in zip(merging, (reports[2], reports[9])):  # the merge in the last chunk program
        # a GPU-scope count; the merge's registers stay below where 4 warps would bound occupancy
        assert rep["acq_rel_atomics"] and not plain["acq_rel_atomics"], (rep, plain)
        assert rep["spill_bytes"] == 0 and rep["regs"] <= max(128, plain["regs"] + 8), (rep, plain)
        assert rep["copies_in_flight"] == plain["copies_in_flight"] and rep["k_loop_loads"] == 0, (rep, plain)
    for i in (1, 2, 4, 7):
        assert reports[i]["wgmma"], f"the prefill tiles and the key-row decode dot should use Hopper wgmma: {cases[i]}"
    for r in reports[8:]:  # widening the keys (or an mma.sync over f16) would spend what the bytes save
        assert r["fp8_wgmma"] and r["cp_async"], f"an fp8 index-K cache must be read by fp8 wgmma: {r}"
    for i in (2, 4, 8, 9):  # the tiled launches (4, 8) hold the one-token form beside the tile form
        assert reports[i]["k_loop_loads"] == 0, f"index-K pages must be pipelined: {cases[i]} {reports[i]}"
        # pages picked from a list read before the loop: a page id loaded in the loop would make
        # each step wait for the key tile it just asked for (async_wait 0)
        assert reports[i]["copies_in_flight"] == cases[i][6] - 2, f"{cases[i]} {reports[i]}"


# ---- GPU: real shapes -----------------------------------------------------------------------

REAL = dict(hkv=4, di=128, bs=128, topk=16)


def ref_scores(sc, iq=None):
    """Reference block scores ``[H, T, nblk]`` of every real token (``-inf`` past its sequence),
    of the scenario's index queries or of ``iq``."""
    from attention.reference.dense import paged_gather

    m, bs = sc.meta, sc.cache.page_size
    iq = sc.iq if iq is None else iq
    nblk = -(-int(m.kv_lens_host.max()) // bs)
    indptr = m.qo_indptr_host.tolist()
    out = []
    for b in range(m.num_seqs):
        length = int(m.kv_lens_host[b])
        ik = paged_gather(sc.cache.index_k_cache[0], m.block_tables, int(m.table_rows_host[b]), length).float()
        s = block_scores(iq[indptr[b] : indptr[b + 1]].float(), ik, m.positions[indptr[b] : indptr[b + 1]], bs)
        out.append(torch.nn.functional.pad(s, (0, nblk - s.shape[-1]), value=float("-inf")))
    return torch.cat(out, dim=1)


@pytest.mark.cuda
@pytest.mark.parametrize("ctx", [1024, 8192, 32768, 131072])
def test_cuda_real_shapes(ctx):
    topk = REAL["topk"]
    # decode: three requests near ctx; prefill: a 512-token chunk at the tail of a ctx prompt
    dec = Scenario([(ctx, 1), (ctx - 37, 1), (ctx // 2 + 5, 1)], REAL["hkv"], REAL["di"], REAL["bs"], seed=ctx)
    out = poisoned(dec, topk, dec.T + 1)
    indexer_triton.index_topk_decode(dec.iq[: dec.T + 1], dec.cache.index_k_cache[0], dec.meta, topk, out)
    assert_same_selection(out, run_ref(dec, topk), ref_scores(dec), atol=1e-2)
    assert (out[:, dec.T:] == -1).all()

    pre = Scenario([(ctx, min(512, ctx))], REAL["hkv"], REAL["di"], REAL["bs"], seed=ctx + 1)
    out = poisoned(pre, topk, pre.T)
    indexer_triton.index_topk_prefill(pre.iq, pre.cache.index_k_cache[0], pre.meta, topk, out)
    assert_same_selection(out, run_ref(pre, topk), ref_scores(pre), atol=1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 32])
def test_cuda_merge_in_last_program_is_exact_under_load(rows):
    """Decode rows at ~32K context, hundreds of chunk programs at once on shared counters (one
    row: ~256 programs on one counter): the merge in each row's last program selects exactly
    what the merge launch selects, in each of 20 graph replays (a missed ordering would read a
    stale candidate now and then)."""
    topk = REAL["topk"]
    sc = Scenario([(32768 - 97 * i, 1) for i in range(rows)], REAL["hkv"], REAL["di"], REAL["bs"], seed=11 + rows)
    ik, iq = sc.cache.index_k_cache[0], sc.iq[: sc.T]
    ref = poisoned(sc, topk, sc.T)
    indexer_triton.index_topk_decode(iq, ik, sc.meta, topk, ref, merge_last=False)
    out = poisoned(sc, topk, sc.T)
    indexer_triton.index_topk_decode(iq, ik, sc.meta, topk, out)  # compile outside the capture
    assert torch.equal(out, ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_triton.index_topk_decode(iq, ik, sc.meta, topk, out)
    for _ in range(20):
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


@pytest.mark.cuda
def test_cuda_graph_replay_with_new_metadata():
    topk, bucket = REAL["topk"], 8
    sc = Scenario([(5000, 1), (300, 1), (9000, 1), (130, 1)], REAL["hkv"], REAL["di"], REAL["bs"], seed=7,
                  spare_pages=80, max_tokens=bucket)
    ik = sc.cache.index_k_cache[0]
    iq = sc.iq[:bucket].clone()
    out = poisoned(sc, topk, bucket)
    indexer_triton.index_topk_decode(iq, ik, sc.meta, topk, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_triton.index_topk_decode(iq, ik, sc.meta, topk, out)
    # Re-plan: other requests, longer contexts (new pages), different batch size; new data.
    c = sc.cache
    c.reserve(0, 5000 + 700)
    c.reserve(2, 9000 + 129)
    meta2 = sc.builder.build([TokenChunk(2, 9000 + 128, [0]), TokenChunk(0, 5000 + 600, [0]), TokenChunk(1, 299, [0])])
    c.index_k_cache.normal_()
    iq.copy_(torch.randn_like(iq))
    out.fill_(-7)
    graph.replay()
    sc.meta, sc.T, sc.iq = meta2, 3, iq
    assert_same_selection(out, run_ref(sc, topk), ref_scores(sc), atol=1e-2)
    assert (out[:, 3:] == -1).all()


@pytest.mark.cuda
@pytest.mark.parametrize("hkv", [1, 4])
@pytest.mark.parametrize("ctx", [8192, 131072])
def test_cuda_fp8_index_cache_matches_reference(ctx, hkv):
    """An e4m3 index-K cache, read by the kernels' fp8 dots (decode, prefill, tiled prefill),
    selects what the reference selects from the widened cache with the split queries of
    ``fp8_query_split`` (the kernels' own rounding), up to near-ties; and the split queries
    select nearly what the bf16 ones do (their scores are bf16's to ~1e-5). Hopper's fp8 wgmma
    accumulates with fewer bits than fp32 (the first GPU run of this test, at an absolute 1e-3,
    measured picks up to 1.4e-4 of the score below the reference's: 0.8 at scores of 5700), so
    a near-tie is a pick within 2**-11 of the largest score, in up to 5% of the rows (a
    simulation of relative noise 1e-4 on these scores flips 0.5-1.2% of the rows)."""
    from attention.kernels.tiles import TilePlanner

    topk, fp8 = REAL["topk"], torch.float8_e4m3fn

    def fp8_scenario(specs, seed):
        sc = Scenario(specs, hkv, REAL["di"], REAL["bs"], seed=seed)
        ik = sc.cache.index_k_cache[0]
        ik8 = ik.to(fp8)
        ik.copy_(ik8.to(ik.dtype))  # the reference reads the rounded keys, widened exactly
        return sc, ik8

    def check(sc, out):
        split = fp8_query_split(sc.iq[: sc.T])
        ref = torch.full((hkv, sc.T, topk), -7, dtype=torch.int32, device=sc.device)
        index_topk_ref(split, sc.cache.index_k_cache[0], sc.meta, topk, sc.cache.page_size, ref)
        scores = ref_scores(sc, split)
        atol = 2.0**-11 * scores[scores.isfinite()].abs().max().item()
        assert_same_selection(out, ref, scores, atol, near_ties=0.05)
        assert_same_selection(out, run_ref(sc, topk), ref_scores(sc), atol, near_ties=0.05)  # the bf16 queries

    dec, ik8 = fp8_scenario([(ctx, 1), (ctx - 37, 1), (ctx // 2 + 5, 1)], seed=ctx + hkv)
    out = poisoned(dec, topk, dec.T + 1)
    indexer_triton.index_topk_decode(dec.iq[: dec.T + 1], ik8, dec.meta, topk, out)
    check(dec, out)
    assert (out[:, dec.T :] == -1).all()

    pre, ik8 = fp8_scenario([(ctx, 512), (ctx // 3, 1), (ctx - 5, 1)], seed=ctx + hkv + 1)
    out = poisoned(pre, topk, pre.T)
    indexer_triton.index_topk_prefill(pre.iq, ik8, pre.meta, topk, out)
    check(pre, out)
    tiles = TilePlanner(pre.builder.max_tokens, pre.device).plan(pre.meta.qo_indptr_host,
                                                                 indexer_triton.tile_block_t(hkv))
    out = poisoned(pre, topk, pre.T)
    indexer_triton.index_topk_prefill_tiled(pre.iq, ik8, pre.meta, topk, out, tiles)
    check(pre, out)
