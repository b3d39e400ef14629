"""Request-aligned token tiles for the prefill indexer and sparse attention.

- ``prefill_tiles`` against a brute-force enumeration of the tokens; ``TilePlanner`` views;
- the tiled kernels (``index_topk_prefill_tiled``, ``sparse_attention_prefill_tiled`` and the
  ``tiles=`` argument) against the torch references and the untiled kernels, on mixed steps
  (decodes and prefill chunks in any order), pure prefill and pure decode, over paged caches
  whose unused slots hold stale random data;
- the changed kernels compiled for Hopper at real shapes (no GPU needed);
- on a GPU, the rank-of-8 mixed step (8 q heads, 1 kv head, 30 decodes + a 1024-token chunk).

On CPU the kernels run in the Triton interpreter (tiny shapes).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.paged import DEV, PagedScenario
from helpers.triton_compile import run_compile_reports

from attention.kernels import indexer as indexer_triton
from attention.kernels import sparse as sparse_triton
from attention.kernels.tiles import StepTiles, TilePlanner, prefill_tiles
from attention.reference.indexer import block_scores, index_topk_ref
from attention.reference.sparse import sparse_attention_ref

# ---- the tile builder -----------------------------------------------------------------------


def brute_force_tiles(lens: list[int], block_t: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Walk every token: a multi-token request's tokens fill tiles of ``block_t`` in order."""
    multi, single, row = [], [], 0
    for n in lens:
        if n == 1:
            single.append((row, row + 1))
        elif n > 1:
            cur: list[int] = []
            for t in range(row, row + n):
                cur.append(t)
                if len(cur) == block_t or t == row + n - 1:
                    multi.append((cur[0], cur[-1] + 1))
                    cur = []
        row += n
    return multi, single


def indptr_of(lens: list[int], offset: int = 0) -> torch.Tensor:
    return torch.tensor([offset] + [offset + sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)


@pytest.mark.parametrize("seed", range(6))
def test_prefill_tiles_match_brute_force(seed):
    rnd = random.Random(seed)
    for _ in range(40):
        lens = [rnd.choice([0, 1, 1, 1, 2, 3, rnd.randint(1, 70)]) for _ in range(rnd.randint(1, 12))]
        block_t = rnd.choice([1, 2, 3, 4, 8, 16, 64])
        multi, single = prefill_tiles(indptr_of(lens), block_t)
        assert multi.dtype == single.dtype == torch.int32 and multi.shape[1:] == single.shape[1:] == (2,)
        want_m, want_s = brute_force_tiles(lens, block_t)
        assert [tuple(r) for r in multi.tolist()] == want_m, (lens, block_t)
        assert [tuple(r) for r in single.tolist()] == want_s, (lens, block_t)
        # the properties the kernels rely on, checked directly as well
        owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long))
        hits = torch.zeros(sum(lens), dtype=torch.long)
        for s, e in multi.tolist() + single.tolist():
            assert 1 <= e - s and (e - s <= block_t)
            assert owner[s] == owner[e - 1], "a tile crosses a request boundary"
            hits[s:e] += 1
        assert (hits == 1).all(), "every token in exactly one tile"
        assert all(lens[owner[s]] == 1 for s, _ in single.tolist()) and all(e - s == 1 for s, e in single.tolist())
        assert all(lens[owner[s]] > 1 for s, _ in multi.tolist())


