"""Block-sparse GQA over the selected blocks: the plain-torch reference.

For q-head ``h`` in kv group ``g`` and a query at position ``p``, the keys are
``{j <= p : j // B in Sel_g(p)}`` and the softmax over them is exact.
"""

from __future__ import annotations

import torch

from attention.metadata import AttentionMetadata
from attention.reference.dense import acc_dtype, attend, check_heads, paged_gather


def selected_token_mask(sel: torch.Tensor, positions: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Which keys each (group, query) sees.

    Args:
        sel: ``[Hkv, n, topk]`` logical block ids, ``-1`` ignored.
        positions: ``int64 [n]``.
        length: keys in the sequence.
    Returns:
        bool ``[Hkv, n, length]``.
    """
    nblk = -(-length // block_size)
    sel = sel.long()
    sel = torch.where((sel >= 0) & (sel < nblk), sel, nblk)  # invalid ids land in a dropped column
    blocks = torch.zeros(*sel.shape[:2], nblk + 1, dtype=torch.bool, device=sel.device)
    blocks.scatter_(-1, sel, True)
    tok = blocks[..., :nblk].repeat_interleave(block_size, dim=-1)[..., :length]
    causal = torch.arange(length, device=sel.device)[None, :] <= positions[:, None]
    return tok & causal[None]


def sparse_attention_ref(
    q: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    topk_idx: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    scale: float,
    block_size: int,
) -> None:
    """Exact attention over each group's selected blocks.

    Args:
        q: ``[T, Hq, D]``.
        k_cache_l, v_cache_l: ``[num_pages, page_size, Hkv, D]``.
        topk_idx: ``int32 [Hkv, T', topk]`` (T' >= meta.num_tokens) from ``index_topk_ref``.
        meta: this step's metadata.
        out: ``[T, Hq, D]``, written for rows ``< meta.num_tokens`` only.
        scale: softmax scale.
        block_size: sparse block size B (= page size).
    """
    check_heads(q, k_cache_l, out, meta.num_tokens)
    if block_size != meta.page_size:
        raise ValueError(f"block_size={block_size} must equal the cache page_size={meta.page_size}")
    if topk_idx.shape[0] != k_cache_l.shape[2] or topk_idx.shape[1] < meta.num_tokens:
        raise ValueError(f"topk_idx must be [Hkv={k_cache_l.shape[2]}, >= {meta.num_tokens}, topk], "
                         f"got {tuple(topk_idx.shape)}")
    acc = acc_dtype(q.dtype)
    for q0, q1, length, row in meta.requests():
        k = paged_gather(k_cache_l, meta.block_tables, row, length).to(acc)
        v = paged_gather(v_cache_l, meta.block_tables, row, length).to(acc)
        pos = torch.arange(length - (q1 - q0), length, device=q.device)
        allowed = selected_token_mask(topk_idx[:, q0:q1], pos, length, block_size)
        out[q0:q1] = attend(q[q0:q1].to(acc), k, v, allowed, scale).to(out.dtype)
