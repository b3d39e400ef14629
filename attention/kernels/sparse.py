"""Block-sparse (and dense fallback) paged GQA in Triton, with a split-K decode path.

Maths (same as ``attention.sparse.sparse_attention_ref``): q-head ``h`` of kv group
``g = h // G`` at position ``p`` attends to keys ``{j <= p : j // B in Sel_g(p)}`` with an
exact softmax (online, base 2: ``exp2(s * scale * log2 e)``), fp32 accumulation.

One kernel, ``_attn_kernel``, grid (token tile, kv group, split):
- the M dimension of both ``tl.dot`` s is (tokens of the tile) x (the G q heads of the
  group), padded to >= 16 rows;
- sparse mode visits the selected blocks of the tile's tokens; a block selected by several
  tokens of the tile is loaded once (its page is skipped at later visits) and each row only
  sees keys of blocks in its own selection, so a tile of neighbouring prefill tokens, which
  mostly pick the same blocks, reads each block once (``BLOCK_T`` tokens per program);
- dense mode (``DENSE``, one token per program) visits blocks ``0 .. p // B``: the fallback
  for dense layers until a faster dense backend is used;
- with ``NSPLIT > 1`` (decode, and tiles of a tiled prefill) each program takes a slice of the
  visits (tiles: of the selection columns) and writes a partial output and its log2-sum-exp;
  ``_merge_group`` combines the slices of every row some split program wrote: in the last
  split program of the row to finish where programs hold one token (``MERGE_LAST``,
  :mod:`attention.kernels.arrival`), else in a launch of ``_merge_kernel`` after.
The token tiles are the fixed grid of ``tile * BLOCK_T`` rows, or (``TILED``) an explicit list
of ``(start, end)`` row ranges, one per program: :mod:`attention.kernels.tiles` builds
request-aligned ones (a tile straddling unrelated requests shares nothing and walks both
requests' pages serially), and ``sparse_attention_prefill_tiled`` runs a step's tiles.
Padded rows (slot ``-1``) are skipped: their output rows are not written. Selections must
hold distinct block ids, as the indexer writes them (``-1`` entries are ignored).

The decode entry points are graph-safe: the grid depends on ``q.shape[0]`` and the block
table width only, every per-request value is read from the metadata's device buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.arrival import arrival_counters, arrive
from attention.kernels.pdl import grid_dependency, pdl_launch
from attention.kernels.tiles import StepTiles, check_tile_rows
from attention.kernels.triton_utils import check_device, entry_at, interpreting, next_pow2, num_sms, pad_dim
from attention.metadata import AttentionMetadata

Tensor = torch.Tensor
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(q, m_i, l_i, acc, k_ptr, v_ptr, page, blk, rows, pos, page_size, qk_scale,
                  stride_k_p, stride_k_s, stride_v_p, stride_v_s, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step over the keys of ``page`` (logical block ``blk``) for ``rows``.

    k_ptr, v_ptr already point at this kv group's head. Returns the updated (m, l, acc).
    """
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    kv_mask = (n[:, None] < page_size) & (d[None, :] < D) & (page >= 0)  # page -1: no memory traffic
    p64 = page.to(tl.int64)
    k = tl.load(k_ptr + p64 * stride_k_p + n[:, None] * stride_k_s + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + p64 * stride_v_p + n[:, None] * stride_v_s + d[None, :], mask=kv_mask, other=0.0)
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
    else:  # an fp8 cache is widened to the queries' dtype (a no-op for a bf16 cache)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
    j = blk * page_size + n
    vis = rows[:, None] & (j[None, :] <= pos[:, None]) & (n[None, :] < page_size)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: avoid inf - inf
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