def test_prefill_tiles_offset_and_rejects_bad_arguments():
    multi, single = prefill_tiles(indptr_of([5, 1], offset=7), 2)
    assert multi.tolist() == [[7, 9], [9, 11], [11, 12]] and single.tolist() == [[12, 13]]
    with pytest.raises(ValueError, match="block_t"):
        prefill_tiles(indptr_of([3]), 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        prefill_tiles(torch.tensor([0, 4, 2], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="1-D integer CPU"):
        prefill_tiles(torch.tensor([0.0, 4.0]), 4)
    with pytest.raises(ValueError, match="1-D integer CPU"):
        prefill_tiles(torch.zeros(0, dtype=torch.int32), 4)


def test_tile_planner_views_and_capacity():
    planner = TilePlanner(max_tokens=20, device=DEV)
    buf = planner.buffer
    st = planner.plan(indptr_of([1, 9, 1, 1, 4]), 4)
    assert isinstance(st, StepTiles) and st.num_tokens == 16 and st.block_t == 4
    assert st.num_multi == 4 and st.num_single == 3
    assert st.rows.data_ptr() == buf.data_ptr() and st.rows.is_contiguous()
    assert st.multi.tolist() == [[1, 5], [5, 9], [9, 10], [12, 16]]
    assert st.single.tolist() == [[0, 1], [10, 11], [11, 12]]
    st2 = planner.plan(indptr_of([2, 1]), 4)  # the next step: same addresses, new contents
    assert st2.rows.data_ptr() == buf.data_ptr() and st2.rows.tolist() == [[0, 2], [2, 3]]
    st3 = planner.plan(indptr_of([1, 1, 1]), 4)
    assert st3.num_multi == 0 and st3.single.tolist() == [[0, 1], [1, 2], [2, 3]]
    with pytest.raises(ValueError, match="max_tokens"):
        planner.plan(indptr_of([15, 6]), 4)
    with pytest.raises(ValueError, match="max_tokens"):
        TilePlanner(0, DEV)


# ---- tiled kernels in the interpreter -------------------------------------------------------


class Scenario(PagedScenario):
    """Paged K/V/index-K filled with random data everywhere (so unused slots hold stale
    values), a step of ``specs`` = [(context incl. this step, query tokens)] in the given order,
    q/iq with pad rows past the real tokens, and the reference selection. One sparse layer.
    """

    def __init__(self, specs, hq, hkv, d, bs, topk, seed, dtype=torch.float32, spare_pages=2):
        super().__init__(specs, hq=hq, hkv=hkv, d=d, bs=bs, seed=seed, dtype=dtype, layers=1, sparse_layers=(0,),
                         spare_pages=spare_pages)
        self.topk = topk
        c = self.cache
        self.ik, self.k, self.v = c.index_k_cache[0], c.k_cache[0], c.v_cache[0]

    def tiles(self, block_t):
        return TilePlanner(self.builder.max_tokens, DEV).plan(self.meta.qo_indptr_host, block_t)

    def ref_selection(self):
        sel = torch.full((self.iq.shape[1], self.T, self.topk), -7, dtype=torch.int32, device=DEV)
        index_topk_ref(self.iq, self.ik, self.meta, self.topk, self.bs, sel)
        return sel

    def poisoned_sel(self):
        return torch.full((self.iq.shape[1], self.T + 2, self.topk), -7, dtype=torch.int32, device=DEV)

    def sparse_ref(self, sel):
        ref = torch.zeros((self.T,) + self.q.shape[1:], dtype=torch.float32, device=DEV)
        sparse_attention_ref(self.q[: self.T].float(), self.k, self.v, sel, self.meta, ref, self.scale, self.bs)
        return ref


def rel_err(out, ref):
    assert not out.isnan().any(), "NaN in a row that must be written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# specs in batch order: decodes (1 token) and prefill chunks mixed, chunks starting mid-page,
# contexts short enough that rows have fewer than topk visible blocks (-1 padding)
MIXED = [(30, 1), (45, 11), (9, 1), (61, 1), (27, 6), (3, 1)]
CASES = {
    "mixed": MIXED,
    "prefill-first": [(40, 9), (17, 1), (33, 1)],
    "two-prefills": [(22, 7), (50, 13)],
    "pure-prefill": [(47, 14)],
    "pure-decode": [(41, 1), (7, 1), (64, 1), (1, 1)],
}


# (case, block_t): every case once, the mixed step at several tile sizes (1: all one-row
# tiles; 16 with 2 index heads: 32-row programs holding one-token tiles too)
INDEXER_RUNS = [("mixed", 1), ("mixed", 4), ("mixed", 16), ("prefill-first", 4), ("two-prefills", 16),
                ("pure-prefill", 4), ("pure-decode", 4)]
SPARSE_RUNS = [("mixed", 1), ("mixed", 3), ("mixed", 8), ("prefill-first", 3), ("two-prefills", 8),
               ("pure-prefill", 3), ("pure-decode", 3)]


@pytest.mark.parametrize(("name", "block_t"), INDEXER_RUNS)
def test_tiled_indexer_matches_reference_and_untiled(name, block_t):
    sc = Scenario(CASES[name], hq=4, hkv=2, d=16, bs=4, topk=3, seed=list(CASES).index(name) * 10 + block_t)
    ref = sc.ref_selection()
    out = sc.poisoned_sel()
    indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, sc.topk, out, sc.tiles(block_t))
    assert (out[:, sc.T :] == -7).all(), "columns past the real tokens must stay untouched"
    assert torch.equal(out[:, : sc.T], ref), "random data has no near-ties: selections must be equal"
    untiled = sc.poisoned_sel()
    indexer_triton.index_topk_prefill(sc.iq, sc.ik, sc.meta, sc.topk, untiled, block_t=1)
    assert torch.equal(out, untiled)


@pytest.mark.parametrize("rank_piece", [4, 64])
def test_tiled_indexer_long_context_full_pages_and_merge_pieces(monkeypatch, rank_piece):
    """Pages that fill the key tile (16 positions: the unmasked loop over wholly visible blocks
    runs beside the masked one) over a dozen blocks, with the merge streaming its candidates
    in pieces of 8 (several pieces per row) where a ranked piece of 4 does not hold them, or
    ranking every row's in one piece of 64; the chunk given (4 blocks) and the default. Equals
    the reference and the untiled kernel."""
    piece = 8
    monkeypatch.setattr(indexer_triton, "merge_piece", lambda n, stable: piece)
    monkeypatch.setattr(indexer_triton, "RANK_PIECE", rank_piece)
    sc = Scenario([(150, 1), (200, 37), (90, 1)], hq=4, hkv=2, d=16, bs=16, topk=5, seed=5)
    ref = sc.ref_selection()
    for chunk in (4, None):
        out = sc.poisoned_sel()
        indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, sc.topk, out, sc.tiles(8), chunk)
        assert torch.equal(out[:, : sc.T], ref), f"chunk {chunk}, merge piece {piece}"
    untiled = sc.poisoned_sel()
    indexer_triton.index_topk_prefill(sc.iq, sc.ik, sc.meta, sc.topk, untiled, block_t=1, chunk=4)
    assert torch.equal(untiled[:, : sc.T], ref)


