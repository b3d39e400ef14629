"""Index scores + per-group top-k block selection in Triton (MSA "max" score).

Maths (same as ``attention.indexer.index_topk_ref``): for kv group ``g`` and a query at
position ``p``, ``score(b) = max_{j <= p, j in block b} <iq_g(p), ik(j)>`` (fp32, no scale)
over the visible blocks ``0 .. p // B``; the local block ``p // B`` is forced in and placed
last; the other ``topk - 1`` slots take the best remaining blocks; ``-1`` pads the row.
Ties go to the lower block id (as in the reference's stable sort).

Two kernels, used the same way by prefill and decode:
1. ``_partial_kernel`` over (token tile, chunk of ``CHUNK`` key blocks): scores of the tile's
   rows (token x index head) against the chunk's blocks, then each row's best ``KP`` blocks
   of the chunk, as packed int64 keys (below), into a scratch ``[T, H, NC, KP]``.
   Programs of one token run the same candidates from a dot with the keys as its rows (a
   single query would otherwise be padded to a 64-row tile): decode rows in
   ``_row_partial_kernel``, a prefill step's one-row tiles in the tile launch's one-token branch.
2. ``_merge_row`` per (token, head): the best ``topk - 1`` of the ``NC * KP`` candidates,
   then the local block, then ``-1``; in ``_merge_kernel`` over (token, head) after the
   partial launch, or, for one token per program, in the last of the token's chunk programs
   to finish (``MERGE_LAST``, :mod:`attention.kernels.arrival`: no second launch). A row
   whose candidates fit one piece of ``RANK_PIECE`` takes its best by each key's rank among
   them; longer rows stream pieces (:func:`merge_piece`) through ``topk - 1`` rounds of max.

A key packs (score, block id) so one ``max`` finds the best score and, among equal scores,
the lowest id: ``key = sortable_int32(score) << 32 | (2**31 - 1 - id)``. Taken and missing
entries become ``-(2**63 - 1)``, below every key (``-2**63`` itself is not written as a
literal: Triton would type the ``2**63`` as uint64).

Decode (``index_topk_decode``) is graph-safe: the grid is (``T``, capacity chunks) where
``T`` is the batch's row count and the capacity is the block table's width; positions,
sequence rows, slots and block tables are read from device buffers (a query at position
``p`` sees keys ``<= p``, so kv lengths are not needed), and chunks past a sequence's last
block do no loads. The capacity sizes the grid, so a decode row whose context fills less
than half of it strides its chunks (chunk ``c`` holds blocks ``c, c + NC, ...``): a context
far shorter than the capacity still spreads over the row's programs rather than filling the
first chunk or two. Prefill (``index_topk_prefill``) sizes the chunk count from the host's
``max_kv_len`` and tiles several tokens per program so index-K tiles are reused: either the
fixed grid of ``tile * BLOCK_T`` rows (tiles may straddle requests; the partial kernel then
visits each sequence of a tile in turn) or an explicit list of ``(start, end)`` row ranges
(``TILED``; :mod:`attention.kernels.tiles` builds request-aligned ones, and
``index_topk_prefill_tiled`` runs a step's tiles).
Padded rows (slot ``-1``) get an all ``-1`` selection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.arrival import arrival_counters, arrive
from attention.kernels.pdl import grid_dependency, pdl_launch
from attention.kernels.sparse_blocks import BlockBuckets, BucketSpace, bucket_rows
from attention.kernels.tiles import StepTiles, check_tile_rows
from attention.kernels.triton_utils import (
    check_device,
    entry_at,
    fp8_split_rows,
    interpreting,
    next_pow2,
    num_sms,
    pad_dim,
)
from attention.metadata import AttentionMetadata

Tensor = torch.Tensor


@triton.jit
def _pack_keys(score, block_id):
    """Order-preserving (score desc, id asc) int64 keys; see the module docstring."""
    bits = score.to(tl.int32, bitcast=True)
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (key32.to(tl.int64) << 32) | (0x7FFFFFFF - block_id).to(tl.int64)


@triton.jit
def _block_dot(q, q_lo, ik_ptr, page, stride_ik_p, stride_ik_s, page_size, n, d, DI: tl.constexpr,
               DOT_F32: tl.constexpr, FP8_DOT: tl.constexpr):
    """Scores ``[rows, keys]`` of the tile's queries against the keys of cache page ``page``
    (``-1``: absent, scores of zero keys). An fp8 cache is read by fp8 tensor-core dots against
    the ``(q, q_lo)`` pair of ``fp8_split_rows`` (``FP8_DOT``; no widening of the keys, which
    costs more than the bytes fp8 saves), or widened to fp32 under ``DOT_F32``."""
    kt = tl.load(ik_ptr + page.to(tl.int64) * stride_ik_p + n[:, None] * stride_ik_s + d[None, :],
                 mask=(n[:, None] < page_size) & (d[None, :] < DI) & (page >= 0), other=0.0)
    if DOT_F32:
        return tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee")
    if FP8_DOT:
        return tl.dot(q, tl.trans(kt), tl.dot(q_lo, tl.trans(kt)))
    return tl.dot(q, tl.trans(kt.to(q.dtype)))


@triton.jit
def _tile_candidates(
    iq_ptr, stride_iq_t, stride_iq_h, ik_ptr, stride_ik_p, stride_ik_s,
    bt_ptr, stride_bt, table_rows_ptr, token_seq_ptr, pos_ptr, slot_ptr, part_ptr, page_size, NC, t_lo, t_hi, c,
    HIDX: tl.constexpr, DI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, KP: tl.constexpr, DOT_F32: tl.constexpr, FULL_PAGE: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    """The candidates of token rows ``[t_lo, t_hi)`` (at most ``BLOCK_T``) in chunk ``c``:
    ``[BLOCK_M = tokens x index heads, keys]`` dots, the tile's queries as the rows."""
    r = tl.arange(0, BLOCK_M)
    tok = t_lo + r // HIDX
    head = r % HIDX
    row_ok = (r < BLOCK_T * HIDX) & (tok < t_hi)
    slot = tl.load(slot_ptr + tok, mask=row_ok, other=-1)
    row_ok = row_ok & (slot >= 0)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int32)
    seq = tl.load(token_seq_ptr + tok, mask=row_ok, other=0)
    local = pos // page_size
    b0 = c * CHUNK
    # Chunks past every row's last visible block (decode launches at block-table capacity)
    # do nothing; the merge skips their candidates, which are never written.
    if b0 <= tl.max(tl.where(row_ok, local, -1), axis=0):
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        q = tl.load(iq_ptr + tok[:, None] * stride_iq_t + head[:, None] * stride_iq_h + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < DI), other=0.0)
        q_lo = q
        if DOT_F32:
            q = q.to(tl.float32)
        elif FP8_DOT:
            q, q_lo, _ = fp8_split_rows(q)  # a row's scores are compared only with each other: 2**e stays
        cols = tl.arange(0, CHUNK)
        S = tl.full([BLOCK_M, CHUNK], float("-inf"), tl.float32)
        # Rows of one tile may belong to several sequences (tiles straddle requests in the
        # fixed grid): visit each sequence present, against its own pages.
        s_lo = tl.min(tl.where(row_ok, seq, 2147483647), axis=0)
        s_hi = tl.max(tl.where(row_ok, seq, -1), axis=0)
        for s in range(s_lo, s_hi + 1):
            in_s = row_ok & (seq == s)
            p_hi = tl.max(tl.where(in_s, pos, -1), axis=0)
            b_end = tl.minimum(b0 + CHUNK, (p_hi + page_size) // page_size)  # p_hi = -1 -> b_end <= 0
            srow = tl.load(table_rows_ptr + s)
            # Blocks wholly before every row's position need no causal mask (all but the last
            # few of a long context): a first loop takes them without the [rows, keys] select
            # (only where a page fills the tile's key columns: no padded columns to mask).
            p_lo = tl.min(tl.where(in_s, pos, 2147483647), axis=0)
            b_mid = tl.minimum(b_end, tl.maximum(b0, (p_lo + 1) // page_size)) if FULL_PAGE else b0
            bt_row = bt_ptr + srow.to(tl.int64) * stride_bt
            pages = tl.load(bt_row + b0 + cols, mask=b0 + cols < b_end, other=-1)
            for b in range(b0, b_mid):
                sc = _block_dot(q, q_lo, ik_ptr, entry_at(pages, cols, b - b0), stride_ik_p, stride_ik_s,
                                page_size, n, d, DI, DOT_F32, FP8_DOT)
                bs = tl.where(local == b, float("-inf"), tl.max(sc, axis=1))  # the merge forces the local block
                S = tl.where((cols[None, :] == b - b0) & in_s[:, None], bs[:, None], S)
            for b in range(b_mid, b_end):
                sc = _block_dot(q, q_lo, ik_ptr, entry_at(pages, cols, b - b0), stride_ik_p, stride_ik_s,
                                page_size, n, d, DI, DOT_F32, FP8_DOT)
                j = b * page_size + n
                vis = in_s[:, None] & (j[None, :] <= pos[:, None]) & (n[None, :] < page_size)
                bs = tl.max(tl.where(vis, sc, float("-inf")), axis=1)
                bs = tl.where(local == b, float("-inf"), bs)
                S = tl.where((cols[None, :] == b - b0) & in_s[:, None], bs[:, None], S)
        keys = _pack_keys(S, b0 + cols[None, :])
        out = part_ptr + ((tok.to(tl.int64) * HIDX + head) * NC + c) * KP
        if KP == CHUNK:  # every block of the chunk is a candidate: no partial selection
            tl.store(out[:, None] + cols[None, :], keys, mask=row_ok[:, None])
        else:
            for i in tl.static_range(KP):
                best = tl.max(keys, axis=1)
                tl.store(out + i, best, mask=row_ok)
                keys = tl.where(keys == best[:, None], -9223372036854775807, keys)


@triton.jit
def _strided(local, NC, CHUNK: tl.constexpr, STRIDED: tl.constexpr):
    """Whether a row's chunks are strided (chunk ``c`` holds blocks ``c, c + NC, ...``) rather
    than ``CHUNK`` consecutive blocks: with ``STRIDED`` (decode rows), a row whose blocks fill
    less than half of the ``NC * CHUNK`` the block table's width sized. A short context in a
    wide table then spreads over all of its row's programs (consecutive chunks put it in the
    first one or two); a longer one keeps consecutive chunks (H100, 64K context in a 128K
    table: striding every row was 1.4-5.7% slower, BENCHMARKS.md seventeenth round)."""
    if STRIDED:
        s = 2 * local < NC * CHUNK
    else:
        s = local < -1  # never (a row's local block is >= 0): consecutive chunks
    return s


@triton.jit
def _chunks_run(local, NC, CHUNK: tl.constexpr, strided):
    """How many of a row's ``NC`` chunk programs write candidates (chunks ``0 .. n - 1``): those
    holding a block up to the local one (``strided``, :func:`_strided`: chunk ``c`` starts at
    block ``c``)."""
    return tl.minimum(NC, tl.where(strided, local + 1, local // CHUNK + 1))


@triton.jit
def _row_candidates(
    iq_ptr, stride_iq_t, stride_iq_h, ik_ptr, stride_ik_p, stride_ik_s,
    bt_ptr, stride_bt, table_rows_ptr, token_seq_ptr, pos_ptr, slot_ptr, part_ptr, page_size, NC, tok, c,
    HIDX: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr, KP: tl.constexpr, DOT_F32: tl.constexpr, FP8_DOT: tl.constexpr,
    STRIDED: tl.constexpr = False,
):
    """The candidates of the one token row ``tok`` in chunk ``c``, from a dot with the block's
    keys as its rows, ``[BLOCK_N keys, D] x [D, HP]`` (the token's index heads, padded to
    ``HP``: :func:`row_heads`), where the query-rows form would pad one token to a 64-row tile.
    At 64 rows the padding is 64x the tensor-core work of the real row, which at fp8 costs as
    long as streaming the keys does; here it is at most 16x, and the bytes set the time.

    fp8 keys (``FP8_DOT``) meet the query's two e4m3 parts in one dot: its ``2 * HP`` columns
    hold each head's ``hi`` and ``lo`` side by side, summed in fp32 after the dot (two dots of
    ``HP`` columns, one per part, issued twice the wgmma per page and waited for each: the fp8
    page is half a bf16 one, so per byte that was four times bf16's tensor-core work).

    Only blocks before the token's local block are scored: they hold no key past its position
    (no causal mask), and the merge forces the local block in. A padded row (slot -1) and
    chunks past the local block (decode launches at block-table capacity) write nothing: the
    merge reads neither.

    ``STRIDED``: a short context's chunks are strided (:func:`_strided`), so its blocks spread
    over the row's programs whatever the capacity that sized the grid. A chunk holding at most
    ``KP`` blocks stores its keys as they are, with no rounds of max."""
    slot = tl.load(slot_ptr + tok)
    local = tl.load(pos_ptr + tok).to(tl.int32) // page_size
    strided = _strided(local, NC, CHUNK, STRIDED)
    blk = tl.where(strided, c + tl.arange(0, CHUNK) * NC, c * CHUNK + tl.arange(0, CHUNK))  # this chunk's blocks
    # of them before the local block
    n_mine = tl.where(strided, tl.where(local > c, (local - c + NC - 1) // NC, 0), tl.minimum(CHUNK, local - c * CHUNK))
    if (slot >= 0) & (c < _chunks_run(local, NC, CHUNK, strided)):
        h = tl.arange(0, HP)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, CHUNK)
        q_row = iq_ptr + tok.to(tl.int64) * stride_iq_t
        if FP8_DOT:  # dot column 2h holds head h's hi part, 2h + 1 its lo part (the same row split)
            r = tl.arange(0, 2 * HP)
            q = tl.load(q_row + (r // 2)[:, None] * stride_iq_h + d[None, :],
                        mask=((r // 2)[:, None] < HIDX) & (d[None, :] < DI), other=0.0)
            hi, lo, _ = fp8_split_rows(q)  # a row's scores are compared only with each other: 2**e stays
            q = tl.where((r % 2 == 0)[:, None], hi, lo)
        else:
            q = tl.load(q_row + h[:, None] * stride_iq_h + d[None, :],
                        mask=(h[:, None] < HIDX) & (d[None, :] < DI), other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
        srow = tl.load(table_rows_ptr + tl.load(token_seq_ptr + tok))
        bt_row = bt_ptr + srow.to(tl.int64) * stride_bt
        S = tl.full([CHUNK, HP], float("-inf"), tl.float32)
        pages = tl.load(bt_row + blk, mask=cols < n_mine, other=-1)
        for j in range(0, n_mine):
            page = entry_at(pages, cols, j)
            kt = tl.load(ik_ptr + page.to(tl.int64) * stride_ik_p + n[:, None] * stride_ik_s + d[None, :],
                         mask=(n[:, None] < page_size) & (d[None, :] < DI) & (page >= 0), other=0.0)
            if DOT_F32:
                sc = tl.dot(kt.to(tl.float32), tl.trans(q), input_precision="ieee")
            elif FP8_DOT:
                sc_hi, sc_lo = tl.split(tl.reshape(tl.dot(kt, tl.trans(q)), [BLOCK_N, HP, 2]))
                sc = sc_hi + sc_lo
            else:
                sc = tl.dot(kt.to(q.dtype), tl.trans(q))
            bs = tl.max(tl.where(n[:, None] < page_size, sc, float("-inf")), axis=0)  # [HP]
            S = tl.where(cols[:, None] == j, bs[None, :], S)
        keys = _pack_keys(S, blk[:, None])
        out = part_ptr + ((tok.to(tl.int64) * HIDX + h) * NC + c) * KP
        if KP == CHUNK:
            tl.store(out[None, :] + cols[:, None], keys, mask=h[None, :] < HIDX)
        elif n_mine <= KP:  # every scored block is a candidate; the rest are -inf keys
            tl.store(out[None, :] + cols[:, None], keys, mask=(cols[:, None] < KP) & (h[None, :] < HIDX))
        else:
            for k in tl.static_range(KP):
                best = tl.max(keys, axis=0)
                tl.store(out + k, best, mask=h < HIDX)
                keys = tl.where(keys == best[None, :], -9223372036854775807, keys)


# Runtime counts that change from step to step are not specialised (as 1 or 16-divisible), and
# the tile rows (views at any offset of the planner's buffer) not on alignment: one build
# serves every prefill step, so none compiles mid-serving.
@triton.jit(do_not_specialize=["T", "NC"], do_not_specialize_on_alignment=["tiles_ptr"])
def _partial_kernel(
    iq_ptr, stride_iq_t, stride_iq_h,
    ik_ptr, stride_ik_p, stride_ik_s,
    bt_ptr, stride_bt, table_rows_ptr, token_seq_ptr, pos_ptr, slot_ptr,
    part_ptr, T, page_size, NC, tiles_ptr,
    HIDX: tl.constexpr, DI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, KP: tl.constexpr,
    DOT_F32: tl.constexpr, TILED: tl.constexpr = False, FULL_PAGE: tl.constexpr = False,
    FP8_DOT: tl.constexpr = False, HP: tl.constexpr = 16,
):
    """Program ``(tile, c)``: the candidates of a tile's rows in chunk ``c``. A ``TILED`` tile
    of one row takes the one-token form (:func:`_row_candidates`, ``HP`` its padded heads), so
    a step's one-token requests run in the same launch as its multi-token tiles rather than
    after them (a serial tail: 20 us at 64K for 3 decodes on the H200)."""
    tile = tl.program_id(0)
    c = tl.program_id(1)
    if TILED:  # an explicit (start, end) row range per program, end - start <= BLOCK_T
        t_lo = tl.load(tiles_ptr + 2 * tile).to(tl.int32)
        t_hi = tl.load(tiles_ptr + 2 * tile + 1).to(tl.int32)
        if t_hi - t_lo == 1:
            _row_candidates(iq_ptr, stride_iq_t, stride_iq_h, ik_ptr, stride_ik_p, stride_ik_s, bt_ptr, stride_bt,
                            table_rows_ptr, token_seq_ptr, pos_ptr, slot_ptr, part_ptr, page_size, NC, t_lo, c,
                            HIDX, DI, HP, BLOCK_N, BLOCK_D, CHUNK, KP, DOT_F32, FP8_DOT)
        else:
            _tile_candidates(iq_ptr, stride_iq_t, stride_iq_h, ik_ptr, stride_ik_p, stride_ik_s, bt_ptr, stride_bt,
                             table_rows_ptr, token_seq_ptr, pos_ptr, slot_ptr, part_ptr, page_size, NC, t_lo, t_hi,
                             c, HIDX, DI, BLOCK_T, BLOCK_M, BLOCK_N, BLOCK_D, CHUNK, KP, DOT_F32, FULL_PAGE, FP8_DOT)
    else:
        _tile_candidates(iq_ptr, stride_iq_t, stride_iq_h, ik_ptr, stride_ik_p, stride_ik_s, bt_ptr, stride_bt,
                         table_rows_ptr, token_seq_ptr, pos_ptr, slot_ptr, part_ptr, page_size, NC, tile * BLOCK_T,
                         T, c, HIDX, DI, BLOCK_T, BLOCK_M, BLOCK_N, BLOCK_D, CHUNK, KP, DOT_F32, FULL_PAGE, FP8_DOT)


# The chunk count is a runtime value (any context: one build).
@triton.jit(do_not_specialize=["NC"])
def _row_partial_kernel(
    iq_ptr, stride_iq_t, stride_iq_h,
    ik_ptr, stride_ik_p, stride_ik_s,
    bt_ptr, stride_bt, table_rows_ptr, token_seq_ptr, pos_ptr, slot_ptr,
    part_ptr, page_size, NC, out_ptr, stride_out_h, stride_out_t, count_ptr,
    HIDX: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr, KP: tl.constexpr, DOT_F32: tl.constexpr, FP8_DOT: tl.constexpr,
    MERGE_LAST: tl.constexpr = False, BLOCK_C: tl.constexpr = 16, TOPK: tl.constexpr = 16,
    TOPK_PAD: tl.constexpr = 16, BLOCK_R: tl.constexpr = 16, PDL: tl.constexpr = 0, STRIDED: tl.constexpr = False,
):
    """``_partial_kernel`` for one token per program (decode rows): program ``(i, c)`` is token
    ``i`` in chunk ``c`` (:func:`_row_candidates`, ``STRIDED`` chunks or consecutive ones).
    ``MERGE_LAST``: the last of a row's chunk programs to finish merges the row (``arrival``:
    the chunks that ran count, :func:`_chunks_run`; a padded row's selection is written by its
    chunk 0), with no merge launch after."""
    grid_dependency(PDL)
    tok = tl.program_id(0)
    c = tl.program_id(1)
    _row_candidates(iq_ptr, stride_iq_t, stride_iq_h, ik_ptr, stride_ik_p, stride_ik_s, bt_ptr, stride_bt,
                    table_rows_ptr, token_seq_ptr, pos_ptr, slot_ptr, part_ptr, page_size, NC, tok, c,
                    HIDX, DI, HP, BLOCK_N, BLOCK_D, CHUNK, KP, DOT_F32, FP8_DOT, STRIDED)
    if MERGE_LAST:
        slot = tl.load(slot_ptr + tok)
        local = tl.load(pos_ptr + tok).to(tl.int32) // page_size
        if slot >= 0:
            n_run = _chunks_run(local, NC, CHUNK, _strided(local, NC, CHUNK, STRIDED))
            if c < n_run:
                if arrive(count_ptr + tok, n_run):
                    for h in tl.static_range(HIDX):
                        _merge_row(part_ptr, out_ptr, stride_out_h, stride_out_t, tok, h, slot, local, NC, HIDX,
                                   BLOCK_C, BLOCK_R, TOPK, TOPK_PAD, CHUNK, KP, STRIDED)
        elif c == 0:
            for h in tl.static_range(HIDX):
                _merge_row(part_ptr, out_ptr, stride_out_h, stride_out_t, tok, h, slot, local, NC, HIDX,
                           BLOCK_C, BLOCK_R, TOPK, TOPK_PAD, CHUNK, KP, STRIDED)


@triton.jit
def _top_keys(keys, n, kk, TOPK_PAD: tl.constexpr):
    """The ``n`` largest of ``keys`` (distinct), descending, in a ``[TOPK_PAD]`` list padded
    with the no-key value."""
    top = tl.full([TOPK_PAD], -9223372036854775807, tl.int64)
    for i in range(n):
        best = tl.max(keys, axis=0)
        top = tl.where(kk == i, best, top)
        keys = tl.where(keys == best, -9223372036854775807, keys)
    return top


@triton.jit
def _merge_tops(a, b, n, kk, TOPK_PAD: tl.constexpr):
    """The ``n`` largest of two ``[TOPK_PAD]`` top lists (their keys distinct), descending."""
    top = tl.full([TOPK_PAD], -9223372036854775807, tl.int64)
    for i in range(n):
        best = tl.maximum(tl.max(a, axis=0), tl.max(b, axis=0))
        top = tl.where(kk == i, best, top)
        a = tl.where(a == best, -9223372036854775807, a)
        b = tl.where(b == best, -9223372036854775807, b)
    return top


@triton.jit
def _rank_top_keys(keys, n, kk, TOPK_PAD: tl.constexpr):
    """:func:`_top_keys` of ``keys`` (``[C]``, real keys distinct) by rank: a key's place in the
    list is the count of keys above it, from one ``[C, C]`` comparison. Two reductions in place
    of ``n`` rounds of max, each round a chain of shuffles (and, across warps, a shared-memory
    round trip); the comparison is ``C * C / threads`` compares a thread, so it is for short
    pieces. The no-key entries all count the real keys above them: their places are past the
    real keys', where only the no-key value goes."""
    place = tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), axis=1)
    hit = (place[:, None] == kk[None, :]) & (kk[None, :] < n)
    return tl.max(tl.where(hit, keys[:, None], -9223372036854775807), axis=0)


@triton.jit
def _load_candidates(row, i, n, by_block, NC, KP: tl.constexpr):
    """A row's candidates ``i`` (the no-key value from ``n`` on) from its ``NC * KP`` slots at
    ``row``: block ``i``'s key, entry ``i // NC`` of strided chunk ``i % NC`` (``by_block``), else
    slot ``i``. Read through L2 (``.cg``): a partial program that merges (``arrival``) reads
    what programs on other SMs have just written."""
    return tl.load(row + tl.where(by_block, (i % NC) * KP + i // NC, i), mask=i < n, other=-9223372036854775807,
                   cache_modifier=".cg")


@triton.jit
def _merge_row(part_ptr, out_ptr, stride_out_h, stride_out_t, t, h, slot, local, NC,
               HIDX: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, TOPK: tl.constexpr,
               TOPK_PAD: tl.constexpr, CHUNK: tl.constexpr, KP: tl.constexpr, STRIDED: tl.constexpr = False):
    """Row ``t``'s selection for head ``h``: the best ``TOPK - 1`` of the candidates its chunks
    wrote (``KP`` a chunk, ``NC`` chunks: a runtime count, so one build serves every context
    length; strided chunks where :func:`_strided` says) and its local block. Strided
    chunks that each hold at most ``KP`` blocks stored every block's key as it is, block ``b``
    as entry ``b // NC`` of chunk ``b % NC``: the candidates are then the row's ``local``
    scored blocks, read there (not the ``KP`` slots of every chunk, mostly empty at a short
    context in a wide table). The candidates are ranked in one piece when ``BLOCK_R`` holds
    them (:func:`_rank_top_keys`), else streamed in pieces of ``BLOCK_C``, each piece's best by
    rounds of max merged into the running list. The same keys every way. A padded row (``slot
    < 0``) gets ``-1`` throughout."""
    ok = slot >= 0
    n_other = tl.where(ok, tl.minimum(local, TOPK - 1), -1)  # non-local blocks to pick
    kk = tl.arange(0, TOPK_PAD)
    row = part_ptr + (t.to(tl.int64) * HIDX + h) * NC * KP
    strided = _strided(local, NC, CHUNK, STRIDED)
    # strided chunks that all stored their blocks' keys: read by block (else the slots in order)
    by_block = ok & strided & (tl.cdiv(local, NC) <= KP)
    n_cand = tl.where(by_block, local, tl.where(ok, _chunks_run(local, NC, CHUNK, strided) * KP, 0))
    if n_cand <= BLOCK_R:
        cr = tl.arange(0, BLOCK_R)
        best = _rank_top_keys(_load_candidates(row, cr, n_cand, by_block, NC, KP), n_other, kk, TOPK_PAD)
    else:
        ci = tl.arange(0, BLOCK_C)
        best = _top_keys(_load_candidates(row, ci, n_cand, by_block, NC, KP), n_other, kk, TOPK_PAD)
        for c0 in range(BLOCK_C, n_cand, BLOCK_C):
            keys = _load_candidates(row, c0 + ci, n_cand, by_block, NC, KP)
            best = _merge_tops(best, _top_keys(keys, n_other, kk, TOPK_PAD), n_other, kk, TOPK_PAD)
    res = tl.where((kk < n_other) & (best > -9223372036854775807), 0x7FFFFFFF - best.to(tl.int32), -1)
    res = tl.where(kk == n_other, local, res)
    tl.store(out_ptr + h * stride_out_h + t.to(tl.int64) * stride_out_t + kk, res, mask=kk < TOPK)
    return res


@triton.jit(do_not_specialize=["NC", "NB", "NCAP"])
def _merge_kernel(
    part_ptr, pos_ptr, slot_ptr, out_ptr, stride_out_h, stride_out_t, page_size, NC,
    token_seq_ptr, req_ptr, stride_req, counts_ptr, pairs_ptr, plse_ptr, tiles_ptr, NB, NCAP,
    HIDX: tl.constexpr, BLOCK_C: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
    CHUNK: tl.constexpr, KP: tl.constexpr, BUCKET: tl.constexpr = False, G: tl.constexpr = 1,
    PAIRS: tl.constexpr = 1, BLOCK_R: tl.constexpr = 16, STRIDED: tl.constexpr = False,
):
    """Program ``(t, h)``: :func:`_merge_row` of row ``t``, head ``h``; with ``BUCKET`` the
    row's pairs then go into block-major attention's buckets (``sparse_blocks.bucket_rows``,
    head ``h`` = kv group; the arguments from ``token_seq_ptr`` on are ``BucketSpace.kernel_args``),
    which saves that attention its bucketing launch."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    res = _merge_row(part_ptr, out_ptr, stride_out_h, stride_out_t, t, h, slot,
                     tl.load(pos_ptr + t).to(tl.int32) // page_size, NC, HIDX, BLOCK_C, BLOCK_R, TOPK, TOPK_PAD,
                     CHUNK, KP, STRIDED)
    if BUCKET:
        one = tl.zeros([1], tl.int32)
        bucket_rows(res[None, :], t + one, (slot + one) >= 0, tl.arange(0, TOPK_PAD), h, token_seq_ptr, req_ptr,
                     stride_req, counts_ptr, pairs_ptr, plse_ptr, tiles_ptr, NB, NCAP, HIDX, G, TOPK, PAIRS)


def _check(iq: Tensor, index_k_l: Tensor, out: Tensor, topk: int, page_size: int, T: int) -> None:
    if iq.dim() != 3 or iq.stride(2) != 1 or index_k_l.dim() != 3 or index_k_l.stride(2) != 1:
        raise ValueError(f"need iq [T, H, Di] and index_k_l [P, page, Di] with contiguous rows; got "
                         f"{tuple(iq.shape)}, {tuple(index_k_l.shape)}")
    if iq.shape[2] != index_k_l.shape[2] or index_k_l.shape[1] != page_size:
        raise ValueError(f"index dims differ or page size mismatch: iq {tuple(iq.shape)}, "
                         f"index_k_l {tuple(index_k_l.shape)}, page_size {page_size}")
    if topk < 1 or out.dtype != torch.int32 or out.dim() != 3 or out.shape[0] != iq.shape[1] \
            or out.shape[1] < T or out.shape[2] != topk or out.stride(2) != 1:
        raise ValueError(f"out must be int32 [H={iq.shape[1]}, >= {T}, topk={topk}] with topk >= 1, "
                         f"got {out.dtype} {tuple(out.shape)}")


#: Candidates the merge ranks in one piece (``_rank_top_keys``): a row with no more written
#: candidates takes its best from one ``[C, C]`` comparison instead of ``topk - 1`` rounds of
#: max. H200, 1-warp merge of a 1024-token chunk's rows at 3K context (24 candidates a row):
#: 7.0 us by rounds of max, 2.3 / 3.3 / 7.5 us ranked in pieces of 32 / 64 / 128; ranked in
#: pieces of 64 at 64K / 128K (512 / 1024 candidates, the pieces' lists merged by rank): 21.6 /
#: 42.9 us against 7.8 / 16.3, so longer rows keep the rounds of max.
RANK_PIECE = 64


def merge_piece(num_candidates: int, stable: bool) -> int:
    """Candidates a merge by rounds of max selects from at a time (rows longer than
    ``RANK_PIECE``): ``stable`` (a prefill, whose candidate count grows with the context) a
    fixed 512, so one build serves every length; otherwise (decode graphs, a fixed count per
    graph) all of them in one piece, up to 512.

    A piece costs ``topk - 1`` max-passes, and merging it into the running list as many again
    over two short lists, each pass a chain of warp shuffles: the passes, not the candidates
    a lane holds, set the time, so few large pieces beat many small ones (a 1024-token chunk
    at 128K context has 1024 candidates per row: 8 pieces of 128 took 38 us on the H200)."""
    return 512 if stable else min(512, max(16, next_pow2(num_candidates)))


def row_heads(num_index_heads: int, fp8_dot: bool) -> int:
    """The one-token form's padded head count ``HP``: its dot has ``HP`` columns, or ``2 * HP``
    with fp8 keys (each head's two query parts), and ``tl.dot`` needs at least 16."""
    return pad_dim(num_index_heads, 8 if fp8_dot else 16)


# The one-token partial kernel's warps and pipeline depth: one warpgroup (a 128-key block is two
# of wgmma's 64-row steps), three loads in flight. Measured on the H200 (decode 32 at 128K, fp8
# keys): 4 stages or 8 warps no faster; two or four blocks per loop step (one 256- or 512-row
# dot) 13-50% slower.
ROW_CONFIG = {"num_warps": 4, "num_stages": 3}

# Pipeline stages of the multi-token partial programs: two key tiles in flight while one is
# scored (a 64-row program then holds 113 KB of shared memory and 255 registers a thread, two
# to an SM). Measured on the H100 (1024-token chunk + 3 decodes at 64K): 2 / 3 / 4 stages 85.1
# / 73.7 / 100.4 us. Three or four programs an SM (half-page key steps, a register cap of 128
# or 168) were no faster: 71.2-97.4 us at 64K, 125.9-178.8 at 128K (3 stages: 134.9).
TILE_STAGES = 3


def _launch(iq: Tensor, index_k_l: Tensor, meta: AttentionMetadata, out: Tensor, topk: int, T: int,
            num_blocks: int, block_t: int, chunk: int, tiles: Tensor | None = None, keep_all: bool = False,
            merge_last: bool = True, buckets: BucketSpace | None = None) -> None:
    """Run both kernels for rows ``< T`` with ``num_blocks`` key blocks of capacity per row.

    The partial kernel runs the fixed grid of ``cdiv(T, block_t)`` token tiles (one token per
    program: ``_row_partial_kernel``, whose last chunk program of a row merges it unless
    ``merge_last=False``), or with ``tiles`` (``int32 [n, 2]``, checked by the caller) one
    program per ``(start, end)`` row range, one-row ranges in the one-token form; the tiles
    must cover every row ``< T``: the merge reads every row's candidates.
    ``keep_all``: the partial kernel keeps every block of its chunk as a candidate
    (``KP = chunk``, no partial selection: small chunks at long context).
    ``buckets``: the merge launch also buckets each row's pairs for block-major attention.
    """
    check_device("index top-k", iq, index_k_l, out, *([] if tiles is None else [tiles]))
    if chunk < 1 or chunk & (chunk - 1) or block_t < 1:
        raise ValueError(f"chunk must be a power of two and block_t >= 1, got chunk={chunk}, block_t={block_t}")
    programs = triton.cdiv(T, block_t) if tiles is None else tiles.shape[0]
    if T == 0 or programs == 0:
        return
    buf, H, Di = meta.buffers, iq.shape[1], iq.shape[2]
    nc = triton.cdiv(max(num_blocks, 1), chunk)
    kp = chunk if keep_all else max(1, min(topk - 1, chunk))
    part = torch.empty((T, H, nc, kp), dtype=torch.int64, device=iq.device)
    # fp32 dots: the interpreter's bf16 dot is wrong, and fp32 inputs should not drop to tf32
    dot_f32 = interpreting() or iq.dtype == torch.float32
    fp8_dot = not dot_f32 and index_k_l.dtype == torch.float8_e4m3fn
    common = dict(HIDX=H, DI=Di, BLOCK_N=pad_dim(meta.page_size), BLOCK_D=pad_dim(Di), CHUNK=chunk, KP=kp,
                  DOT_F32=dot_f32, FP8_DOT=fp8_dot)
    args = (iq, iq.stride(0), iq.stride(1), index_k_l, index_k_l.stride(0), index_k_l.stride(1),
            meta.block_tables, meta.block_tables.stride(0), buf.table_rows, buf.token_seq, buf.positions,
            buf.slot_mapping, part)
    merge = dict(BLOCK_C=merge_piece(nc * kp, stable=keep_all), BLOCK_R=RANK_PIECE, TOPK=topk,
                 TOPK_PAD=max(2, next_pow2(topk)))
    one_token = tiles is None and block_t == 1
    merge_last = merge_last and one_token
    if one_token:  # one token per program: its keys are the dot's rows; a short row's chunks strided
        counts = arrival_counters(iq.device, T) if merge_last else part  # unread without MERGE_LAST
        _row_partial_kernel[(programs, nc)](*args, meta.page_size, nc, out, out.stride(0), out.stride(1), counts,
                                             HP=row_heads(H, fp8_dot), **common, MERGE_LAST=merge_last, **merge,
                                             STRIDED=True, **ROW_CONFIG, **pdl_launch(iq.device))
    else:
        # fp8 dots take Hopper's wgmma only from 64 rows (below it Triton widens both sides
        # to f16 for mma.sync, the conversion fp8 is meant to avoid): pad the tile to 64.
        block_m = pad_dim(block_t * H, 64 if fp8_dot else 16)
        _partial_kernel[(programs, nc)](
            *args, T, meta.page_size, nc, buf.token_seq if tiles is None else tiles, BLOCK_T=block_t,
            BLOCK_M=block_m, TILED=tiles is not None, FULL_PAGE=meta.page_size == pad_dim(meta.page_size),
            HP=row_heads(H, fp8_dot), **common, num_warps=4 if block_m <= 64 else 8, num_stages=TILE_STAGES,
        )
    assert buckets is None or not merge_last, "bucketing runs in the merge launch"
    if not merge_last:
        if buckets is None:  # unread: BUCKET is off
            bucket_args, bucket = (part, part, 0, part, part, part, part, 0, 0), {}
        else:
            bucket_args = buckets.kernel_args(meta)
            bucket = dict(BUCKET=True, G=buckets.group, PAIRS=buckets.pairs_per_item)
        _merge_kernel[(T, H)](part, buf.positions, buf.slot_mapping, out, out.stride(0), out.stride(1), meta.page_size,
                              nc, *bucket_args, HIDX=H, CHUNK=chunk, KP=kp, **merge, **bucket, STRIDED=one_token,
                              num_warps=1)


def decode_chunk(num_tokens: int, num_blocks: int, device: torch.device, key_bytes: int = 2) -> int:
    """Key blocks per decode program: enough programs to stream index-K at full bandwidth for
    small batches, fewer and longer ones for large batches. Shape-only.

    The programs wanted are about as many as fit on the GPU at once: ~2 per SM for 2-byte keys,
    twice that for fp8 (a program's shared memory holds its pages in flight, half the bytes).
    One more than fit costs a second, mostly empty wave (on the H200, 128K context, 32 rows of
    bf16 keys: 512 programs 333 us, 256 programs 277 us)."""
    want_programs = 2 * num_sms(device) * max(1, 2 // key_bytes)
    per_row = triton.cdiv(want_programs, max(num_tokens, 1))
    return min(128, max(4, next_pow2(triton.cdiv(max(num_blocks, 1), per_row))))


def index_topk_decode(iq: Tensor, index_k_l: Tensor, meta: AttentionMetadata, topk: int, out: Tensor,
                      chunk: int | None = None, merge_last: bool = True) -> None:
    """Graph-safe per-group top-k for one query row per entry of ``iq`` (decode, spec decode).

    Every row of ``iq`` is processed, with its position, sequence and slot read from the
    metadata's persistent device buffers (rows past the real tokens hold pad values and get
    ``-1``); the grid depends only on ``iq.shape[0]`` and the block-table width.

    Args:
        iq: ``[T, H, Di]`` index queries (post norm and RoPE), H = num kv groups.
        index_k_l: ``[num_pages, page_size, Di]`` one sparse layer of the index-K cache.
        meta: this step's metadata (only device buffers, block tables and page size are read).
        topk: blocks per (group, token).
        out: ``int32 [H, >= T, topk]``; columns ``< T`` are written.
        chunk: key blocks per program (power of two); default from :func:`decode_chunk`.
        merge_last: the last chunk program of a row merges it (no merge launch); ``False``: the
            merge kernel after (the same selections; for comparisons).
    """
    T = iq.shape[0]
    _check(iq, index_k_l, out, topk, meta.page_size, T)
    cap = meta.block_tables.shape[1]
    chunk = chunk or decode_chunk(T, cap, iq.device, index_k_l.element_size())
    _launch(iq, index_k_l, meta, out, topk, T, cap, 1, chunk, merge_last=merge_last)


def default_block_t(num_index_heads: int) -> int:
    """Prefill tokens per program: fill a 64-row ``tl.dot`` tile (at most 16 tokens)."""
    return max(1, min(16, 64 // num_index_heads))


def index_topk_prefill(iq: Tensor, index_k_l: Tensor, meta: AttentionMetadata, topk: int, out: Tensor,
                       block_t: int | None = None, chunk: int | None = None, tiles: Tensor | None = None) -> None:
    """Per-group top-k for the step's real tokens (prefill chunks and mixed batches).

    Uses host metadata (``num_tokens``, ``max_kv_len``) to size the grid, so it is not
    graph-safe. Same arguments as :func:`index_topk_decode`; columns ``< meta.num_tokens``
    of ``out`` are written.

    Args:
        block_t: tokens per program (their rows share each loaded index-K tile); default
            :func:`default_block_t` (fills a 64-row ``tl.dot`` tile).
        chunk: key blocks per program; default 64 (128 past 2048 blocks, keeping the merge's
            candidate list short), or with ``tiles`` :func:`decode_chunk` of the tile count
            (a short tile list needs more, smaller chunks to fill the GPU).
        tiles: optional ``int32 [n, 2]`` contiguous ``(start, end)`` token rows, one program
            each (``end - start <= block_t``) in place of the fixed ``cdiv(T, block_t)`` grid,
            e.g. :class:`attention.kernels.tiles.StepTiles` rows, which never straddle
            requests. They must cover every row ``< meta.num_tokens`` (uncovered rows get
            undefined selections).
    """
    T = meta.num_tokens
    _check(iq, index_k_l, out, topk, meta.page_size, T)
    if iq.shape[0] < T:
        raise ValueError(f"iq has {iq.shape[0]} rows but the step has {T} tokens")
    num_blocks = triton.cdiv(meta.max_kv_len, meta.page_size)
    if block_t is None:
        block_t = default_block_t(iq.shape[1])
    if tiles is not None:
        check_tile_rows(tiles, block_t, T)
        chunk = chunk or decode_chunk(tiles.shape[0], num_blocks, iq.device, index_k_l.element_size())
    if chunk is None:
        chunk = 64 if num_blocks <= 2048 else 128
    _launch(iq, index_k_l, meta, out, topk, T, num_blocks, block_t, chunk, tiles)


def tile_block_t(num_index_heads: int) -> int:
    """Tokens per request-aligned prefill tile: 64 rows of ``tl.dot`` (tokens x index heads).

    Each tile streams the whole index-K of its request, but the tiles of one chunk of key
    blocks run side by side (the grid's fast axis), so all but the first read it from L2: what
    counts is how full the SMs are. A 128-row program needs 255 registers a thread (one per
    SM); two 64-row ones fit. On the H200 (a 1024-token chunk + 3 decodes, bf16 index-K,
    graph replay), 64 / 128 / 256-row tiles: 44.0 / 47.5 / 56.4 us at 3K context, 93.5 / 102.6
    / 88.2 us at 64K, 161.2 / 179.8 / 151.2 us at 128K."""
    return max(1, 64 // num_index_heads)


# Key blocks per partial program of a tiled prefill: every block of the chunk is kept as a
# candidate (no partial selection), and the chunk is fixed, so one build serves every context.
TILED_CHUNK = 8


def index_topk_prefill_tiled(iq: Tensor, index_k_l: Tensor, meta: AttentionMetadata, topk: int, out: Tensor,
                             tiles: StepTiles, chunk: int | None = None,
                             buckets: BucketSpace | None = None) -> BlockBuckets | None:
    """:func:`index_topk_prefill` over a step's request-aligned tiles (same outputs).

    The multi-token requests' tiles run ``tiles.block_t`` tokens per program (plan them with
    :func:`tile_block_t`), sharing every index-K tile they load; the one-token requests' tiles
    run in the same launch in the one-token form (a one-row program in a 64-row tile would
    multiply 63 empty rows per block). Every block of a partial program's chunk
    (:data:`TILED_CHUNK`) is kept as a candidate, and one merge over all rows streams them:
    at long context the partial selection's ``topk - 1`` passes over ``[rows, chunk]`` keys
    cost more than the dots, and fixed sizes mean no new build as contexts grow.

    Args:
        iq, index_k_l, meta, topk, out: as :func:`index_topk_prefill`.
        tiles: this step's :class:`StepTiles` (planned from ``meta.qo_indptr_host``).
        chunk: key blocks per program (power of two); default :data:`TILED_CHUNK`.
        buckets: block-major attention's scratch for this step
            (``sparse_blocks.bucket_space``): the merge launch also buckets each row's pairs
            there, and the result goes to ``sparse_attention_prefill_blocks(buckets=...)``, which
            then skips its bucketing launch (H100, a 1024-token chunk at 64K: about 5 us of a
            launch of its own).

    Returns:
        The filled buckets (``out`` is their selection) where ``buckets`` was given, else None.

    Raises:
        ValueError: as :func:`index_topk_prefill`, ``tiles`` planned for another token count, or
            ``buckets`` planned for another step or another number of kv heads.
    """
    T = meta.num_tokens
    _check(iq, index_k_l, out, topk, meta.page_size, T)
    if iq.shape[0] < T:
        raise ValueError(f"iq has {iq.shape[0]} rows but the step has {T} tokens")
    if not isinstance(tiles, StepTiles) or tiles.num_tokens != T:
        raise ValueError(f"tiles must be the StepTiles of this step ({T} tokens), got "
                         f"{getattr(tiles, 'num_tokens', type(tiles))} tokens")
    bt = tiles.block_t
    check_tile_rows(tiles.rows, bt, T)
    if buckets is not None and (buckets.plan.num_tokens != T or buckets.num_kv_heads != iq.shape[1]
                                or buckets.topk != topk):
        raise ValueError(f"buckets were made for {buckets.plan.num_tokens} tokens, {buckets.num_kv_heads} kv heads "
                         f"and top-{buckets.topk}; this step has {T} tokens, {iq.shape[1]} index heads and top-{topk}")
    num_blocks = triton.cdiv(meta.max_kv_len, meta.page_size)
    _launch(iq, index_k_l, meta, out, topk, T, num_blocks, bt, chunk or TILED_CHUNK, tiles.rows, keep_all=True,
            buckets=buckets)
    return None if buckets is None else BlockBuckets(buckets, out)


__all__ = ["TILED_CHUNK", "decode_chunk", "default_block_t", "index_topk_decode", "index_topk_prefill",
           "index_topk_prefill_tiled", "merge_piece", "row_heads", "tile_block_t", "ROW_CONFIG", "TILE_STAGES"]
