"""The fused MoE's alignment: routed pairs sorted by expert (``moe.fused_moe``'s step 1).

From local ``topk_ids [T, K]`` (``-1``: dropped): the experts' start offsets ``off [E + 2]``
(routed experts, then the shared expert, then the end), the pair ids in expert order
``sorted_pairs [T*K + T]`` (routed pair ``p = t*K + k``, shared pair ``p = T*K + t``: the shared
expert is expert ``E`` and holds every row) and each pair's sorted position ``pair_pos [T*K +
T]`` (``-1`` when dropped). Ranks are running sums in pair order, so the order is stable and
the same every run; no atomics.

One program per chunk of pairs, after ``_moe_count_kernel``'s per-chunk histograms where there
are several chunks. Where one chunk holds every pair (``aligns_in_one_program``: at rank-of-8 up
to 64 tokens, every decode step) the program counts them itself, and the router's top-k kernel
can run it in its last program instead of a launch of its own (``kernels.router``, through
``align_pairs``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from attention.kernels.triton_utils import next_pow2

Tensor = torch.Tensor

_ONE_HOT = 4096  # elements of a program's [pairs, experts] one-hot tile


class MoEAlignment(NamedTuple):
    """The sorted pairs of a step (shapes in the module docstring), int32 on the device."""

    off: Tensor
    sorted_pairs: Tensor
    pair_pos: Tensor


def align_chunk(num_pairs: int, num_experts: int) -> int:
    """Pairs per program (a power of two): a ``_ONE_HOT``-element one-hot, at least 16."""
    return max(16, min(_ONE_HOT // max(2, next_pow2(num_experts)), next_pow2(max(num_pairs, 1))))


def aligns_in_one_program(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether one program holds every pair of a step (no histogram launch before it)."""
    p = num_tokens * top_k
    return triton.cdiv(p, align_chunk(p, num_experts)) == 1