@pytest.mark.parametrize(("name", "block_t"), SPARSE_RUNS)
def test_tiled_sparse_matches_reference_and_untiled(name, block_t):
    sc = Scenario(CASES[name], hq=4, hkv=2, d=16, bs=4, topk=3, seed=list(CASES).index(name) * 10 + 50 + block_t)
    sel = sc.ref_selection()
    ref = sc.sparse_ref(sel)
    out = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill_tiled(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, sc.tiles(block_t))
    assert out[sc.T :].isnan().all(), "rows past the real tokens must stay untouched"
    assert rel_err(out[: sc.T], ref) < 1e-4
    untiled = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill(sc.q, sc.k, sc.v, sel, sc.meta, untiled, sc.scale, block_t=1)
    assert rel_err(out[: sc.T], untiled[: sc.T].float()) < 1e-5


@pytest.mark.parametrize("nsplit", [1, 3, 5])
def test_tiled_sparse_splits_give_the_untiled_result(nsplit):
    """Every split count of the tiles (one program per tile; one per selection column; more
    asked than there are columns) gives the untiled result, the one-token requests' rows
    included, and leaves the rows past T alone."""
    sc = Scenario(MIXED, hq=4, hkv=2, d=16, bs=4, topk=3, seed=31 + nsplit)
    sel = sc.ref_selection()
    untiled = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill(sc.q, sc.k, sc.v, sel, sc.meta, untiled, sc.scale, block_t=1)
    out = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill_tiled(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, sc.tiles(3), nsplit)
    assert out[sc.T :].isnan().all()
    assert rel_err(out[: sc.T], untiled[: sc.T].float()) < 1e-5
    with pytest.raises(ValueError, match="nsplit must be >= 1"):
        sparse_triton.sparse_attention_prefill_tiled(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, sc.tiles(3), 0)


