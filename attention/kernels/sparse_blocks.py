"""Block-major sparse prefill attention: one program per tile of the queries that selected a
key block, each block's K and V read once a tile.

The per-token kernel (``sparse._attn_kernel`` at one token per program) reads each token's
16 selected blocks itself: for a 1024-token chunk at 64K that is ~1 GB of K/V through L2 for
~32 MB of distinct blocks, in 16-row dots of which 8 rows are real. Token tiles over the union
of their selections (``sparse_attention_prefill_tiled``) only help where neighbouring tokens
select the same blocks. Here the work is turned around, as a fused MoE turns tokens into
per-expert rows: the (token, selection slot) pairs are bucketed by key block, and one program
loads its block's K and V once and runs up to ``TILES_PER_PROGRAM`` tiles of its bucket's pairs
(``BLOCK_M`` rows each: pairs x the group's q heads) against them, whatever the selections look
like.

Three launches per layer (plus the zeroed bucket counters, :class:`BucketSpace`):
1. Bucketing (:func:`bucket_rows`): each valid pair ``(t, j)`` of kv group ``g`` takes a
   place in the bucket of ``(g, request, block)`` with an atomic counter and writes its code
   ``t * TOPK + j`` there (the order inside a bucket varies from run to run; every pair's
   result does not depend on it), and every ``PAIRS``-th pair of a bucket opens a work item;
   slots with no block, or a block past the request's keys, get a ``-inf`` log-sum-exp (so a bad
   selection can never reach another request's bucket, hence its cache pages). Run by the
   indexer's merge as it writes each row's selection (the Triton backend's path:
   ``index_topk_prefill_tiled(buckets=...)``), or by ``_bucket_pairs_kernel`` over tokens
   (:func:`bucket_pairs`). H100, a 1024-token chunk at 64K: the merge's bucketing costs ~3.5
   us against ~5.8 for the launch of its own.
2. ``_block_attn_kernel`` over the work items opened (up to ``TILES_PER_PROGRAM`` tiles each):
   softmax over the block's visible keys for each pair's q heads (causal mask only bites in a
   token's own local block), the normalised partial output and its log2-sum-exp into the
   slot's row of ``[T, Hq, TOPK]`` partials.
3. ``sparse.merge_splits`` with ``NSPLIT = TOPK``: the exact softmax over the token's blocks.

Bucket storage is per request: request ``s`` with ``q_s`` query tokens and ``n_s`` key blocks
owns ``n_s * q_s`` places per kv group (a token selects a block at most once), so a step needs
``Hkv * sum_s n_s * q_s`` ints, planned on the host per step by :class:`BlockPlanner` from the
metadata's host copies (no device sync, no per-layer host work). Not graph-safe (grids from
host values): prefill steps only, like the other prefill kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from attention.kernels.sparse import _LOG2E, _check, _check_sel, merge_splits
from attention.kernels.triton_utils import check_device, interpreting, next_pow2, pad_dim
from attention.metadata import AttentionMetadata
from attention.staging import PingPongStaging

Tensor = torch.Tensor

# Rows of one tile (pairs x q heads of the group): one warpgroup's wgmma M. (128 rows, two
# warpgroups, read each block's K and V half as often but measured slower on the H100: 141 vs
# 128 us, a 1024-token chunk at 64K.)
BLOCK_M = 64
# Tiles one block program runs (its block's K and V loaded once for all of them, the tiles'
# query loads pipelined over two stages); a bucket opens a program per
# TILES_PER_PROGRAM * BLOCK_M // G pairs. H100, 1024-token chunk + 3 decodes at 64K, random
# selections, graph replay: 1 / 2 / 4 / 8 tiles a program 115.0 / 101.2 / 96.6 / 98.9 us.
TILES_PER_PROGRAM = 4
# The block kernel's launch.
ATTN_CONFIG = {"num_warps": 4, "num_stages": 2}
# The partial outputs' dtype by the queries' dtype (fp32 otherwise). bf16 queries keep their
# normalised partials in bf16: half the bytes through the merge, for one more bf16 rounding of
# values the output is rounded to anyway (H100, 1024-token chunk at 64K on random selections:
# 127 vs 164 us, error against the per-token kernel 3.3e-3 vs 2.7e-3; the log-sum-exps stay fp32).
PARTIALS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.bfloat16}
# Tokens one bucketing program takes (x the selection's width: one pair a thread at 8 x 16 over
# 4 warps): a 1024-token chunk makes ~130 programs (at 64 tokens, 17 programs ran the step's
# atomics nearly serially: the whole block-major attention 130.8 vs 115.0 us, H100 at 64K).
BUCKET_TOKENS = 8
# Rows of a plan's per-request table (:class:`BlockPlan` ``req``).
ROWS = 4


@triton.jit
def bucket_rows(
    sel, t, t_ok, kk, g, token_seq_ptr, req_ptr, stride_req, counts_ptr, pairs_ptr, plse_ptr, tiles_ptr, NB, NCAP,
    HKV, G: tl.constexpr, TOPK: tl.constexpr, PAIRS: tl.constexpr,
):
    """Bucket kv group ``g``'s pairs of token rows ``t`` (``[R]``, real where ``t_ok``) whose
    selections are ``sel`` (``int32 [R, K_PAD]``, ``kk`` its column ids; see the module
    docstring). ``req`` rows: block base, place base, query tokens and key blocks of each
    request. The pair that takes place ``k * PAIRS`` of a bucket opens the bucket's work item
    ``k`` (``PAIRS``: the pairs one block program runs): it draws an item id from the counter
    after the buckets' (``counts[HKV * NB]``) and writes ``(bucket, k)`` there. Shared by the
    bucketing launch and the indexer's merge (``index_topk_prefill_tiled(buckets=...)``)."""
    s = tl.load(token_seq_ptr + t, mask=t_ok, other=0)
    t64 = t.to(tl.int64)
    in_k = t_ok[:, None] & (kk[None, :] < TOPK)
    ok = in_k & (sel >= 0)
    block_base = tl.load(req_ptr + s, mask=t_ok, other=0)
    place_base = tl.load(req_ptr + stride_req + s, mask=t_ok, other=0).to(tl.int64)
    q_len = tl.load(req_ptr + 2 * stride_req + s, mask=t_ok, other=0).to(tl.int64)
    n_blocks = tl.load(req_ptr + 3 * stride_req + s, mask=t_ok, other=0)
    ok = ok & (sel < n_blocks[:, None])  # a block past the request's keys lands in no bucket
    bucket = g * NB + block_base[:, None] + sel
    at = tl.atomic_add(counts_ptr + bucket, 1, mask=ok)
    # a bucket has a place per query token of its request: only a selection naming a block
    # twice fills it, and its extra pairs are dropped (never written into the next bucket)
    ok = ok & (at < q_len[:, None])
    dest = g.to(tl.int64) * NCAP + place_base[:, None] + sel.to(tl.int64) * q_len[:, None] + at
    tl.store(pairs_ptr + dest, t[:, None] * TOPK + kk[None, :], mask=ok)
    hq = HKV * G
    opens = ok & (at % PAIRS == 0)
    tile = tl.atomic_add(counts_ptr + HKV * NB + tl.zeros_like(at), 1, mask=opens)
    tl.store(tiles_ptr + 2 * tile, bucket, mask=opens)
    tl.store(tiles_ptr + 2 * tile + 1, at // PAIRS, mask=opens)
    for h in tl.static_range(G):  # a slot with no block: nothing to merge
        prow = (t64 * hq + g * G + h) * TOPK
        tl.store(plse_ptr + prow[:, None] + kk[None, :], float("-inf"), mask=in_k & ~ok)


@triton.jit(do_not_specialize=["T", "NB", "NCAP"])
def _bucket_pairs_kernel(
    sel_ptr, stride_sel_h, stride_sel_t, slot_ptr, token_seq_ptr, req_ptr, stride_req,
    counts_ptr, pairs_ptr, plse_ptr, tiles_ptr, NB, NCAP, T,
    G: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, PAIRS: tl.constexpr,
):
    """Program ``(token block, g)``: :func:`bucket_rows` of ``BLOCK_T`` tokens' selections."""
    g = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    kk = tl.arange(0, K_PAD)
    t_ok = t < T
    t_ok = t_ok & (tl.load(slot_ptr + t, mask=t_ok, other=-1) >= 0)
    in_k = t_ok[:, None] & (kk[None, :] < TOPK)
    sel = tl.load(sel_ptr + g * stride_sel_h + t.to(tl.int64)[:, None] * stride_sel_t + kk[None, :], mask=in_k,
                  other=-1)
    bucket_rows(sel, t, t_ok, kk, g, token_seq_ptr, req_ptr, stride_req, counts_ptr, pairs_ptr, plse_ptr, tiles_ptr,
                 NB, NCAP, tl.num_programs(1), G, TOPK, PAIRS)


@triton.jit
def _block_tile(
    p, q_ptr, stride_q_t, stride_q_h,
    k_ptr, v_ptr, stride_k_p, stride_k_s, stride_k_h, stride_v_p, stride_v_s, stride_v_h,
    bt_ptr, stride_bt, table_rows_ptr, pos_ptr, req_ptr, stride_req, bucket_req_ptr,
    counts_ptr, pairs_ptr, tiles_ptr, po_ptr, plse_ptr, HKV, NB, NCAP, page_size, qk_scale,
    G: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, TILES: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Work item ``p`` of the step's buckets: its block's K and V, loaded once, then up to
    ``TILES`` tiles of the bucket's next pairs, ``BLOCK_M // G`` pairs x the group's q heads as
    rows each; partial outputs and log2-sum-exps per pair slot."""
    hq = HKV * G
    fb = tl.load(tiles_ptr + 2 * p)  # g * NB + bucket
    g = fb // NB
    bucket = fb - g * NB
    PAIRS: tl.constexpr = BLOCK_M // G
    i0 = tl.load(tiles_ptr + 2 * p + 1) * (PAIRS * TILES)
    s = tl.load(bucket_req_ptr + bucket)
    b = bucket - tl.load(req_ptr + s)  # the request's logical block
    q_len = tl.load(req_ptr + 2 * stride_req + s)
    # the pairs that found a place (the bucket kernel drops those past the request's tokens)
    n_pairs = tl.minimum(tl.load(counts_ptr + fb), q_len)
    places = pairs_ptr + g.to(tl.int64) * NCAP + tl.load(req_ptr + stride_req + s) + b.to(tl.int64) * q_len
    page = tl.load(bt_ptr + tl.load(table_rows_ptr + s).to(tl.int64) * stride_bt + b).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_M)
    kv_mask = (n[:, None] < page_size) & (d[None, :] < D)
    k = tl.load(k_ptr + g * stride_k_h + page * stride_k_p + n[:, None] * stride_k_s + d[None, :], mask=kv_mask,
                other=0.0)
    v = tl.load(v_ptr + g * stride_v_h + page * stride_v_p + n[:, None] * stride_v_s + d[None, :], mask=kv_mask,
                other=0.0)
    key = b * page_size + n
    head = g * G + r % G
    n_tiles = tl.minimum(tl.cdiv(n_pairs - i0, PAIRS), TILES)
    for it in range(n_tiles):
        i = i0 + it * PAIRS
        p_ok = (r < PAIRS * G) & (i + r // G < n_pairs)
        code = tl.load(places + i + r // G, mask=p_ok, other=0)
        tok = (code // TOPK).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                    mask=p_ok[:, None] & (d[None, :] < D), other=0.0)
        pos = tl.load(pos_ptr + tok, mask=p_ok, other=0).to(tl.int32)
        if DOT_F32:
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
        else:  # an fp8 cache is widened to the queries' dtype (a no-op for a bf16 cache)
            sc = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        vis = p_ok[:, None] & (key[None, :] <= pos[:, None]) & (n[None, :] < page_size)
        sc = tl.where(vis, sc, float("-inf"))
        m = tl.max(sc, axis=1)
        has = m > float("-inf")  # a selected block always holds a visible key; padding rows do not
        m_safe = tl.where(has, m, 0.0)
        e = tl.exp2(sc - m_safe[:, None])
        l_sum = tl.sum(e, axis=1)
        if DOT_F32:
            o = tl.dot(e, v.to(tl.float32), input_precision="ieee")
        else:
            o = tl.dot(e.to(q.dtype), v.to(q.dtype))
        o = o / tl.where(has, l_sum, 1.0)[:, None]
        lse = tl.where(has, m_safe + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
        prow = (tok * hq + head) * TOPK + code % TOPK
        tl.store(po_ptr + prow[:, None] * BLOCK_D + d[None, :], o.to(po_ptr.dtype.element_ty),
                 mask=p_ok[:, None] & (d[None, :] < D))
        tl.store(plse_ptr + prow, lse, mask=p_ok)


@triton.jit(do_not_specialize=["NB", "NCAP"])
def _block_attn_kernel(
    q_ptr, stride_q_t, stride_q_h,
    k_ptr, v_ptr, stride_k_p, stride_k_s, stride_k_h, stride_v_p, stride_v_s, stride_v_h,
    bt_ptr, stride_bt, table_rows_ptr, pos_ptr, req_ptr, stride_req, bucket_req_ptr,
    counts_ptr, pairs_ptr, tiles_ptr, po_ptr, plse_ptr, HKV, NB, NCAP, page_size, qk_scale,
    G: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, TILES: tl.constexpr, DOT_F32: tl.constexpr,
):
    """The work items opened (``counts[HKV * NB]`` of them, see :func:`_block_tile`), one a
    program (programs past the items opened do nothing), so a hot block (every token's local
    block) spreads over many programs, not one long loop. (A persistent grid striding over the
    tiles with the next tile's loads in flight measured slower on the H100: 154 and 133 us at one
    and two programs an SM against 128, a 1024-token chunk at 64K.)"""
    p = tl.program_id(0)
    if p < tl.load(counts_ptr + HKV * NB):
        _block_tile(p, q_ptr, stride_q_t, stride_q_h, k_ptr, v_ptr, stride_k_p, stride_k_s, stride_k_h,
                    stride_v_p, stride_v_s, stride_v_h, bt_ptr, stride_bt, table_rows_ptr, pos_ptr, req_ptr,
                    stride_req, bucket_req_ptr, counts_ptr, pairs_ptr, tiles_ptr, po_ptr, plse_ptr, HKV, NB,
                    NCAP, page_size, qk_scale, G, D, TOPK, BLOCK_M, BLOCK_N, BLOCK_D, TILES, DOT_F32)


@dataclass(frozen=True)
class BlockPlan:
    """One step's buckets on the device: views of a :class:`BlockPlanner`'s buffer.

    Attributes:
        req: ``int32 [4, max_seqs]`` per request: first bucket (block base), first place
            (place base), query tokens and key blocks.
        bucket_req: ``int32 [num_buckets]`` the request of each bucket.
        num_buckets: key blocks of the step's requests, ``sum_s ceil(kv_len_s / page)``.
        num_places: bucket places per kv group, ``sum_s blocks_s * q_len_s``.
        num_tokens: the step's real tokens (to tell another step's plan from this one's).
    """

    req: Tensor
    bucket_req: Tensor
    num_buckets: int
    num_places: int
    num_tokens: int


def plan_buckets(qo_indptr_host: np.ndarray, kv_lens_host: np.ndarray, page_size: int
                 ) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Host plan of a step's buckets: ``(req int64 [4, B], bucket_req int64 [NB], NB, NCAP)``
    (see :class:`BlockPlan`; a request with no query token gets no bucket)."""
    q_len = np.diff(qo_indptr_host.astype(np.int64))
    blocks = np.where(q_len > 0, -(-kv_lens_host.astype(np.int64) // page_size), 0)
    places = blocks * q_len
    req = np.stack([np.cumsum(blocks) - blocks, np.cumsum(places) - places, q_len, blocks])
    return req, np.repeat(np.arange(q_len.size), blocks), int(blocks.sum()), int(places.sum())


class BlockPlanner:
    """Persistent device buffer for :class:`BlockPlan`, written once per step through pinned
    staging (two sets used alternately, like ``TilePlanner``).

    Args:
        max_seqs: request capacity of a step (the metadata builder's).
        max_blocks: key blocks a step can hold, at most ``max_seqs`` x the block-table width.
        device: the kernels' device.
    """

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device | str) -> None:
        if max_seqs < 1 or max_blocks < 1:
            raise ValueError(f"BlockPlanner needs max_seqs, max_blocks >= 1, got {max_seqs}, {max_blocks}")
        self.max_seqs, self.max_blocks, self.device = max_seqs, max_blocks, torch.device(device)
        n = ROWS * max_seqs + max_blocks
        self.buffer = torch.zeros(n, dtype=torch.int32, device=self.device)

        def staging_set(pin: bool) -> tuple[Tensor, np.ndarray]:
            host = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
            return host, host.numpy()

        self._staging = PingPongStaging(staging_set, self.device)

    def plan(self, meta: AttentionMetadata) -> BlockPlan:
        """The buckets of ``meta``'s step, copied into the buffer.

        Raises:
            ValueError: more requests or key blocks than the planner holds.
        """
        req, bucket_req, nb, ncap = plan_buckets(meta.qo_indptr_host.numpy(), meta.kv_lens_host.numpy(),
                                                 meta.page_size)
        B = req.shape[1]
        if B > self.max_seqs or nb > self.max_blocks:
            raise ValueError(f"BlockPlanner: step has {B} requests and {nb} key blocks, the planner holds "
                             f"{self.max_seqs} and {self.max_blocks}")
        S = self.max_seqs
        with self._staging.next_set() as (_, (host, host_np)):
            for i in range(ROWS):
                host_np[i * S : i * S + B] = req[i]
            host_np[ROWS * S : ROWS * S + nb] = bucket_req
            self.buffer[: ROWS * S + nb].copy_(host[: ROWS * S + nb], non_blocking=self._staging.non_blocking)
        return BlockPlan(req=self.buffer[: ROWS * S].view(ROWS, S), bucket_req=self.buffer[ROWS * S : ROWS * S + nb],
                         num_buckets=nb, num_places=ncap, num_tokens=meta.num_tokens)


@dataclass(frozen=True)
class BucketSpace:
    """One layer's scratch for block-major attention, its counters zeroed: where a step's
    (token, slot) pairs are bucketed, by the bucketing launch (:func:`bucket_pairs`) or by the
    indexer's merge (``indexer.index_topk_prefill_tiled(buckets=...)``, one launch fewer).

    Attributes:
        plan: the step's :class:`BlockPlan`.
        counts: ``int32 [Hkv * NB + 1]`` pairs per bucket, then the work items opened.
        pairs: ``int32 [Hkv * NCAP]`` pair codes ``t * topk + j`` by bucket place.
        tiles: ``int32 [2 * max_tiles]`` the work items opened, ``(g * NB + bucket, k)``.
        po: ``[T, Hq, topk, BLOCK_D]`` partial outputs (:data:`PARTIALS`); plse: ``fp32
            [T, Hq, topk]`` their log2-sum-exps.
        num_kv_heads, group: kv heads, q heads per kv head; topk: selection width;
            pairs_per_item: pairs of one work item.
    """

    plan: BlockPlan
    counts: Tensor
    pairs: Tensor
    tiles: Tensor
    po: Tensor
    plse: Tensor
    num_kv_heads: int
    group: int
    topk: int
    pairs_per_item: int

    def kernel_args(self, meta: AttentionMetadata) -> tuple:
        """The arguments :func:`bucket_rows` takes after the selections, from ``token_seq``
        to ``NCAP``, in order."""
        p = self.plan
        return (meta.buffers.token_seq, p.req, p.req.stride(0), self.counts, self.pairs, self.plse, self.tiles,
                p.num_buckets, p.num_places)


@dataclass(frozen=True)
class BlockBuckets:
    """A :class:`BucketSpace` after the pairs of ``selection`` were bucketed into it (made by
    :func:`bucket_pairs` or the indexer's merge, never by hand)."""

    space: BucketSpace
    selection: Tensor


def bucket_space(q: Tensor, num_kv_heads: int, topk: int, plan: BlockPlan) -> BucketSpace:
    """Scratch for ``plan``'s step (zeroed counters: one fill launch).

    Args:
        q: ``[T', Hq, D]`` the step's queries (heads, head size and dtype of the partials).
        num_kv_heads, topk: kv heads of the cache, selections per (group, token).
        plan: this step's :class:`BlockPlan`.

    Raises:
        ValueError: more q heads a kv head than one tile holds.
    """
    T, Hq, D = plan.num_tokens, q.shape[1], q.shape[2]
    G = Hq // num_kv_heads
    if G > BLOCK_M:
        raise ValueError(f"block-major attention holds at most {BLOCK_M} q heads per kv head, got {G}")
    nbt = num_kv_heads * plan.num_buckets
    pairs_per_item = BLOCK_M // G * TILES_PER_PROGRAM
    # work items opened, ceil(count / pairs_per_item) per bucket: at most one per pair, and at
    # most one per pairs_per_item pairs plus one per bucket
    max_pairs = num_kv_heads * T * topk
    max_tiles = max(1, min(max_pairs, max_pairs // pairs_per_item + nbt))
    dev = q.device
    return BucketSpace(
        plan=plan, counts=torch.zeros(nbt + 1, dtype=torch.int32, device=dev),
        pairs=torch.empty(num_kv_heads * plan.num_places, dtype=torch.int32, device=dev),
        tiles=torch.empty(2 * max_tiles, dtype=torch.int32, device=dev),
        po=torch.empty((T, Hq, topk, pad_dim(D)), dtype=PARTIALS.get(q.dtype, torch.float32), device=dev),
        plse=torch.empty((T, Hq, topk), dtype=torch.float32, device=dev), num_kv_heads=num_kv_heads, group=G, topk=topk,
        pairs_per_item=pairs_per_item)


def bucket_pairs(space: BucketSpace, topk_idx: Tensor, meta: AttentionMetadata) -> BlockBuckets:
    """Bucket the step's (token, slot) pairs of ``topk_idx`` (``int32 [Hkv, >= T, topk]``)
    into ``space``: one launch."""
    T, Hkv = space.plan.num_tokens, topk_idx.shape[0]
    if Hkv != space.num_kv_heads or topk_idx.shape[2] != space.topk:
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} does not fit the space ({space.num_kv_heads} kv heads, "
                         f"top-{space.topk})")
    if T > 0:
        _bucket_pairs_kernel[(triton.cdiv(T, BUCKET_TOKENS), Hkv)](
            topk_idx, topk_idx.stride(0), topk_idx.stride(1), meta.buffers.slot_mapping, *space.kernel_args(meta), T,
            G=space.group, TOPK=space.topk, K_PAD=max(2, next_pow2(space.topk)),
            BLOCK_T=BUCKET_TOKENS, PAIRS=space.pairs_per_item, num_warps=4)
    return BlockBuckets(space, topk_idx)


def sparse_attention_prefill_blocks(q: Tensor, k_cache_l: Tensor, v_cache_l: Tensor, topk_idx: Tensor,
                                    meta: AttentionMetadata, out: Tensor, scale: float, plan: BlockPlan,
                                    buckets: BlockBuckets | None = None) -> None:
    """Block-sparse GQA for the step's real tokens, block-major (the module docstring): the
    same outputs as ``sparse.sparse_attention_prefill`` (rows of padded tokens unwritten).

    Args:
        q: ``[T', Hq, D]`` queries (post RoPE), ``T' >= meta.num_tokens``.
        k_cache_l, v_cache_l: ``[P, page, Hkv, D]`` one layer of the cache (bf16 or fp8).
        topk_idx: ``int32 [Hkv, >= T, topk]`` selected logical blocks, distinct per row, -1 pads.
        meta: the step's metadata; out: ``[>= T, Hq, D]``; scale: softmax scale.
        plan: this step's :class:`BlockPlan` (``BlockPlanner.plan(meta)``).
        buckets: ``topk_idx``'s pairs already bucketed (the indexer's merge did it:
            ``index_topk_prefill_tiled(buckets=bucket_space(...))``); ``None``: bucket them here.

    Raises:
        ValueError: shapes or dtypes, ``plan`` made for another step, or ``buckets`` of
            another plan or selection.
    """
    T = meta.num_tokens
    _check(q, k_cache_l, v_cache_l, out, meta.page_size, T)
    Hq, D, Hkv = q.shape[1], q.shape[2], k_cache_l.shape[2]
    _check_sel(topk_idx, Hkv, T)
    if not isinstance(plan, BlockPlan) or plan.num_tokens != T:
        raise ValueError(f"plan must be the BlockPlan of this step ({T} tokens), got "
                         f"{getattr(plan, 'num_tokens', type(plan))} tokens")
    check_device("sparse attention", q, k_cache_l, out, topk_idx, plan.req)
    if T == 0 or plan.num_buckets == 0:
        return
    if buckets is None:
        buckets = bucket_pairs(bucket_space(q, Hkv, topk_idx.shape[2], plan), topk_idx, meta)
    space = buckets.space
    if (space.plan is not plan or buckets.selection.data_ptr() != topk_idx.data_ptr() or space.po.shape[1] != Hq
            or space.num_kv_heads != Hkv):
        raise ValueError("buckets must hold this step's pairs of topk_idx (bucketed with this plan, for these "
                         "q heads); pass buckets=None to bucket them here")
    G, topk = space.group, space.topk
    buf = meta.buffers
    _block_attn_kernel[(space.tiles.shape[0] // 2,)](
        q, q.stride(0), q.stride(1),
        k_cache_l, v_cache_l, k_cache_l.stride(0), k_cache_l.stride(1), k_cache_l.stride(2),
        v_cache_l.stride(0), v_cache_l.stride(1), v_cache_l.stride(2),
        meta.block_tables, meta.block_tables.stride(0), buf.table_rows, buf.positions, plan.req, plan.req.stride(0),
        plan.bucket_req, space.counts, space.pairs, space.tiles, space.po, space.plse, Hkv, plan.num_buckets,
        plan.num_places, meta.page_size, scale * _LOG2E, G=G, D=D, TOPK=topk, BLOCK_M=BLOCK_M,
        BLOCK_N=pad_dim(meta.page_size), BLOCK_D=space.po.shape[3], TILES=TILES_PER_PROGRAM,
        DOT_F32=interpreting() or q.dtype == torch.float32, **ATTN_CONFIG,
    )
    merge_splits(space.po, space.plse, buf.slot_mapping, out, T, Hkv)


__all__ = ["ATTN_CONFIG", "BLOCK_M", "BUCKET_TOKENS", "PARTIALS", "TILES_PER_PROGRAM", "BlockBuckets", "BlockPlan",
           "BlockPlanner", "BucketSpace", "bucket_pairs", "bucket_rows", "bucket_space", "plan_buckets",
           "sparse_attention_prefill_blocks"]
