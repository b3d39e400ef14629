"""Block-major sparse prefill attention (``attention.kernels.sparse_blocks``).

- the host bucket plan against a direct count; ``BlockPlanner`` views and capacity;
- the kernels (Triton interpreter on CPU) against the float64 reference maths and the
  per-token kernel on mixed steps (decodes and chunks in any order, rows with fewer visible
  blocks than top-k, hot blocks selected by every token), selections with duplicates across
  tokens, padded rows left unwritten, a second step on the same planner;
- compiled for Hopper at rank-of-8 shapes (no GPU needed);
- on a GPU, the rank-of-8 mixed step at 8K, 64K and 128K, random and shared selections, against the
  per-token kernel and the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.paged import DEV
from helpers.triton_compile import run_compile_reports
from test_prefill_tiles import CASES, MIXED, RANK8, Scenario, rel_err

from attention.kernels import indexer as indexer_triton
from attention.kernels import sparse as sparse_triton
from attention.kernels import sparse_blocks
from attention.kernels.sparse_blocks import (
    BlockPlan,
    BlockPlanner,
    bucket_pairs,
    bucket_space,
    plan_buckets,
    sparse_attention_prefill_blocks,
)


def planner_for(sc) -> BlockPlanner:
    return BlockPlanner(sc.builder.max_seqs, sc.cache.block_tables.numel(), DEV)


def test_plan_buckets_counts_blocks_and_places():
    indptr = np.array([0, 1, 12, 12, 13, 19])  # a decode, a chunk of 11, an empty request, a decode, a chunk of 6
    kv = np.array([30, 45, 9, 61, 27])
    req, bucket_req, nb, ncap = plan_buckets(indptr, kv, 4)
    blocks = [8, 12, 0, 16, 7]
    assert nb == sum(blocks) and ncap == 8 * 1 + 12 * 11 + 16 * 1 + 7 * 6
    assert req[0].tolist() == [0, 8, 20, 20, 36] and req[2].tolist() == [1, 11, 0, 1, 6]
    assert req[1].tolist() == [0, 8, 8 + 132, 8 + 132, 8 + 132 + 16] and req[3].tolist() == blocks
    assert bucket_req.tolist() == sum(([s] * n for s, n in enumerate(blocks)), [])


def test_block_planner_views_and_capacity():
    sc = Scenario(MIXED, hq=4, hkv=2, d=16, bs=4, topk=3, seed=1)
    planner = planner_for(sc)
    plan = planner.plan(sc.meta)
    req, bucket_req, nb, ncap = plan_buckets(sc.meta.qo_indptr_host.numpy(), sc.meta.kv_lens_host.numpy(), 4)
    B = req.shape[1]
    assert isinstance(plan, BlockPlan) and plan.num_buckets == nb and plan.num_places == ncap
    assert plan.req.data_ptr() == planner.buffer.data_ptr() and plan.num_tokens == sc.T
    assert torch.equal(plan.req[:, :B].cpu().long(), torch.from_numpy(req))
    assert plan.bucket_req.cpu().tolist() == bucket_req.tolist()
    with pytest.raises(ValueError, match="key blocks"):
        BlockPlanner(sc.builder.max_seqs, nb - 1, DEV).plan(sc.meta)
    with pytest.raises(ValueError, match="max_seqs"):
        BlockPlanner(0, 10, DEV)


@pytest.mark.parametrize("name", list(CASES))
def test_block_major_matches_reference_and_per_token(name):
    sc = Scenario(CASES[name], hq=4, hkv=2, d=16, bs=4, topk=3, seed=list(CASES).index(name) + 70)
    sel = sc.ref_selection()
    out = sc.poisoned_out()
    sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, planner_for(sc).plan(sc.meta))
    assert out[sc.T :].isnan().all(), "rows past the real tokens must stay untouched"
    assert rel_err(out[: sc.T], sc.sparse_ref(sel)) < 1e-4
    per_token = sc.poisoned_out()
    sparse_triton.sparse_attention_prefill(sc.q, sc.k, sc.v, sel, sc.meta, per_token, sc.scale, block_t=1)
    assert rel_err(out[: sc.T], per_token[: sc.T].float()) < 1e-5


@pytest.mark.parametrize("name", ["mixed", "two-prefills"])
def test_indexer_merge_buckets_like_the_bucketing_launch(name):
    """The indexer's merge bucketing the pairs (``buckets=``, the backend's path) gives the same
    selections, the same bucket counts and work-item count and the same attention output as
    the indexer, then the bucketing launch; a padded row past the step stays unwritten."""
    sc = Scenario(CASES[name], hq=4, hkv=2, d=16, bs=4, topk=3, seed=list(CASES).index(name) + 90)
    plan = planner_for(sc).plan(sc.meta)
    tiles = sc.tiles(indexer_triton.tile_block_t(2))
    sel = sc.poisoned_sel()
    buckets = indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, sc.topk, sel, tiles,
                                                      buckets=bucket_space(sc.q, 2, sc.topk, plan))
    out = sc.poisoned_out()
    sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, plan, buckets)
    sel_ref = sc.poisoned_sel()
    assert indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, sc.topk, sel_ref, tiles) is None
    assert torch.equal(sel, sel_ref)
    launched = bucket_pairs(bucket_space(sc.q, 2, sc.topk, plan), sel_ref, sc.meta)
    assert torch.equal(buckets.space.counts, launched.space.counts), "pairs per bucket and work items opened"
    out_ref = sc.poisoned_out()
    sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel_ref, sc.meta, out_ref, sc.scale, plan)
    assert out[sc.T :].isnan().all()
    assert rel_err(out[: sc.T], out_ref[: sc.T].float()) < 1e-6
    assert rel_err(out[: sc.T], sc.sparse_ref(sel[:, : sc.T])) < 1e-4
    with pytest.raises(ValueError, match="buckets must hold"):  # buckets of another selection
        sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel_ref, sc.meta, out, sc.scale, plan, buckets)
    with pytest.raises(ValueError, match="buckets were made for"):
        indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, sc.topk, sc.poisoned_sel(), tiles,
                                                buckets=bucket_space(sc.q, 2, sc.topk + 1, plan))


@pytest.mark.parametrize("tiles_per_program", [1, 3])
def test_hot_blocks_fill_several_tiles_and_planner_reuse(tiles_per_program, monkeypatch):
    """Every token of a long chunk selects block 0 and its local block (buckets of more pairs
    than one tile holds: 16 q heads a kv head, 4 pairs a tile; at 3 tiles a program, buckets of
    more pairs than a program holds, and programs of 1-3 tiles), then a second, different step
    on the same planner."""
    monkeypatch.setattr(sparse_blocks, "TILES_PER_PROGRAM", tiles_per_program)
    sc = Scenario([(20, 1), (70, 40), (33, 1)], hq=32, hkv=2, d=16, bs=4, topk=3, seed=3)
    planner = planner_for(sc)
    sel = sc.ref_selection()
    local = (sc.meta.positions[: sc.T] // 4).to(torch.int32)
    hot = torch.where(local > 0, 0, -1).to(torch.int32)
    sel[:, :, 0], sel[:, :, 1], sel[:, :, 2] = hot, -1, local  # -1 in the middle of a row too
    out = sc.poisoned_out()
    sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, planner.plan(sc.meta))
    assert rel_err(out[: sc.T], sc.sparse_ref(sel)) < 1e-4
    sc2 = Scenario([(9, 5), (17, 1)], hq=32, hkv=2, d=16, bs=4, topk=3, seed=4, spare_pages=40)
    planner2 = BlockPlanner(sc.builder.max_seqs, sc.cache.block_tables.numel(), DEV)
    planner2.plan(sc.meta)
    sel2 = sc2.ref_selection()
    out2 = sc2.poisoned_out()
    sparse_attention_prefill_blocks(sc2.q, sc2.k, sc2.v, sel2, sc2.meta, out2, sc2.scale, planner2.plan(sc2.meta))
    assert rel_err(out2[: sc2.T], sc2.sparse_ref(sel2)) < 1e-4


def test_selections_past_a_request_or_repeated_stay_in_the_request():
    """A selection naming a block past its request's keys, or one block twice, is the
    indexer's contract broken: such pairs land in no other request's bucket. The rows of the
    other requests equal the reference; a past-the-keys slot counts as no block."""
    sc = Scenario(MIXED, hq=4, hkv=2, d=16, bs=4, topk=3, seed=11)
    sel = sc.ref_selection()
    first = sc.meta.qo_indptr_host[:2].tolist()  # the first request (a decode) reads past its blocks
    sel[:, first[0] : first[1], 2] = 200
    chunk = sc.meta.qo_indptr_host[1:3].tolist()  # the chunk names one block twice in a row
    sel[:, chunk[0], 1] = sel[:, chunk[0], 0]
    out = sc.poisoned_out()
    sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, planner_for(sc).plan(sc.meta))
    fixed = sel.clone()
    fixed[:, first[0] : first[1], 2] = -1
    ref = sc.sparse_ref(fixed)
    others = torch.ones(sc.T, dtype=torch.bool)
    others[chunk[0]] = False
    assert rel_err(out[: sc.T][others], ref[others]) < 1e-4
    assert out[chunk[0]].isfinite().all()


def test_bf16_and_rejects_bad_arguments(monkeypatch):
    """bf16 queries keep bf16 partial outputs (the default) or fp32 ones: both within bf16's
    bound of the reference, and of each other."""
    sc = Scenario(MIXED, hq=6, hkv=2, d=32, bs=8, topk=4, seed=7, dtype=torch.bfloat16)
    sel = sc.ref_selection()
    plan = planner_for(sc).plan(sc.meta)
    assert sparse_blocks.PARTIALS[torch.bfloat16] == torch.bfloat16
    out = sc.poisoned_out()
    sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, plan)
    assert rel_err(out[: sc.T], sc.sparse_ref(sel)) < 1e-2
    monkeypatch.setattr(sparse_blocks, "PARTIALS", {})
    out32 = sc.poisoned_out()
    sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out32, sc.scale, plan)
    assert rel_err(out32[: sc.T], sc.sparse_ref(sel)) < 1e-2
    assert rel_err(out[: sc.T], out32[: sc.T].float()) < 1e-2
    with pytest.raises(ValueError, match="BlockPlan of this step"):
        sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, None)
    other = Scenario([(9, 2)], hq=6, hkv=2, d=32, bs=8, topk=4, seed=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="BlockPlan of this step"):
        sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale,
                                        planner_for(other).plan(other.meta))
    with pytest.raises(ValueError, match="topk_idx"):
        sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel.long(), sc.meta, out, sc.scale, plan)


def test_block_major_kernels_compile_for_hopper():
    ptrs = {"sel_ptr": "i32", "token_seq_ptr": "i32", "slot_ptr": "i64", "req_ptr": "i32", "counts_ptr": "i32",
            "pairs_ptr": "i32", "plse_ptr": "fp32", "po_ptr": "fp32", "bt_ptr": "i32", "table_rows_ptr": "i32",
            "pos_ptr": "i64", "bucket_req_ptr": "i32", "tiles_ptr": "i32"}
    m = "attention.kernels.sparse_blocks"
    g = RANK8["hq"] // RANK8["hkv"]
    attn = dict(G=g, D=128, TOPK=16, BLOCK_M=64, BLOCK_N=128, BLOCK_D=128, TILES=sparse_blocks.TILES_PER_PROGRAM,
                DOT_F32=False)
    cases = [
        [m, "_bucket_pairs_kernel", dict(G=g, TOPK=16, K_PAD=16, BLOCK_T=sparse_blocks.BUCKET_TOKENS), ptrs, [], 4, 3],
        [m, "_block_attn_kernel", attn, ptrs, ["qk_scale"], 4, 2],
        [m, "_block_attn_kernel", attn, dict(ptrs, k_ptr="fp8e4nv", v_ptr="fp8e4nv"), ["qk_scale"], 4, 2],
        [m, "_block_attn_kernel", dict(attn, TILES=1), ptrs, ["qk_scale"], 4, 1],
    ]
    reports = run_compile_reports(cases)
    assert all(r["wgmma"] for r in reports[1:]), "the block's dots should use Hopper wgmma"


# ---- GPU: rank-of-8 shapes ---------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("tiles_per_program", [1, 4])
@pytest.mark.parametrize("ctx", [8192, 65536, 131072])
def test_cuda_rank8_mixed_step_block_major(ctx, tiles_per_program, monkeypatch):
    """3 decodes + a 1024-token chunk ending at ``ctx``: random selections (the reference
    indexer's on random data) and runs of 32 tokens sharing one, against the per-token kernel
    and the float64-accumulated reference; one tile a block program (one stage) or the
    default four."""
    monkeypatch.setattr(sparse_blocks, "TILES_PER_PROGRAM", tiles_per_program)
    if tiles_per_program == 1:
        monkeypatch.setattr(sparse_blocks, "ATTN_CONFIG", {"num_warps": 4, "num_stages": 1})
    specs = [(ctx, 1), (ctx, 1024), (ctx - 37, 1), (ctx // 2, 1)]
    sc = Scenario(specs, RANK8["hq"], RANK8["hkv"], RANK8["d"], RANK8["bs"], RANK8["topk"], seed=ctx,
                  dtype=torch.bfloat16)
    rand = sc.ref_selection()
    lo = 1
    t = torch.arange(sc.T, device=DEV)
    t0 = torch.where((t >= lo) & (t < lo + 1024), lo + (t - lo) // 32 * 32, t)
    same = (sc.meta.positions[t0] // RANK8["bs"]) == (sc.meta.positions[: sc.T] // RANK8["bs"])
    shared = torch.where(same[None, :, None], rand[:, t0], rand)
    planner = planner_for(sc)
    for sel in (rand, shared):
        out = sc.poisoned_out()
        sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, planner.plan(sc.meta))
        assert out[sc.T :].isnan().all()
        per_token = sc.poisoned_out()
        sparse_triton.sparse_attention_prefill(sc.q, sc.k, sc.v, sel, sc.meta, per_token, sc.scale, block_t=1)
        assert rel_err(out[: sc.T], per_token[: sc.T].float()) < 5e-3
        assert rel_err(out[: sc.T], sc.sparse_ref(sel)) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("ctx", [8192, 65536])
def test_cuda_rank8_indexer_buckets_match_the_bucketing_launch(ctx):
    """The backend's path at rank-of-8 shapes (3 decodes + a 1024-token chunk ending at ``ctx``):
    the indexer's merge buckets the pairs; the selections and the bucket counts equal the
    indexer then the bucketing launch, and the attention equals it within bf16 rounding."""
    specs = [(ctx, 1), (ctx, 1024), (ctx - 37, 1), (ctx // 2, 1)]
    sc = Scenario(specs, RANK8["hq"], RANK8["hkv"], RANK8["d"], RANK8["bs"], RANK8["topk"], seed=ctx + 1,
                  dtype=torch.bfloat16)
    plan = planner_for(sc).plan(sc.meta)
    tiles = sc.tiles(indexer_triton.tile_block_t(RANK8["hkv"]))
    sel = sc.poisoned_sel()
    buckets = indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, sc.topk, sel, tiles,
                                                      buckets=bucket_space(sc.q, RANK8["hkv"], sc.topk, plan))
    out = sc.poisoned_out()
    sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel, sc.meta, out, sc.scale, plan, buckets)
    sel_ref = sc.poisoned_sel()
    indexer_triton.index_topk_prefill_tiled(sc.iq, sc.ik, sc.meta, sc.topk, sel_ref, tiles)
    assert torch.equal(sel, sel_ref)
    launched = bucket_pairs(bucket_space(sc.q, RANK8["hkv"], sc.topk, plan), sel_ref, sc.meta)
    assert torch.equal(buckets.space.counts, launched.space.counts)
    out_ref = sc.poisoned_out()
    sparse_attention_prefill_blocks(sc.q, sc.k, sc.v, sel_ref, sc.meta, out_ref, sc.scale, plan)
    assert out[sc.T :].isnan().all()
    assert rel_err(out[: sc.T], out_ref[: sc.T].float()) < 1e-3
    assert rel_err(out[: sc.T], sc.sparse_ref(sel[:, : sc.T])) < 1e-2