def test_tiled_bf16_mixed_step():
    """bf16 caches and queries (fp32 accumulation), shared prefill selections, both kernels."""
    sc = Scenario(MIXED, hq=6, hkv=2, d=32, bs=8, topk=4, seed=7, dtype=torch.bfloat16)
    tiles = sc.tiles(4)
    sel = sc.poisoned_sel()
    indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, sc.topk, sel, tiles)
    assert torch.equal(sel[:, : sc.T], sc.ref_selection())
    out = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill_tiled(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, tiles)
    assert out[sc.T :].isnan().all()
    assert rel_err(out[: sc.T], sc.sparse_ref(sel[:, : sc.T])) < 1e-2


def test_explicit_tile_lists():
    """The ``tiles=`` argument takes any tile list covering the rows: uneven, out of order,
    even straddling requests (the kernels visit each sequence a tile holds)."""
    sc = Scenario(MIXED, hq=4, hkv=2, d=16, bs=4, topk=3, seed=11)
    tiles = torch.tensor([[15, 18], [0, 1], [1, 4], [4, 12], [12, 15], [18, 21]], dtype=torch.int32, device=DEV)
    ref_sel = sc.ref_selection()
    sel = sc.poisoned_sel()
    indexer_triton.index_topk_prefill(sc.iq, sc.ik, sc.meta, sc.topk, sel, block_t=8, tiles=tiles)
    assert torch.equal(sel[:, : sc.T], ref_sel) and (sel[:, sc.T :] == -7).all()
    out = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill(sc.q, sc.k, sc.v, ref_sel, sc.meta, out, sc.scale, block_t=8, tiles=tiles)
    assert out[sc.T :].isnan().all()
    assert rel_err(out[: sc.T], sc.sparse_ref(ref_sel)) < 1e-4
    # rows no tile covers are not written by the attention
    out = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill(sc.q, sc.k, sc.v, ref_sel, sc.meta, out, sc.scale, block_t=8,
                                           tiles=tiles[2:4])
    assert out[:1].isnan().all() and out[12:].isnan().all() and not out[1:12].isnan().any()


def test_tiled_rejects_bad_arguments():
    sc = Scenario([(9, 5), (6, 1)], hq=4, hkv=2, d=16, bs=4, topk=3, seed=3)
    sel = sc.ref_selection()
    tiles = sc.tiles(4)
    with pytest.raises(ValueError, match="int32"):
        indexer_triton.index_topk_prefill(sc.iq, sc.ik, sc.meta, 3, sc.poisoned_sel(), tiles=tiles.rows.long())
    if sc.iq.device.type == "cpu":  # row contents are checked on the CPU only (on a GPU: a device sync)
        with pytest.raises(ValueError, match="block_t"):  # a 4-row tile in 2-row programs would drop rows
            sparse_triton.sparse_attention_prefill(sc.q, sc.k, sc.v, sel, sc.meta, sc.poisoned_out(), sc.scale, 2,
                                                   tiles=tiles.rows)
        with pytest.raises(ValueError, match="<= T"):
            sparse_triton.sparse_attention_prefill(sc.q, sc.k, sc.v, sel, sc.meta, sc.poisoned_out(), sc.scale, 4,
                                                   tiles=tiles.rows + 3)
    other = TilePlanner(16, DEV).plan(indptr_of([3, 1]), 4)
    with pytest.raises(ValueError, match="StepTiles of this step"):
        indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, 3, sc.poisoned_sel(), other)
    with pytest.raises(ValueError, match="StepTiles of this step"):
        sparse_triton.sparse_attention_prefill_tiled(sc.q, sc.k, sc.v, sel, sc.meta, sc.poisoned_out(), sc.scale,
                                                     tiles.rows)


