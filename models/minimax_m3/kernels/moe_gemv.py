"""The fused MoE's experts in the weight-row form (``fp8_gemv.gemv_rows``) for MXFP8 weights at
a few tokens (``MoEConfig.gemv``): between the same align and combine launches as the other
paths, a gate/up kernel (SwiGLU-OAI epilogue) and a down kernel (times the routing weight) that
multiply each weight row into fp32 accumulators without ``tl.dot``.

At decode 1 an expert holds at most one pair, and the tile kernels pad it to a 16-row dot whose
operand chain, not the bytes, sets the time. H200, rank-of-8, one routed expert and the shared
one (42 MB of gate/up rows, 21 MB of down rows; ``benchmarks/results/mxfp8_round6/``): gate/up
21.0 us and down 13.5 us here, against 25.4 and 17.3 for the best fp8 tensor-core tiles, which
need two more launches (row split, activation split) besides; the whole MoE 41.0 against 60.4.

Grid: axis 0 is a slot per expert that can have pairs (at most ``min(E, T*K)`` routed experts,
then the shared one), not one per local expert: slot ``s`` takes the ``s``-th routed expert with
pairs in id order (``_slot_expert``), the last slot the shared expert, and a slot with no expert
returns at once. With narrow row sets an expert needs ~1500 programs, so launching them for all
16 local experts would schedule ~25000 programs that do nothing. Axis 1 covers an expert's
columns; in the gate/up kernel the shared expert's programs take fewer rows (at least 2) with a
longer step (``shared_gate_up_rows``), so its narrower expert gets more programs than the routed
tile would give it (at rank-of-8 384 instead of 48-192; a routed expert gets 384-1536). A
program takes its expert's pairs one at a time, each re-reading the program's weight rows (from
L2 after the first), so any pair count is correct; the form is offered where experts hold a pair
or two (``GEMV_MAX_TOKENS``). A first version took two pairs a pass (two accumulators): the
one-pair experts, the common case there, paid the second one's registers and FMAs for nothing,
and at decode 2 the tuner kept the tensor-core tiles. No atomics: every output element comes
from one program in a fixed order.

The combine can run inside the down kernel instead (``MoEConfig.gemv_combine``): a program per
token and block of output rows walks the token's pairs in the combine launch's order and
writes the sum, so the step has no combine launch and no fp32 per-pair outputs, and the down
grid is the token's rows rather than every slot's. H100, 60 layers of rank-of-8 in MXFP8,
uniform routing, beside main in one call (BENCHMARKS.md, MXFP8 eighteenth round): decode 1
65.2 -> 60.9 us per layer, decode 2 85.0 -> 80.2 (the tuner took it at both). An earlier
combine in the slot programs (the last to finish a block of rows summing it, through an
arrival count) was slower: every program paid a barrier and a GPU-scope atomic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.pdl import grid_dependency, pdl_launch
from attention.kernels.triton_utils import next_pow2

from .activation import swiglu_oai
from .fp8_gemv import gemv_rows
from .fp8_tiles import scale_words

Tensor = torch.Tensor

GEMV_MAX_TOKENS = 4  # token counts the form is offered at (an expert then holds a pair or two)


def gemv_step(k: int, block_k: int) -> int:
    """The K step of the weight-row kernels over a K of ``k``: the largest power of two
    ``<= block_k`` dividing ``k`` and holding whole scale words (>= 128).

    Raises:
        ValueError: ``k`` has no such step (not a multiple of 128).
    """
    step = block_k
    while step >= 128 and k % step:
        step //= 2
    if step < 128:
        raise ValueError(f"the weight-row MoE needs K a multiple of 128 (whole scale words), got {k}: pick a tile "
                         "MoEConfig")
    return step


def shared_gate_up_rows(block_n: int, block_k: int, I: int, Is: int, H: int) -> tuple[int, int]:
    """``(rows, step)`` of a gate/up program on the shared expert: ``block_n * Is / I`` rows (the
    routed expert's program count, where that is at least a gate and an up row; ``Is`` is
    ``I / 8`` for rank-of-8, so 2 rows and half an expert's programs at the 8-row set), the step
    widened so that a program keeps the routed tile's bytes in flight (``block_n * block_k``
    weights a step).

    Why: with the routed tile the shared expert's 768 rows got ``I / Is`` times fewer programs
    than an expert (96 of 8 rows at rank-of-8), each streaming its 6144-byte rows with a few
    KB in flight: at decode 1, where most layers hold no routed expert of their own (top-4 of
    128 over 16 local experts), the gate/up launch was that stream alone, ~0.3 TB/s. H100,
    kernels alone, that launch with no local expert, before -> after: 15.7 -> 10.7 us (8-row
    set), 12.7 -> 11.8 (16-row), 17.5 -> 17.7 (4-row: 4 x 512 -> 2 x 1024 moved nothing);
    with one local expert beside it 0.5-2.2 us slower (more programs sharing the SMs); the
    60-layer decode-1 step moved within its run-to-run spread
    (``benchmarks/results/mxfp8_round20/``)."""
    rows = max(2, min(block_n, next_pow2(max(1, block_n * Is // I))))
    return rows, gemv_step(H, min(4096, block_n * block_k // rows))


@triton.jit
def _slot_expert(off_ptr, E: tl.constexpr, E_PAD: tl.constexpr):
    """``(expert, start, end)`` of this program's slot (axis 0): the slot-th routed expert with
    pairs (by id), the shared expert ``E`` for the last slot, or ``-1`` (and an empty range)."""
    s = tl.program_id(0)
    if s == tl.num_programs(0) - 1:
        e = E
    else:
        e_idx = tl.arange(0, E_PAD)
        lo = tl.load(off_ptr + e_idx, mask=e_idx < E, other=0)
        hi = tl.load(off_ptr + e_idx + 1, mask=e_idx < E, other=0)
        busy = hi > lo
        rank = tl.cumsum(busy.to(tl.int32), axis=0) - 1
        e = tl.max(tl.where(busy & (rank == s), e_idx, -1), axis=0)
    start = tl.load(off_ptr + tl.maximum(e, 0))
    end = tl.where(e >= 0, tl.load(off_ptr + tl.maximum(e, 0) + 1), start)
    return e, start, end


@triton.jit
def _pair_token(sorted_ptr, pos, TK, K: tl.constexpr):
    """The token row of the pair at sorted position ``pos``."""
    pair = tl.load(sorted_ptr + pos)
    return tl.where(pair < TK, pair // K, pair - TK)


@triton.jit(do_not_specialize=["T"])
def _moe_gemv_gate_up_kernel(x_ptr, stride_x, w13_ptr, stride_w13_e, stride_w13_n, s13_ptr, stride_s13_e,
                             stride_s13_n, sgu_ptr, stride_sgu_n, ssgu_ptr, stride_ssgu_n, sorted_ptr, off_ptr,
                             act_ptr, stride_act, T, H, I, IS, alpha, limit,
                             K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_N_SHARED: tl.constexpr, BLOCK_K_SHARED: tl.constexpr,
                             NUM_STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    """act[pos, n] = SwiGLU-OAI(x[tok(pos)] . gate[n], x[tok(pos)] . up[n]) for ``BLOCK_N // 2``
    columns ``n`` of the slot's routed expert, ``BLOCK_N_SHARED // 2`` of the shared one: its
    gate and up rows interleaved, ``BLOCK_N`` (``BLOCK_N_SHARED``) weight rows per program
    (scale pointers and strides in int32 words)."""
    grid_dependency(PDL)
    e, start, end = _slot_expert(off_ptr, E, E_PAD)
    if e < E:
        _gate_up_rows(x_ptr, stride_x, w13_ptr + tl.maximum(e, 0).to(tl.int64) * stride_w13_e, stride_w13_n,
                      s13_ptr + tl.maximum(e, 0).to(tl.int64) * stride_s13_e, stride_s13_n, sorted_ptr, act_ptr,
                      stride_act, start, end, T, H, I, alpha, limit, K, BLOCK_N, BLOCK_K, NUM_STAGES)
    else:
        _gate_up_rows(x_ptr, stride_x, sgu_ptr, stride_sgu_n, ssgu_ptr, stride_ssgu_n, sorted_ptr, act_ptr,
                      stride_act, start, end, T, H, IS, alpha, limit, K, BLOCK_N_SHARED, BLOCK_K_SHARED, NUM_STAGES)


@triton.jit
def _gate_up_rows(x_ptr, stride_x, w_ptr, stride_wn, s_ptr, stride_sn, sorted_ptr, act_ptr, stride_act, start, end,
                  T, H, N, alpha, limit, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  NUM_STAGES: tl.constexpr):
    """The activations of the pairs ``[start, end)`` of one expert (``N`` columns, gate rows then
    up rows at ``w_ptr``) for this program's ``BLOCK_N // 2`` columns (axis 1)."""
    HALF: tl.constexpr = BLOCK_N // 2
    n0 = tl.program_id(1) * HALF
    if n0 < N:
        r = tl.arange(0, BLOCK_N)
        n = n0 + r // 2
        row = (n % N + (r % 2) * N).to(tl.int64)  # even r: gate row n, odd r: up row N + n
        w_rows = w_ptr + row * stride_wn
        s_rows = s_ptr + row * stride_sn
        cols = n0 + tl.arange(0, HALF)
        c_ok = cols < N
        for m0 in range(start, end):
            tok = _pair_token(sorted_ptr, m0, T * K, K)
            acc, _ = gemv_rows(x_ptr + tok.to(tl.int64) * stride_x, x_ptr, False, w_rows, s_rows, H, False, BLOCK_K,
                               NUM_STAGES)
            p = m0 + tl.zeros([], tl.int64)  # the sorted position in int64 (row offset of act)
            _store_act(acc, act_ptr + p * stride_act + cols, c_ok, alpha, limit, HALF)