# Step-varying counts unspecialised and tile rows not on alignment: one build per path serves
# every prefill step (see indexer._partial_kernel).
@triton.jit(do_not_specialize=["T", "BPS"], do_not_specialize_on_alignment=["tiles_ptr"])
def _attn_kernel(
    q_ptr, stride_q_t, stride_q_h,
    k_ptr, v_ptr, stride_k_p, stride_k_s, stride_k_h, stride_v_p, stride_v_s, stride_v_h,
    sel_ptr, stride_sel_h, stride_sel_t,
    bt_ptr, stride_bt, table_rows_ptr, token_seq_ptr, pos_ptr, slot_ptr,
    out_ptr, stride_o_t, stride_o_h, po_ptr, plse_ptr,
    T, page_size, qk_scale, BPS, tiles_ptr, scratch_ptr, count_ptr,
    G: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NSPLIT: tl.constexpr,
    DENSE: tl.constexpr, DOT_F32: tl.constexpr, TILED: tl.constexpr = False, BT_PAD: tl.constexpr = 1,
    MERGE_LAST: tl.constexpr = False, G_PAD: tl.constexpr = 2, S_PAD: tl.constexpr = 2, S_CHUNK: tl.constexpr = 1,
    PDL: tl.constexpr = 0,
):
    grid_dependency(PDL)
    tile = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    if TILED:  # an explicit (start, end) row range per program, end - start <= BLOCK_T
        t_lo = tl.load(tiles_ptr + 2 * tile).to(tl.int32)
        t_hi = tl.load(tiles_ptr + 2 * tile + 1).to(tl.int32)
        n_rows = tl.minimum(t_hi - t_lo, BLOCK_T)
    else:
        t_lo = tile * BLOCK_T
        t_hi = T
        n_rows = BLOCK_T  # a constant trip count (rows past T are no-ops), as before tiles existed
    r = tl.arange(0, BLOCK_M)
    i_r = r // G
    tok = t_lo + i_r
    head = g * G + r % G
    row_ok = (r < BLOCK_T * G) & (tok < t_hi)
    slot = tl.load(slot_ptr + tok, mask=row_ok, other=-1)
    row_ok = row_ok & (slot >= 0)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int32)
    seq = tl.load(token_seq_ptr + tok, mask=row_ok, other=0)
    srow = tl.load(table_rows_ptr + seq, mask=row_ok, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    tok64 = tok.to(tl.int64)
    q = tl.load(q_ptr + tok64[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kg_ptr = k_ptr + g * stride_k_h
    vg_ptr = v_ptr + g * stride_v_h
    if BLOCK_T == 1:
        # One token per program (decode, dense fallback): scalar metadata, and a branch-free
        # loop (absent pages are masked loads) so Triton can pipeline the K/V loads.
        ok0 = t_lo < t_hi
        ok0 = ok0 & (tl.load(slot_ptr + t_lo, mask=ok0, other=-1) >= 0)
        p0 = tl.load(pos_ptr + t_lo, mask=ok0, other=-1).to(tl.int32)
        srow0 = tl.load(table_rows_ptr + tl.load(token_seq_ptr + t_lo, mask=ok0, other=0), mask=ok0, other=0)
        srow0 = srow0.to(tl.int64)
        v_lo = sp * BPS
        if DENSE:
            v_hi = tl.minimum(v_lo + BPS, (p0 + page_size) // page_size)  # p0 = -1 (pad) -> empty
        else:
            v_hi = tl.minimum(v_lo + BPS, TOPK)
            # the split's selected blocks and their pages, read before the loop (``entry_at``)
            kk = tl.arange(0, K_PAD)
            in_split = ok0 & (kk >= v_lo) & (kk < v_hi)
            blks = tl.load(sel_ptr + g * stride_sel_h + t_lo.to(tl.int64) * stride_sel_t + kk, mask=in_split, other=-1)
            pages = tl.load(bt_ptr + srow0 * stride_bt + blks, mask=blks >= 0, other=-1)
        for v in range(v_lo, v_hi):
            if DENSE:
                blk = v
                page = tl.load(bt_ptr + srow0 * stride_bt + blk, mask=ok0, other=-1)
            else:
                blk = entry_at(blks, kk, v)
                page = entry_at(pages, kk, v)
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, kg_ptr, vg_ptr, page, blk, row_ok & (page >= 0), pos,
                                          page_size, qk_scale, stride_k_p, stride_k_s, stride_v_p, stride_v_s,
                                          D, BLOCK_N, BLOCK_D, DOT_F32)
    else:
        # A tile of tokens attends the union of its tokens' selected pages, each page once,
        # every row masked to the pages of its own selection. The union (first occurrences of
        # the tile's [tokens, k] page ids, in order) goes through this program's scratch rows:
        # raw ids, then the unique pages and their logical blocks, so the visit loop is a
        # plain loop of loads the compiler can pipeline.
        kk = tl.arange(0, K_PAD)
        k_lo = sp * BPS
        k_hi = tl.minimum(k_lo + BPS, TOPK)
        in_split = (kk >= k_lo) & (kk < k_hi)
        sel = tl.load(sel_ptr + g * stride_sel_h + tok64[:, None] * stride_sel_t + kk[None, :],
                      mask=row_ok[:, None] & in_split[None, :], other=-1)
        pages = tl.load(bt_ptr + srow[:, None] * stride_bt + sel, mask=sel >= 0, other=-1)  # [BLOCK_M, K_PAD]
        tt = tl.arange(0, BT_PAD)
        tok_t = t_lo + tt
        ok_t = (tt < n_rows) & (tok_t < t_hi)
        ok_t = ok_t & (tl.load(slot_ptr + tok_t, mask=ok_t, other=-1) >= 0)
        srow_t = tl.load(table_rows_ptr + tl.load(token_seq_ptr + tok_t, mask=ok_t, other=0), mask=ok_t, other=0)
        blk_t = tl.load(sel_ptr + g * stride_sel_h + tok_t.to(tl.int64)[:, None] * stride_sel_t + kk[None, :],
                        mask=ok_t[:, None] & in_split[None, :], other=-1)
        page_t = tl.load(bt_ptr + srow_t.to(tl.int64)[:, None] * stride_bt + blk_t, mask=blk_t >= 0, other=-1)
        NE: tl.constexpr = BT_PAD * K_PAD
        e = tl.arange(0, NE)
        flat_p = tl.reshape(page_t, [NE])
        flat_b = tl.reshape(blk_t, [NE])
        scr = scratch_ptr + ((tile * tl.num_programs(1) + g) * NSPLIT + sp).to(tl.int64) * (3 * NE)
        tl.store(scr + e, flat_p)
        tl.debug_barrier()  # the raw ids are read back by other threads of the program
        seen = tl.zeros([NE], tl.int32)
        for j0 in tl.static_range(0, NE, 16):  # [NE, 16] compares at a time (not [NE, NE] registers)
            jj = j0 + tl.arange(0, 16)
            pj = tl.load(scr + jj)
            seen = tl.maximum(seen, tl.max(((flat_p[:, None] == pj[None, :]) & (jj[None, :] < e[:, None])).to(tl.int32),
                                           axis=1))
        first = (flat_p >= 0) & (seen == 0)
        at = tl.cumsum(first.to(tl.int32), axis=0) - 1
        n_u = tl.sum(first.to(tl.int32), axis=0)
        tl.store(scr + NE + at, flat_p, mask=first)
        tl.store(scr + 2 * NE + at, flat_b, mask=first)
        tl.debug_barrier()
        for u in range(n_u):
            page = tl.load(scr + NE + u)
            blk = tl.load(scr + 2 * NE + u)
            rows = row_ok & (tl.max(tl.where(pages == page, 1, 0), axis=1) > 0)
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, kg_ptr, vg_ptr, page, blk, rows, pos,
                                          page_size, qk_scale, stride_k_p, stride_k_s, stride_v_p,
                                          stride_v_s, D, BLOCK_N, BLOCK_D, DOT_F32)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    dmask = row_ok[:, None] & (d[None, :] < D)
    if NSPLIT == 1:
        tl.store(out_ptr + tok64[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=dmask)
    else:
        hq = tl.num_programs(1) * G
        prow = (tok64 * hq + head) * NSPLIT + sp
        tl.store(po_ptr + prow[:, None] * BLOCK_D + d[None, :], o, mask=dmask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(plse_ptr + prow, lse, mask=row_ok)
        if MERGE_LAST:  # one token per program: the last of its NSPLIT splits merges them
            slot0 = tl.load(slot_ptr + t_lo, mask=t_lo < t_hi, other=-1)
            if slot0 >= 0:
                if arrive(count_ptr + t_lo * tl.num_programs(1) + g, NSPLIT):
                    _merge_group(po_ptr, plse_ptr, out_ptr, stride_o_t, stride_o_h, t_lo, g, slot0, hq, G, D,
                                 G_PAD, BLOCK_D, NSPLIT, S_PAD, S_CHUNK)


@triton.jit
def _merge_group(po_ptr, plse_ptr, out_ptr, stride_o_t, stride_o_h, t, g, slot, hq,
                 G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                 NSPLIT: tl.constexpr, S_PAD: tl.constexpr, S_CHUNK: tl.constexpr):
    """out[t, heads of group g] = sum_s w_s o_s with w_s = 2^lse_s / sum 2^lse (``hq`` q heads
    in all; a row with ``slot < 0`` is padding: nothing read or written).

    Every split's log-sum-exp is read at once, then the partial outputs in chunks of
    ``S_CHUNK`` splits whose loads do not wait on each other: a loop over the splits one at a
    time waited two memory latencies per split (the log-sum-exp, then the output it masks).
    The reads go through L2 (``.cg``): a split program that merges (``arrival``) reads what
    programs on other SMs have just written."""
    hh = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    ok = (hh < G) & (slot >= 0)
    head = g * G + hh
    prow = (t.to(tl.int64) * hq + head) * NSPLIT
    ss = tl.arange(0, S_PAD)
    lse_all = tl.load(plse_ptr + prow[:, None] + ss[None, :], mask=ok[:, None] & (ss < NSPLIT)[None, :],
                      other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse_all, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # rows no split wrote: every weight 0
    l = tl.sum(tl.exp2(lse_all - m_safe[:, None]), axis=1)
    cc = tl.arange(0, S_CHUNK)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for s0 in tl.static_range(0, NSPLIT, S_CHUNK):
        s = s0 + cc
        s_ok = ok[:, None] & (s < NSPLIT)[None, :]
        w = tl.exp2(tl.load(plse_ptr + prow[:, None] + s[None, :], mask=s_ok, other=float("-inf"),
                            cache_modifier=".cg") - m_safe[:, None])
        row = prow[:, None] + s[None, :]
        # a split that saw no key (w = 0) may have left its output unwritten: never read it
        o = tl.load(po_ptr + row[:, :, None] * BLOCK_D + d[None, None, :], mask=(s_ok & (w > 0))[:, :, None],
                    other=0.0, cache_modifier=".cg")
        acc += tl.sum(o.to(tl.float32) * w[:, :, None], axis=1)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    # l == 0: no split wrote this row (a real row always sees its own key): not the merge's
    tl.store(out_ptr + t.to(tl.int64) * stride_o_t + head[:, None] * stride_o_h + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(ok & (l > 0))[:, None] & (d[None, :] < D))


@triton.jit
def _merge_kernel(po_ptr, plse_ptr, slot_ptr, out_ptr, stride_o_t, stride_o_h,
                  G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                  NSPLIT: tl.constexpr, S_PAD: tl.constexpr, S_CHUNK: tl.constexpr):
    """Program ``(t, g)``: :func:`_merge_group` of row ``t``, kv group ``g``."""
    t = tl.program_id(0)
    g = tl.program_id(1)
    _merge_group(po_ptr, plse_ptr, out_ptr, stride_o_t, stride_o_h, t, g, tl.load(slot_ptr + t),
                 tl.num_programs(1) * G, G, D, G_PAD, BLOCK_D, NSPLIT, S_PAD, S_CHUNK)


# Bytes of partial outputs one merge program loads at once (``[G_PAD, S_CHUNK, BLOCK_D]``): 64
# fp32 values a thread of its 4 warps; bf16 partials (block-major prefill: 8 heads x 16 splits x
# 128) take twice the values in the same bytes, every split of a row in one load.
MERGE_BYTES = 32768


def _merge_tiles(G: int, nsplit: int, block_d: int, elem_bytes: int = 4) -> dict[str, int]:
    """The merge's padded head and split counts and its split chunk (:func:`_merge_group`) for
    partials of ``elem_bytes`` bytes."""
    g_pad, s_pad = max(2, next_pow2(G)), max(2, next_pow2(nsplit))
    values = MERGE_BYTES // elem_bytes
    return dict(G_PAD=g_pad, S_PAD=s_pad, S_CHUNK=max(1, min(s_pad, values // (g_pad * block_d))))


def merge_splits(po: Tensor, plse: Tensor, slot_mapping: Tensor, out: Tensor, T: int, Hkv: int) -> None:
    """The exact softmax over each row's split partials: ``out[t, h] = sum_s w_s po[t, h, s]``.

    Args:
        po: ``[>= T, Hq, nsplit, BLOCK_D]`` normalised partial outputs (fp32 or bf16).
        plse: ``fp32 [>= T, Hq, nsplit]`` their log2-sum-exps, ``-inf`` where a split saw no key
            (its ``po`` row is never read, so it may be unwritten).
        slot_mapping: the step's slots (rows with slot ``-1`` are padding: not read or written).
        out: ``[>= T, Hq, D]``; T, Hkv: rows to merge, kv groups.
    """
    Hq, nsplit, block_d = po.shape[1], po.shape[2], po.shape[3]
    G = Hq // Hkv
    _merge_kernel[(T, Hkv)](po, plse, slot_mapping, out, out.stride(0), out.stride(1), G=G, D=out.shape[2],
                            BLOCK_D=block_d, NSPLIT=nsplit, **_merge_tiles(G, nsplit, block_d, po.element_size()),
                            num_warps=4)


def _check(q: Tensor, k_cache_l: Tensor, v_cache_l: Tensor, out: Tensor, page_size: int, T: int) -> None:
    if q.dim() != 3 or k_cache_l.dim() != 4 or v_cache_l.shape != k_cache_l.shape or q.shape[2] != k_cache_l.shape[3]:
        raise ValueError(f"need q [T, Hq, D] and cache layers [P, page, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache_l.shape)}, {tuple(v_cache_l.shape)}")
    if q.shape[1] % k_cache_l.shape[2]:
        raise ValueError(f"num_qo_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache_l.shape[2]}")
    if k_cache_l.shape[1] != page_size:
        raise ValueError(f"cache page size {k_cache_l.shape[1]} differs from the metadata's {page_size}")
    if out.shape[1:] != q.shape[1:] or out.shape[0] < T or q.shape[0] < T:
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)} with >= {T} rows")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache_l.stride(3) != 1 or v_cache_l.stride(3) != 1:
        raise ValueError("q, out and the cache layers need a contiguous last dimension")


def _launch(q: Tensor, k_cache_l: Tensor, v_cache_l: Tensor, sel: Tensor | None, meta: AttentionMetadata,
            out: Tensor, scale: float, T: int, block_t: int, nsplit: int, bps: int, dense: bool,
            tiles: Tensor | None = None, merge_last: bool = True) -> None:
    """One ``_attn_kernel`` launch (plus the split merge) over rows ``< T``: the fixed grid of
    ``cdiv(T, block_t)`` token tiles, or with ``tiles`` (``int32 [n, 2]``, checked by the
    caller) one program per ``(start, end)`` row range. One token per program, the last split
    of a row merges it (``arrival``; ``merge_last=False``: a merge launch after, the same bits)."""
    check_device("sparse attention", q, k_cache_l, out, *([] if tiles is None else [tiles]))
    assert block_t == 1 or not dense, "dense mode takes one token per program"
    programs = triton.cdiv(T, block_t) if tiles is None else tiles.shape[0]
    if T == 0 or programs == 0:
        return
    buf = meta.buffers
    Hq, D, Hkv = q.shape[1], q.shape[2], k_cache_l.shape[2]
    G = Hq // Hkv
    topk = 1 if sel is None else sel.shape[2]
    block_d = pad_dim(D)
    if nsplit > 1:
        po = torch.empty((T, Hq, nsplit, block_d), dtype=torch.float32, device=q.device)
        # Given tiles, rows outside them have nothing to merge: -inf, and the merge leaves them
        # unwritten, as the unsplit kernel does. Without, every split writes every real row
        # (the merge reads no other): no fill, one launch fewer a decode layer.
        plse = torch.empty((T, Hq, nsplit), dtype=torch.float32, device=q.device)
        if tiles is not None:
            plse.fill_(float("-inf"))
    else:
        po = plse = out  # unused
    sel_t = sel if sel is not None else meta.block_tables  # any int32 tensor: unused in dense mode
    block_m = pad_dim(block_t * G)
    k_pad = max(2, next_pow2(topk))
    bt_pad = max(next_pow2(block_t), triton.cdiv(16, k_pad))  # >= 16 (token, k) entries: the union's compares
    # multi-token tiles: per program, the raw page ids and the union's pages and blocks
    scratch = (torch.empty(programs * Hkv * nsplit * 3 * bt_pad * k_pad, dtype=torch.int32, device=q.device)
               if block_t > 1 else buf.token_seq)
    merge_last = merge_last and nsplit > 1 and block_t == 1 and tiles is None
    counts = arrival_counters(q.device, T * Hkv) if merge_last else buf.token_seq
    _attn_kernel[(programs, Hkv, nsplit)](
        q, q.stride(0), q.stride(1),
        k_cache_l, v_cache_l, k_cache_l.stride(0), k_cache_l.stride(1), k_cache_l.stride(2),
        v_cache_l.stride(0), v_cache_l.stride(1), v_cache_l.stride(2),
        sel_t, sel_t.stride(0), sel_t.stride(1),
        meta.block_tables, meta.block_tables.stride(0), buf.table_rows, buf.token_seq, buf.positions,
        buf.slot_mapping, out, out.stride(0), out.stride(1), po, plse,
        T, meta.page_size, scale * _LOG2E, bps, buf.token_seq if tiles is None else tiles, scratch, counts,
        G=G, D=D, TOPK=topk, K_PAD=k_pad, BLOCK_T=block_t, BLOCK_M=block_m,
        BLOCK_N=pad_dim(meta.page_size), BLOCK_D=block_d, NSPLIT=nsplit, DENSE=dense,
        DOT_F32=interpreting() or q.dtype == torch.float32,  # interpreter bf16 dot is wrong; fp32: no tf32
        TILED=tiles is not None, BT_PAD=bt_pad, MERGE_LAST=merge_last, **_merge_tiles(G, nsplit, block_d),
        # split tiles: one stage, so two programs share an SM (80 KB of shared memory each, 148
        # at two stages) and every split of a chunk's tiles runs at once
        num_warps=4 if block_m <= 64 else 8, num_stages=1 if block_t > 1 and nsplit > 1 else 2,
        **pdl_launch(q.device),
    )
    if nsplit > 1 and not merge_last:
        merge_splits(po, plse, buf.slot_mapping, out, T, Hkv)


def _check_sel(sel: Tensor, Hkv: int, T: int) -> None:
    if sel.dtype != torch.int32 or sel.dim() != 3 or sel.shape[0] != Hkv or sel.shape[1] < T or sel.stride(2) != 1:
        raise ValueError(f"topk_idx must be int32 [Hkv={Hkv}, >= {T}, topk], got {sel.dtype} {tuple(sel.shape)}")


def decode_splits(num_rows: int, num_visits: int, device: torch.device) -> int:
    """Splits of each (token, group)'s visits so ~2 programs per SM run; shape-only."""
    want = triton.cdiv(2 * num_sms(device), max(num_rows, 1))
    return max(1, min(num_visits, next_pow2(want)))


def sparse_attention_decode(q: Tensor, k_cache_l: Tensor, v_cache_l: Tensor, topk_idx: Tensor,
                            meta: AttentionMetadata, out: Tensor, scale: float, nsplit: int | None = None,
                            merge_last: bool = True) -> None:
    """Graph-safe split-K sparse attention for every row of ``q`` (decode, spec decode).

    Args:
        q: ``[T, Hq, D]``; all T rows run, pad rows (slot -1 in the metadata buffers) are skipped.
        k_cache_l, v_cache_l: one layer's ``[num_pages, page_size, Hkv, D]``.
        topk_idx: ``int32 [Hkv, >= T, topk]`` logical block ids, ``-1`` ignored.
        meta: this step's metadata (device buffers and block tables only).
        out: ``[>= T, Hq, D]``; rows of real tokens are written.
        scale: softmax scale.
        nsplit: programs per (token, group); default :func:`decode_splits`.
        merge_last: the last split of a row merges it (no merge launch); ``False``: the merge
            kernel after (the same bits; for comparisons).
    """
    T = q.shape[0]
    _check(q, k_cache_l, v_cache_l, out, meta.page_size, T)
    _check_sel(topk_idx, k_cache_l.shape[2], T)
    topk = topk_idx.shape[2]
    nsplit = min(topk, nsplit or decode_splits(T * k_cache_l.shape[2], topk, q.device))
    bps = triton.cdiv(topk, nsplit)
    _launch(q, k_cache_l, v_cache_l, topk_idx, meta, out, scale, T, 1, triton.cdiv(topk, bps), bps, False,
            merge_last=merge_last)


def default_block_t(group: int) -> int:
    """Prefill tokens per program: fill 64 rows of ``tl.dot`` with (tokens x the group's q
    heads), at most 16 tokens."""
    return max(1, min(16, 64 // group))


def sparse_attention_prefill(q: Tensor, k_cache_l: Tensor, v_cache_l: Tensor, topk_idx: Tensor,
                             meta: AttentionMetadata, out: Tensor, scale: float, block_t: int | None = None,
                             tiles: Tensor | None = None) -> None:
    """Sparse attention for the step's real tokens (``meta.num_tokens`` rows; host metadata).

    Args: as :func:`sparse_attention_decode`, plus
        block_t: tokens per program sharing the blocks they both selected (default
            :func:`default_block_t`, filling 64 rows of ``tl.dot``; 1 = one token per program).
        tiles: optional ``int32 [n, 2]`` contiguous ``(start, end)`` token rows, one program
            each (``end - start <= block_t``) in place of the fixed ``cdiv(T, block_t)`` grid,
            e.g. :class:`attention.kernels.tiles.StepTiles` rows, which never straddle
            requests; rows no tile covers are not written.
    """
    T = meta.num_tokens
    _check(q, k_cache_l, v_cache_l, out, meta.page_size, T)
    _check_sel(topk_idx, k_cache_l.shape[2], T)
    G = q.shape[1] // k_cache_l.shape[2]
    if block_t is None:
        block_t = default_block_t(G)
    if block_t < 1:
        raise ValueError(f"block_t must be >= 1, got {block_t}")
    if tiles is not None:
        check_tile_rows(tiles, block_t, T)
    _launch(q, k_cache_l, v_cache_l, topk_idx, meta, out, scale, T, block_t, 1, topk_idx.shape[2], False, tiles)


# Programs per tile of a tiled prefill, each over its share of the selection columns (a fixed
# count: one build serves every step).
TILE_SPLITS = 2


def sparse_attention_prefill_tiled(q: Tensor, k_cache_l: Tensor, v_cache_l: Tensor, topk_idx: Tensor,
                                   meta: AttentionMetadata, out: Tensor, scale: float, tiles: StepTiles,
                                   nsplit: int = TILE_SPLITS) -> None:
    """:func:`sparse_attention_prefill` over a step's request-aligned tiles (same outputs).

    One launch of every tile, the one-token requests' included, through the multi-token program
    (``BLOCK_T = tiles.block_t``: a block selected by several tokens of a tile is loaded once),
    ``nsplit`` programs per tile over slices of the selection columns, then the split merge.
    Measured on the H200 (3 decodes + a 1024-token chunk, BENCHMARKS.md "Long context"): the
    one-token requests in a launch of their own after the tiles (the pipelined per-token path)
    made a serial tail, 36 us at 64K and 128K, longer than what their 64-row programs waste
    running beside the tiles; and one program per tile ran one wave of one 148 KB program per
    SM, the widest tile's walk over its blocks setting the time, where two splits of 80 KB share
    an SM (one pipeline stage each).

    Args:
        q, k_cache_l, v_cache_l, topk_idx, meta, out, scale: as :func:`sparse_attention_prefill`.
        tiles: this step's :class:`StepTiles` (planned from ``meta.qo_indptr_host``).
        nsplit: programs per tile (default :data:`TILE_SPLITS`; at most the selection's width).

    Raises:
        ValueError: as :func:`sparse_attention_prefill`, ``tiles`` planned for another token
            count, or ``nsplit < 1``.
    """
    T = meta.num_tokens
    _check(q, k_cache_l, v_cache_l, out, meta.page_size, T)
    _check_sel(topk_idx, k_cache_l.shape[2], T)
    if not isinstance(tiles, StepTiles) or tiles.num_tokens != T:
        raise ValueError(f"tiles must be the StepTiles of this step ({T} tokens), got "
                         f"{getattr(tiles, 'num_tokens', type(tiles))} tokens")
    if nsplit < 1:
        raise ValueError(f"nsplit must be >= 1, got {nsplit}")
    check_tile_rows(tiles.rows, tiles.block_t, T)
    topk = topk_idx.shape[2]
    if tiles.block_t == 1:  # every tile is one token: one launch of the per-token path
        _launch(q, k_cache_l, v_cache_l, topk_idx, meta, out, scale, T, 1, 1, topk, False, tiles.rows)
        return
    bps = triton.cdiv(topk, min(nsplit, topk))
    _launch(q, k_cache_l, v_cache_l, topk_idx, meta, out, scale, T, tiles.block_t, triton.cdiv(topk, bps), bps, False,
            tiles.rows)


PREFILL_DENSE_SPLITS = 16  # programs per (token, kv head) of the fallback's prefill steps


def dense_attention_triton(q: Tensor, k_cache_l: Tensor, v_cache_l: Tensor, meta: AttentionMetadata, out: Tensor,
                           scale: float, graph_safe: bool) -> None:
    """FALLBACK dense causal GQA (one token per program, split-K over key blocks).

    Correct for any batch but slow for long prefills (every token streams its whole context);
    a real dense backend (flashinfer) should be preferred. ``graph_safe=True`` launches all
    ``q.shape[0]`` rows with splits sized by the block-table width (decode graphs);
    otherwise ``meta.num_tokens`` rows with splits sized by ``meta.max_kv_len``.
    """
    T = q.shape[0] if graph_safe else meta.num_tokens
    _check(q, k_cache_l, v_cache_l, out, meta.page_size, T)
    if graph_safe:
        blocks = meta.block_tables.shape[1]
        nsplit = min(64, decode_splits(T * k_cache_l.shape[2], blocks, q.device))
        bps = triton.cdiv(blocks, nsplit)
        nsplit = triton.cdiv(blocks, bps)
    else:
        # A fixed split count (a constexpr) and a runtime share of the context per split: one
        # build serves every prefill step, where splits sized from the step would build anew
        # whenever its token count or context moved to another split count.
        nsplit = PREFILL_DENSE_SPLITS
        bps = triton.cdiv(max(triton.cdiv(meta.max_kv_len, meta.page_size), 1), nsplit)
    _launch(q, k_cache_l, v_cache_l, None, meta, out, scale, T, 1, nsplit, bps, True)


__all__ = [
    "TILE_SPLITS",
    "decode_splits",
    "default_block_t",
    "dense_attention_triton",
    "sparse_attention_decode",
    "sparse_attention_prefill",
    "sparse_attention_prefill_tiled",
]