# ---- compile for Hopper (no GPU needed) -----------------------------------------------------


IDX_PTRS = {"bt_ptr": "i32", "table_rows_ptr": "i32", "token_seq_ptr": "i32", "pos_ptr": "i64", "slot_ptr": "i64",
            "part_ptr": "i64", "out_ptr": "i32", "tiles_ptr": "i32"}
ATTN_PTRS = {"sel_ptr": "i32", "bt_ptr": "i32", "table_rows_ptr": "i32", "token_seq_ptr": "i32", "pos_ptr": "i64",
             "slot_ptr": "i64", "po_ptr": "fp32", "plse_ptr": "fp32", "tiles_ptr": "i32",
             "count_ptr": "i32"}


def _partial(bt, h, chunk, tiled):
    bm = max(16, 1 << (bt * h - 1).bit_length())
    c = {"HIDX": h, "DI": 128, "BLOCK_T": bt, "BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_D": 128, "CHUNK": chunk,
         "KP": min(15, chunk), "DOT_F32": False, "TILED": tiled, "FP8_DOT": False, "HP": max(16, h)}
    return ["attention.kernels.indexer", "_partial_kernel", c, IDX_PTRS, [], 4 if bm <= 64 else 8,
            indexer_triton.TILE_STAGES]


def _attn(bt, g, tiled, nsplit=1, stages=2):
    bm = max(16, 1 << (bt * g - 1).bit_length())
    c = {"G": g, "D": 128, "TOPK": 16, "K_PAD": 16, "BLOCK_T": bt, "BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_D": 128,
         "NSPLIT": nsplit, "DENSE": False, "DOT_F32": False, "TILED": tiled, "BT_PAD": 1 << (bt - 1).bit_length()}
    return ["attention.kernels.sparse", "_attn_kernel", c, ATTN_PTRS, ["qk_scale"], 4 if bm <= 64 else 8, stages]


def test_tiled_kernels_compile_for_hopper():
    """Rank-of-8 (1 index head, G = 8) and full-model (4 index heads, G = 16) tiles, tiled and
    untiled at the same shapes (the untiled twin shows what the tile loads cost, and for the
    indexer what its one-token branch costs: nothing at the 64-row tiles it runs with)."""
    bt_idx = indexer_triton.tile_block_t(1)
    cases = [_partial(bt_idx, 1, 8, True), _partial(bt_idx, 1, 8, False), _partial(1, 1, 8, True),
             _partial(16, 4, 64, True),
             _attn(8, 8, True), _attn(8, 8, False), _attn(1, 8, True), _attn(4, 16, True),
             _attn(8, 8, True, sparse_triton.TILE_SPLITS, 1)]  # as sparse_attention_prefill_tiled launches it
    reports = run_compile_reports(cases)
    split = reports[8]  # two split programs share an SM: shared memory and registers for both
    assert 2 * split["shared"] <= 227 * 1024 and 2 * split["regs"] * 128 <= 65536, split
    for case, rep in zip(cases, reports):
        print(case[1], {k: case[2][k] for k in ("BLOCK_T", "BLOCK_M", "TILED")}, rep)
    assert reports[3]["wgmma"] and reports[4]["wgmma"], "the 64-row tiles should use Hopper wgmma"
    for rep in reports[:4]:  # the page list is read before the block loop: key tiles stay in flight
        assert rep["copies_in_flight"] == indexer_triton.TILE_STAGES - 2, rep
    for tiled, untiled in ((reports[0], reports[1]), (reports[4], reports[5])):  # the tile rows cost ~nothing
        assert tiled["shared"] == untiled["shared"], (tiled, untiled)
        assert tiled["regs"] <= untiled["regs"] + 8 and tiled["spill_bytes"] <= untiled["spill_bytes"] + 32