@triton.jit
def _store_act(acc, ptrs, mask, alpha, limit, HALF: tl.constexpr):
    """SwiGLU-OAI of interleaved (gate, up) sums ``acc [2 * HALF]``, stored at ``ptrs [HALF]``."""
    g, u = tl.split(tl.reshape(acc, (HALF, 2)))
    tl.store(ptrs, swiglu_oai(g, u, alpha, limit).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _moe_gemv_down_kernel(act_ptr, stride_act, w2_ptr, stride_w2_e, stride_w2_h, s2_ptr, stride_s2_e, stride_s2_h,
                          sd_ptr, stride_sd_h, ssd_ptr, stride_ssd_h, topk_w_ptr, sorted_ptr, off_ptr, y_ptr, stride_y,
                          T, H, I, IS,
                          K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_K_SHARED: tl.constexpr,
                          NUM_STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    """y[pos, h] = w_pair * (act[pos, :N_e] . w2_e[h, :N_e]) in fp32 for ``BLOCK_N`` rows ``h``
    of the slot's expert (shared pairs weigh 1; scale pointers and strides in int32 words)."""
    grid_dependency(PDL)
    e, start, end = _slot_expert(off_ptr, E, E_PAD)
    h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ld = (h % H).to(tl.int64)  # a partial last tile re-reads valid rows (not stored)
    h_ok = h < H
    ee = tl.maximum(e, 0).to(tl.int64)
    for m0 in range(start, end):
        p = m0 + tl.zeros([], tl.int64)  # the sorted position in int64 (row offsets of act and y)
        a = act_ptr + p * stride_act
        if e < E:
            acc, _ = gemv_rows(a, a, False, w2_ptr + ee * stride_w2_e + h_ld * stride_w2_h,
                               s2_ptr + ee * stride_s2_e + h_ld * stride_s2_h, I, False, BLOCK_K, NUM_STAGES)
        else:
            acc, _ = gemv_rows(a, a, False, sd_ptr + h_ld * stride_sd_h, ssd_ptr + h_ld * stride_ssd_h, IS, False,
                               BLOCK_K_SHARED, NUM_STAGES)
        _store_y(acc, sorted_ptr, topk_w_ptr, m0, T * K, y_ptr + p * stride_y + h, h_ok)


@triton.jit(do_not_specialize=["T"])
def _moe_gemv_down_combine_kernel(act_ptr, stride_act, w2_ptr, stride_w2_e, stride_w2_h, s2_ptr, stride_s2_e,
                                  stride_s2_h, sd_ptr, stride_sd_h, ssd_ptr, stride_ssd_h, topk_ids_ptr, topk_w_ptr,
                                  pos_ptr, out_ptr, stride_o_t, T, H, I, IS,
                                  K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  BLOCK_K_SHARED: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr = 0):
    """out[t, h] = sum_k w[t, k] * (act[pos(t, k)] . w2_{id(t, k)}[h]) + act[pos(shared, t)] . sd[h]
    for ``BLOCK_N`` rows ``h`` of token ``t`` (axis 0): the down products of the token's pairs
    (valid ones, k ascending, then the shared one) summed in fp32 in the combine launch's order,
    each term as ``_moe_gemv_down_kernel`` computes it, one cast into ``out``."""
    grid_dependency(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ld = (h % H).to(tl.int64)  # a partial last tile re-reads valid rows (not stored)
    h_ok = h < H
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(K):
        pos = tl.load(pos_ptr + t * K + k)
        if pos >= 0:
            e = tl.load(topk_ids_ptr + t * K + k).to(tl.int64)
            a = act_ptr + pos.to(tl.int64) * stride_act
            acc, _ = gemv_rows(a, a, False, w2_ptr + e * stride_w2_e + h_ld * stride_w2_h,
                               s2_ptr + e * stride_s2_e + h_ld * stride_s2_h, I, False, BLOCK_K, NUM_STAGES)
            total += acc * tl.load(topk_w_ptr + t * K + k)
    a = act_ptr + tl.load(pos_ptr + T * K + t).to(tl.int64) * stride_act
    acc, _ = gemv_rows(a, a, False, sd_ptr + h_ld * stride_sd_h, ssd_ptr + h_ld * stride_ssd_h, IS, False,
                       BLOCK_K_SHARED, NUM_STAGES)
    total += acc
    tl.store(out_ptr + t.to(tl.int64) * stride_o_t + h, total.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _store_y(acc, sorted_ptr, topk_w_ptr, pos, TK, ptrs, mask):
    """``acc`` times the routing weight of the pair at sorted position ``pos`` (1 for a shared
    pair), stored at ``ptrs``."""
    pair = tl.load(sorted_ptr + pos)
    wt = tl.where(pair < TK, tl.load(topk_w_ptr + tl.minimum(pair, TK - 1)), 1.0)
    tl.store(ptrs, acc * wt, mask=mask)


def experts_gemv(x: Tensor, topk_w: Tensor, w13: Tensor, w2: Tensor, shared_gate_up: Tensor, shared_down: Tensor,
                 scales: tuple[Tensor, Tensor, Tensor, Tensor], alpha: float, limit: float, off: Tensor,
                 sorted_pairs: Tensor, K: int, block_n: int, block_k: int, num_warps: int,
                 num_stages: int, combine: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """The per-pair expert outputs ``y [1, P + T, H]`` fp32 (weighted) of the sorted pairs
    ``(off, sorted_pairs)`` of ``moe_align``, for ``moe.fused_moe``'s combine. Shapes as
    ``fused_moe``'s (checked there), fitting ``moe_fp8_mma.fits_fp8_mma`` (H, I and Is multiples
    of 128, scales readable as int32 words: the same whole-word steps).

    ``combine = (topk_ids [T, K], pair_pos [P + T], out [T, H])`` (``MoEConfig.gemv_combine``):
    the down kernel runs per token instead (``_moe_gemv_down_combine_kernel``), each program
    summing its rows' products over the token's pairs in the combine launch's order, and writes
    ``out``, which is returned: no ``y`` and no combine launch. The same sums, term by term.
    """
    T, H = x.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    Is = shared_gate_up.shape[0] // 2
    P = T * K
    s13, s2, ssgu, ssd = (scale_words(s) for s in scales)
    e_pad = max(2, next_pow2(E))
    slots = min(E, P) + 1
    act = torch.empty(P + T, max(I, Is), dtype=x.dtype, device=x.device)
    block_n_shared, block_k_shared = shared_gate_up_rows(block_n, block_k, I, Is, H)
    _moe_gemv_gate_up_kernel[(slots, max(triton.cdiv(I, block_n // 2), triton.cdiv(Is, block_n_shared // 2)))](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), s13, s13.stride(0), s13.stride(1),
        shared_gate_up, shared_gate_up.stride(0), ssgu, ssgu.stride(0), sorted_pairs, off, act, act.stride(0),
        T, H, I, Is, float(alpha), float(limit),
        K=K, E=E, E_PAD=e_pad, BLOCK_N=block_n, BLOCK_K=gemv_step(H, block_k), BLOCK_N_SHARED=block_n_shared,
        BLOCK_K_SHARED=block_k_shared, NUM_STAGES=num_stages, num_warps=num_warps, **pdl_launch(x.device))
    if combine is not None:
        topk_ids, pair_pos, out = combine
        _moe_gemv_down_combine_kernel[(T, triton.cdiv(H, block_n))](
            act, act.stride(0), w2, w2.stride(0), w2.stride(1), s2, s2.stride(0), s2.stride(1),
            shared_down, shared_down.stride(0), ssd, ssd.stride(0), topk_ids, topk_w, pair_pos, out, out.stride(0),
            T, H, I, Is, K=K, BLOCK_N=block_n, BLOCK_K=gemv_step(I, block_k),
            BLOCK_K_SHARED=gemv_step(Is, block_k), NUM_STAGES=num_stages, num_warps=num_warps,
            **pdl_launch(x.device))
        return out
    y = torch.empty(1, P + T, H, dtype=torch.float32, device=x.device)
    _moe_gemv_down_kernel[(slots, triton.cdiv(H, block_n))](
        act, act.stride(0), w2, w2.stride(0), w2.stride(1), s2, s2.stride(0), s2.stride(1),
        shared_down, shared_down.stride(0), ssd, ssd.stride(0), topk_w, sorted_pairs, off, y, y.stride(1),
        T, H, I, Is,
        K=K, E=E, E_PAD=e_pad, BLOCK_N=block_n, BLOCK_K=gemv_step(I, block_k),
        BLOCK_K_SHARED=gemv_step(Is, block_k), NUM_STAGES=num_stages, num_warps=num_warps, **pdl_launch(x.device))
    return y


__all__ = ["GEMV_MAX_TOKENS", "experts_gemv", "gemv_step", "shared_gate_up_rows"]
