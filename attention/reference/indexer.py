"""Index scores and per-group top-k block selection: the plain-torch reference (MSA, max score).

For kv group ``g`` and a query at position ``p`` (block size B):
- visible blocks are ``0 .. p // B``;
- ``score(b) = max over keys j <= p in block b of <iq_g(p), ik(j)>`` in fp32, no scale;
- the local block ``p // B`` is always kept, inside the ``topk`` slots;
- the output row holds the local block plus the best ``topk - 1`` other visible blocks,
  valid ids first, the local block as the last valid entry, then ``-1``.
Ties go to the lower block id (stable sort), so the reference is deterministic.
"""

from __future__ import annotations

import torch

from attention.metadata import AttentionMetadata
from attention.reference.dense import acc_dtype, paged_gather
from common.fp8_split import fp8_split_rows


def block_scores(iq: torch.Tensor, ik: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Causal max score of every block.

    Args:
        iq: ``[n, H, Di]`` index queries of one sequence.
        ik: ``[L, Di]`` index keys of that sequence.
        positions: ``int64 [n]`` query positions (all ``< L``).
        block_size: B.
    Returns:
        ``[H, n, ceil(L / B)]``, ``-inf`` for blocks with no visible key.
    """
    length = ik.shape[0]
    nblk = -(-length // block_size)
    s = torch.einsum("nhd,ld->hnl", iq, ik)
    key = torch.arange(nblk * block_size, device=iq.device)
    s = torch.nn.functional.pad(s, (0, nblk * block_size - length))
    s = s.masked_fill((key[None, :] > positions[:, None])[None], float("-inf"))
    return s.view(s.shape[0], s.shape[1], nblk, block_size).amax(dim=-1)


def select_blocks(scores: torch.Tensor, positions: torch.Tensor, topk: int, block_size: int) -> torch.Tensor:
    """Top-k with the local block forced and placed last.

    Args:
        scores: ``[H, n, nblk]`` from ``block_scores``.
        positions: ``int64 [n]``.
    Returns:
        ``int64 [H, n, topk]`` logical block ids, ``-1`` padded.
    """
    h, n, nblk = scores.shape
    local = positions // block_size
    forced = scores.scatter(-1, local[None, :, None].expand(h, n, 1), float("inf"))
    order = torch.sort(forced, dim=-1, descending=True, stable=True).indices  # local block first
    k = min(topk, nblk)
    res = torch.full((h, n, topk), -1, dtype=torch.int64, device=scores.device)
    res[..., : k - 1] = order[..., 1:k]
    nvalid = torch.clamp(local + 1, max=topk)  # visible blocks, capped at topk
    col = torch.arange(topk, device=scores.device)
    res = res.masked_fill((col[None, :] >= (nvalid - 1)[:, None])[None], -1)
    res.scatter_(-1, (nvalid - 1)[None, :, None].expand(h, n, 1), local[None, :, None].expand(h, n, 1))
    return res


def index_topk_ref(
    iq: torch.Tensor,
    index_k_l: torch.Tensor,
    meta: AttentionMetadata,
    topk: int,
    block_size: int,
    out: torch.Tensor,
) -> None:
    """Per-group top-k block ids for every real query token.

    Args:
        iq: ``[T, Hkv, Di]`` index queries (one head per kv group).
        index_k_l: ``[num_pages, page_size, Di]`` one sparse layer of the index-K cache.
        meta: this step's metadata; ``block_size`` must equal its page size.
        topk: blocks per (group, query).
        block_size: sparse block size B.
        out: ``int32 [Hkv, T', topk]`` with ``T' >= meta.num_tokens``; columns of real tokens
            are written, the rest left untouched.
    """
    if block_size != meta.page_size:
        raise ValueError(f"block_size={block_size} must equal the cache page_size={meta.page_size}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if out.shape[0] != iq.shape[1] or out.shape[2] != topk or out.shape[1] < meta.num_tokens:
        raise ValueError(f"out must be [Hkv={iq.shape[1]}, >= {meta.num_tokens}, topk={topk}], got {tuple(out.shape)}")
    acc = acc_dtype(iq.dtype)
    for q0, q1, length, row in meta.requests():
        ik = paged_gather(index_k_l, meta.block_tables, row, length).to(acc)
        pos = torch.arange(length - (q1 - q0), length, device=iq.device)
        scores = block_scores(iq[q0:q1].to(acc), ik, pos, block_size)
        out[:, q0:q1] = select_blocks(scores, pos, topk, block_size).to(out.dtype)


def fp8_query_split(iq: torch.Tensor) -> torch.Tensor:
    """The index queries an fp8 index-K cache is scored with by the Triton kernels, in fp32.

    Each ``(token, head)`` row is scaled by a power of two ``2**e`` (the largest with
    ``amax * 2**e <= 448``) and split into two e4m3 parts, ``hi = e4m3(q * 2**e)`` and
    ``lo = e4m3(q * 2**e - hi)``; the kernels' fp8 dots score ``hi + lo`` (about a bf16's
    8 significant bits). The factor is not undone: a row's scores are only compared with each
    other. Scoring this against the widened cache reproduces the kernels' selection up to the
    dots' accumulation order.

    Args:
        iq: ``[T, H, Di]`` index queries.
    Returns:
        ``float32 [T, H, Di]``, ``hi + lo`` per row.
    """
    hi, lo, _ = fp8_split_rows(iq)
    return hi.float() + lo.float()