# ---- GPU: the rank-of-8 mixed step -----------------------------------------------------------

RANK8 = {"hq": 8, "hkv": 1, "d": 128, "bs": 128, "topk": 16}
RANK8_STEP = [(3000, 1)] * 15 + [(3024, 1024)] + [(3000, 1)] * 15  # 30 decodes + a chunk at start 2000


def ref_scores(sc):
    """Reference block scores ``[H, T, nblk]`` of every real token (``-inf`` past its context)."""
    from attention.reference.dense import paged_gather

    m, bs = sc.meta, sc.bs
    nblk = -(-int(m.kv_lens_host.max()) // bs)
    out = []
    for q0, q1, length, row in m.requests():
        ik = paged_gather(sc.ik, m.block_tables, row, length).float()
        s = block_scores(sc.iq[q0:q1].float(), ik, m.positions[q0:q1], bs)
        out.append(torch.nn.functional.pad(s, (0, nblk - s.shape[-1]), value=float("-inf")))
    return torch.cat(out, dim=1)


def assert_near_same_selection(out, ref, scores, atol=1e-2):
    """Same block sets, except near-ties (bf16 dots): a differing row's picks must score
    within ``atol`` of the reference's weakest pick, and such rows must be rare."""
    out, ref, scores = out[:, : ref.shape[1]].long().cpu(), ref.long().cpu(), scores.cpu()
    assert torch.equal((out >= 0).sum(-1), (ref >= 0).sum(-1))
    bad = (out.sort(-1).values != ref.sort(-1).values).any(-1).nonzero().tolist()
    for h, t in bad:
        n = int((ref[h, t] >= 0).sum())
        assert out[h, t, n - 1] == ref[h, t, n - 1], "the local block must be the last valid entry"
        assert scores[h, t, out[h, t, : n - 1]].min() >= scores[h, t, ref[h, t, : n - 1]].min() - atol
    assert len(bad) <= max(1, ref.shape[0] * ref.shape[1] // 100), f"{len(bad)} near-tie rows"


@pytest.mark.cuda
def test_cuda_rank8_mixed_step():
    sc = Scenario(RANK8_STEP, RANK8["hq"], RANK8["hkv"], RANK8["d"], RANK8["bs"], RANK8["topk"], seed=8,
                  dtype=torch.bfloat16)
    topk = sc.topk
    planner = TilePlanner(sc.builder.max_tokens, DEV)
    bt_idx = indexer_triton.default_block_t(RANK8["hkv"])
    idx_tiles = planner.plan(sc.meta.qo_indptr_host, bt_idx)
    multi, single = prefill_tiles(sc.meta.qo_indptr_host, bt_idx)
    assert torch.equal(idx_tiles.rows.cpu(), torch.cat([multi, single]))  # pinned staging, async copy
    assert idx_tiles.num_multi == 1024 // bt_idx and idx_tiles.num_single == 30

    ref_sel, scores = sc.ref_selection(), ref_scores(sc)
    sel = sc.poisoned_sel()
    indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, topk, sel, idx_tiles)
    assert (sel[:, sc.T :] == -7).all()
    assert_near_same_selection(sel, ref_sel, scores)
    untiled = sc.poisoned_sel()
    indexer_triton.index_topk_prefill(sc.iq, sc.ik, sc.meta, topk, untiled, block_t=1)
    assert_near_same_selection(sel, untiled[:, : sc.T], scores)

    attn_tiles = sc.tiles(sparse_triton.default_block_t(RANK8["hq"] // RANK8["hkv"]))
    out = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill_tiled(sc.q, sc.k, sc.v, ref_sel, sc.meta, out, sc.scale, attn_tiles)
    assert out[sc.T :].isnan().all()
    assert rel_err(out[: sc.T], sc.sparse_ref(ref_sel)) < 1e-2
    out_u = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill(sc.q, sc.k, sc.v, ref_sel, sc.meta, out_u, sc.scale, block_t=1)
    assert rel_err(out[: sc.T], out_u[: sc.T].float()) < 1e-2