def alignment_buffers(num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> MoEAlignment:
    """Uninitialised buffers for a step's alignment (every element is written by the align)."""
    n = num_tokens * top_k + num_tokens
    return MoEAlignment(torch.empty(num_experts + 2, dtype=torch.int32, device=device),
                        torch.empty(n, dtype=torch.int32, device=device),
                        torch.empty(n, dtype=torch.int32, device=device))


@triton.jit(do_not_specialize=["T"])
def _moe_count_kernel(ids_ptr, hist_ptr, T, K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
                      CHUNK: tl.constexpr):
    """``hist[b, e]``: pairs of chunk ``b`` (``CHUNK`` consecutive routed pairs) routed to ``e``."""
    b = tl.program_id(0)
    P = T * K
    e_idx = tl.arange(0, E_PAD)
    p = b * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
    hit = (ids[:, None] == e_idx[None, :]) & (ids[:, None] >= 0) & (e_idx[None, :] < E)
    tl.store(hist_ptr + b * E_PAD + e_idx, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def align_pairs(ids_ptr, hist_ptr, off_ptr, sorted_ptr, pos_ptr, T, NB, b, K: tl.constexpr, E: tl.constexpr,
                E_PAD: tl.constexpr, NB_PAD: tl.constexpr, CHUNK: tl.constexpr, SINGLE: tl.constexpr,
                THROUGH_L2: tl.constexpr):
    """Chunk ``b``'s part of the alignment (chunk 0 also writes the offsets).

    Every program reads all chunks' histograms (``[NB, E]``, a few KB): the totals give the
    experts' start offsets, the sum over earlier chunks this chunk's base per expert, and a
    cumsum inside the chunk each pair's rank; so pairs keep their order within an expert and no
    atomics are needed (deterministic). The shared expert's rows ``t`` of this chunk's range are
    pairs ``T*K + t`` after every routed pair. ``SINGLE``: one chunk holds every pair, and the
    program counts them itself. ``THROUGH_L2``: read the ids past L1 (``.cg``), as a program
    must that reads what other programs of its launch stored (``attention.kernels.arrival``).
    """
    P = T * K
    e_idx = tl.arange(0, E_PAD)
    p = b * CHUNK + tl.arange(0, CHUNK)
    if THROUGH_L2:
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1, cache_modifier=".cg")
    else:
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
    hit = (ids[:, None] == e_idx[None, :]) & (ids[:, None] >= 0) & (e_idx[None, :] < E)
    hit32 = hit.to(tl.int32)
    if SINGLE:
        counts = tl.sum(hit32, axis=0)
        before = tl.zeros([E_PAD], dtype=tl.int32)
    else:
        r_idx = tl.arange(0, NB_PAD)
        hist = tl.load(hist_ptr + r_idx[:, None] * E_PAD + e_idx[None, :], mask=r_idx[:, None] < NB, other=0)
        counts = tl.sum(hist, axis=0)
        before = tl.sum(tl.where(r_idx[:, None] < b, hist, 0), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    n_routed = tl.sum(counts, axis=0)
    if b == 0:
        tl.store(off_ptr + e_idx, starts, mask=e_idx < E)
        tl.store(off_ptr + E, n_routed)
        tl.store(off_ptr + E + 1, n_routed + T)
    rank = tl.cumsum(hit32, axis=0)  # inclusive, per expert column
    pos = tl.sum(tl.where(hit, (starts + before)[None, :] + rank - 1, 0), axis=1)
    valid = tl.sum(hit32, axis=1) > 0
    pos = tl.where(valid, pos, -1)
    tl.store(pos_ptr + p, pos, mask=p < P)
    tl.store(sorted_ptr + pos, p, mask=valid & (p < P))  # a permutation of the valid pairs: no conflicts
    t = b * CHUNK + tl.arange(0, CHUNK)  # chunks of pairs cover every row too (T <= T*K)
    tl.store(pos_ptr + P + t, n_routed + t, mask=t < T)
    tl.store(sorted_ptr + n_routed + t, P + t, mask=t < T)


@triton.jit(do_not_specialize=["T"])
def _moe_align_kernel(ids_ptr, hist_ptr, off_ptr, sorted_ptr, pos_ptr, T, NB,
                      K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, NB_PAD: tl.constexpr,
                      CHUNK: tl.constexpr, SINGLE: tl.constexpr = False):
    """The alignment, one program per chunk (``align_pairs``)."""
    align_pairs(ids_ptr, hist_ptr, off_ptr, sorted_ptr, pos_ptr, T, NB, tl.program_id(0), K, E, E_PAD, NB_PAD,
                CHUNK, SINGLE, False)


def moe_align(topk_ids: Tensor, num_experts: int, chunk: int | None = None) -> MoEAlignment:
    """The alignment of local ``topk_ids [T, K]`` (module docstring): two launches whose grids
    depend on T only, one where a single chunk holds every pair. ``chunk``: pairs per program
    (power of two; default ``align_chunk``)."""
    T, K = topk_ids.shape
    E = num_experts
    P, dev = T * K, topk_ids.device
    e_pad = max(2, next_pow2(E))
    chunk = chunk or align_chunk(P, E)
    nb = triton.cdiv(P, chunk)
    hist = torch.empty(nb, e_pad, dtype=torch.int32, device=dev)
    out = alignment_buffers(T, K, E, dev)
    warps = 4 if chunk * e_pad <= 2048 else 8  # 8 for the larger one-hot tiles
    if nb > 1:
        _moe_count_kernel[(nb,)](topk_ids, hist, T, K=K, E=E, E_PAD=e_pad, CHUNK=chunk, num_warps=warps)
    _moe_align_kernel[(nb,)](topk_ids, hist, *out, T, nb, K=K, E=E, E_PAD=e_pad, NB_PAD=max(2, next_pow2(nb)),
                             CHUNK=chunk, SINGLE=nb == 1, num_warps=warps)
    return out


__all__ = ["MoEAlignment", "align_chunk", "align_pairs", "aligns_in_one_program", "alignment_buffers", "moe_align"]
