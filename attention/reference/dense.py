"""Dense causal GQA over the paged cache: the plain-torch reference.

Also holds the two helpers the sparse reference shares: gathering one sequence's keys from
its pages, and masked exact softmax attention.

Caches of any storage dtype (bf16, fp32, fp8 e4m3 with unit scale, ...) are read the same way:
gather in the storage dtype, then upcast to the compute dtype (fp32, or fp64 for fp64
queries). fp8 -> fp32 is exact, so the references compute on exactly the stored values.
"""

from __future__ import annotations

import torch

from attention.metadata import AttentionMetadata


def paged_gather(cache_l: torch.Tensor, block_tables: torch.Tensor, table_row: int, length: int) -> torch.Tensor:
    """The first ``length`` positions of one sequence, contiguous.

    Args:
        cache_l: ``[num_pages, page_size, *rest]`` one layer of a paged cache.
        block_tables: ``int32 [max_table_rows, max_pages_per_seq]``.
        table_row: the sequence's block-table row.
        length: positions to gather.
    Returns:
        ``[length, *rest]``, same dtype as the cache.
    """
    page = cache_l.shape[1]
    npages = -(-length // page)
    pages = block_tables[table_row, :npages].long()
    src = cache_l
    if src.element_size() == 1 and src.dtype.is_floating_point:
        src = src.view(torch.uint8)  # fp8: move the bytes (index kernels do not cover fp8 on every device)
    out = src.index_select(0, pages).reshape(npages * page, *cache_l.shape[2:])[:length]
    return out.view(cache_l.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact masked softmax attention with GQA, in the dtype of ``q``.

    Args:
        q: ``[n, Hq, D]``; q-head ``h`` uses kv-head ``h // (Hq // Hkv)``.
        k, v: ``[L, Hkv, D]``.
        allowed: bool ``[Hkv, n, L]`` (or ``[1, n, L]``), which keys each query may see.
        scale: softmax scale.
    Returns:
        ``[n, Hq, D]``; a query that sees no key gets zeros.
    """
    hq, hkv = q.shape[1], k.shape[1]
    grp = hq // hkv
    kx = k.repeat_interleave(grp, dim=1)
    vx = v.repeat_interleave(grp, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, kx) * scale
    mask = allowed.expand(hkv, -1, -1).repeat_interleave(grp, dim=0)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all-masked rows give NaN: no keys, no output
    return torch.einsum("hnl,lhd->nhd", p, vx)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, or fp64 when the inputs are fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_heads(q: torch.Tensor, k_cache_l: torch.Tensor, out: torch.Tensor, num_tokens: int) -> None:
    """Shape checks shared by the attention references."""
    if q.dim() != 3 or k_cache_l.dim() != 4 or q.shape[2] != k_cache_l.shape[3]:
        raise ValueError(f"need q [T, Hq, D] and a cache layer [P, page, Hkv, D]; "
                         f"got {tuple(q.shape)}, {tuple(k_cache_l.shape)}")
    if q.shape[1] % k_cache_l.shape[2]:
        raise ValueError(f"num_qo_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache_l.shape[2]}")
    if out.shape[1:] != q.shape[1:] or min(out.shape[0], q.shape[0]) < num_tokens:
        raise ValueError(f"out {tuple(out.shape)} does not match q {tuple(q.shape)}")


def dense_attention_ref(
    q: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Causal GQA: the query at position ``p`` sees keys ``0..p`` of its own sequence.

    Args:
        q: ``[T, Hq, D]`` (T >= meta.num_tokens; rows past it are ignored).
        k_cache_l, v_cache_l: ``[num_pages, page_size, Hkv, D]``.
        meta: this step's metadata (host copies drive the loop).
        out: ``[T, Hq, D]``, written for rows ``< meta.num_tokens`` only, in ``out.dtype``.
        scale: softmax scale.
    """
    check_heads(q, k_cache_l, out, meta.num_tokens)
    acc = acc_dtype(q.dtype)
    for q0, q1, length, row in meta.requests():
        n = q1 - q0
        k = paged_gather(k_cache_l, meta.block_tables, row, length).to(acc)
        v = paged_gather(v_cache_l, meta.block_tables, row, length).to(acc)
        pos = torch.arange(length - n, length, device=q.device)
        allowed = (torch.arange(length, device=q.device)[None, :] <= pos[:, None])[None]
        out[q0:q1] = attend(q[q0:q1].to(acc), k, v, allowed, scale).to(out.dtype)
