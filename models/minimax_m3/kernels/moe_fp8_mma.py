"""The fused MoE's two GEMMs on MXFP8 weights in weight-row tiles (``MoEConfig.fp8_mma``): with
fp8 tensor-core dots, or (``mma_f16``) with the weights dequantised as wgmma's register operand.

The other MXFP8 paths of ``moe`` dequantise every weight in registers before a bf16 / f16 dot.
An H200 profile (ncu, decode 32, 10 experts) showed that path short of issue slots and of warps:
238 registers per thread, 2 programs per SM, one instruction per 2.1 cycles, 2.0 TB/s. Here the
weights never pass through registers: they are the dots' ``A`` operand as stored (e4m3, from
shared memory), one dot per 32-column scale block, each product scaled by its block's E8M0 factor
into an fp32 accumulator. The rows of the step (the few pairs routed to an expert) are the ``B``
operand (the product is ``W @ rows^T``, "swap AB": wgmma's M of 64 goes to the weight rows, its
N of 8-16 to the pairs, so a decode step pads nothing to 64). Each row is split into two e4m3
parts ``hi + lo`` scaled by a power of two (``fp8_split_rows``: about a bf16's 8 significant
bits); the split's factor is undone in the epilogue. Measured on the H200 (BENCHMARKS.md):
faster at decode 1 (one expert, K split over ~400 programs: 55 vs 77 us), as fast at 32-64
pairs (2.4-2.8 TB/s with a third of the instructions and twice the programs per SM), slower at
prefill; the tuner picks per step size. What the decode limit is not (H200, BENCHMARKS.md
"Third follow-up round"): the weight layout (a plain fp8 streaming kernel reads these row-major
128-byte row segments at 3.9 TB/s, a tiled copy at 4.0) and the wait between the hi and lo dots
(one K = 64 dot with the parts stacked, the weight block read twice, was 14-35% slower, as were
128-row tiles over two warpgroups). Left: one fresh product per 32 columns, waited for before
its scaling, in each program's serial chain: a plain kernel doing only that per-block scaling
streams at ~2.5 TB/s whatever the scale layout (``benchmarks/bench_fp8_stream.py``).
``mma_diag`` (``_mma_rows_diag``) waits once per 128 columns instead: the rows laid out
block-diagonally, one dot gives the four blocks' products side by side (H100, kernels alone at
T=32: 169 vs 213 us; offered to the tuner at decode sizes, ``MoEConfig.mma_diag``).

The f16 form (``mma_f16``, ``_dequant_rows``) keeps the tiles and drops that chain: each weight
tile is dequantised to f16 in registers, in the layout wgmma takes its first operand from, and
one K = 128 dot per step accumulates in place against f16 rows (x, then the activation, in f16;
no row split). The H200 measured it the fastest MXFP8 MoE at prefill sizes (T=1054: 666 vs 726
us for the best dequantising set) and level with the others at decode. Its K runs in the order
wgmma's register operand hands a thread its columns (``to_k_order``: x and the activation are
stored so, the weight tile permuted in registers): a thread then reads 32 contiguous weight
bytes of one scale block per row as two 16-byte shared loads, where in column order it read 32
two-byte pairs (H100, T=1054: 684.5 -> 598.7 us).

Launches, after ``moe_align`` (same sorted pairs as the other paths):

1. ``split_rows``: x ``[T, H]`` -> ``xq [2, T, H]`` e4m3 and ``fx [T]`` (``2**-e``); the f16 form
   converts x to f16 in K order instead (``permute_k``).
2. ``_moe_mma_gate_up_kernel``, grid ``(E + 1, max(2I, 2Is) / BLOCK_N, split)``: the pre-activations
   ``h[s, pos, n] = fx * sum_k W13[n, k] xq[tok(pos), k]`` over K-range ``s`` of H, fp32.
   Gate and up rows are separate N-tiles (twice the programs of a fused tile, so one expert at
   decode 1 still spreads over ~100 programs); the split over H adds programs where there are
   few pairs.
3. ``_moe_swiglu_split_kernel``, one program per sorted pair: sums the splits, SwiGLU-OAI in fp32,
   splits the activation row like x (``aq [2, P + T, I]``, ``fa``), or stores it in f16 in K order.
4. ``_moe_mma_down_kernel``, grid ``(E + 1, H / BLOCK_N, split)``: ``y[s, pos, h] = w_pair * fa *
   sum_k W2[h, k] aq[pos, k]`` over K-range ``s`` of I (Is for the shared expert).
5. ``moe``'s combine kernel sums the splits and the pairs in a fixed order.

No atomics; every output element has one writer and a fixed order, so graph replays are
bit-identical to eager runs of the same shapes. Grids depend on T and the weight shapes only.
Needs H, I and Is multiples of ``MMA_BLOCK_K`` and scales readable as int32 words
(``fits_fp8_mma``). Under the Triton interpreter the two row splits run in torch (the
interpreter's fp32 -> e4m3 cast drops the mantissa carry); the GEMMs run in the interpreter on
fp32 dots of the same e4m3 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.triton_utils import fp8_split_rows, interpreting, next_pow2
from common.fp8_split import fp8_split_rows as fp8_split_rows_torch
from models.minimax_m3.layers import swiglu_oai_f32

from .activation import swiglu_oai
from .fp8_tiles import scale_factor, scale_words
from .moe_experts import down_weights

Tensor = torch.Tensor

# Columns per K step: four 32-column scale blocks, one int32 word of scales per weight row.
MMA_BLOCK_K = 128


def fits_fp8_mma(H: int, I: int, Is: int, scales: tuple[Tensor, ...]) -> bool:
    """Whether the fp8 tensor-core path takes these shapes: every K a multiple of
    ``MMA_BLOCK_K`` and every scale tensor readable as int32 words."""
    return all(k % MMA_BLOCK_K == 0 for k in (H, I, Is)) and all(scale_words(s) is not None for s in scales)


# --------------------------------------------------------------------------------------------
# row splits (x, and the activation)


@triton.jit
def _moe_split_rows_kernel(v_ptr, stride_v, q_ptr, stride_q_part, stride_q, f_ptr, C, BLOCK: tl.constexpr):
    """Row ``program_id(0)`` of ``v`` as ``q[0] + q[1] ~= v * 2**e`` (e4m3) and ``f = 2**-e``."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < C
    v = tl.load(v_ptr + r.to(tl.int64) * stride_v + c, mask=ok, other=0.0)
    _store_split_row(v, r, c, ok, q_ptr, stride_q_part, stride_q, f_ptr)


@triton.jit
def _store_split_row(v, r, c, ok, q_ptr, stride_q_part, stride_q, f_ptr):
    """Row ``r`` (values ``v`` at columns ``c``, valid where ``ok``) split by ``fp8_split_rows``:
    ``q[0, r]``, ``q[1, r]`` and ``f[r] = 2**-e``."""
    hi, lo, e = fp8_split_rows(v[None, :])
    base = q_ptr + r.to(tl.int64) * stride_q + c[None, :]
    tl.store(base, hi, mask=ok[None, :])
    tl.store(base + stride_q_part, lo, mask=ok[None, :])
    tl.store(f_ptr + r + tl.arange(0, 1), scale_factor(127 - e, False))


def split_rows(v: Tensor) -> tuple[Tensor, Tensor]:
    """``v [R, C]`` -> ``q [2, R, C]`` e4m3 (``q[0] + q[1] ~= v * 2**e`` per row) and fp32
    ``f [R] = 2**-e`` (``common.fp8_split``), one launch (torch under the interpreter)."""
    R, C = v.shape
    if interpreting():
        hi, lo, e = fp8_split_rows_torch(v)
        return torch.stack([hi, lo]), torch.pow(2.0, -e.float()).reshape(R)
    q = torch.empty(2, R, C, dtype=torch.float8_e4m3fn, device=v.device)
    f = torch.empty(R, dtype=torch.float32, device=v.device)
    if R:
        block = next_pow2(C)
        _moe_split_rows_kernel[(R,)](v, v.stride(0), q, q.stride(0), q.stride(1), f, C, BLOCK=block,
                                 num_warps=8 if block >= 4096 else 4)
    return q, f


@triton.jit
def _moe_swiglu_split_kernel(h_ptr, stride_h_split, stride_h, off_ptr, aq_ptr, stride_aq_part, stride_aq, fa_ptr,
                         I, IS, alpha, limit, E: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                         F16: tl.constexpr = False):
    """Sorted pair ``r``: ``act = SwiGLU-OAI(sum_s h[s, r, :N], sum_s h[s, r, N:2N])`` (N = I for
    a routed pair, Is for a shared one), split like x into ``aq[:, r]`` and ``fa[r]``, or with
    ``F16`` stored as f16 in ``aq[0, r]`` in K order (``to_k_order``; ``fa`` unused; ``BLOCK`` a
    multiple of 128, as I and Is are)."""
    r = tl.program_id(0)
    n_routed = tl.load(off_ptr + E)
    if r < tl.load(off_ptr + E + 1):
        N = tl.where(r < n_routed, I, IS)
        c = tl.arange(0, BLOCK)
        ok = c < N
        g = tl.zeros([BLOCK], dtype=tl.float32)
        u = tl.zeros([BLOCK], dtype=tl.float32)
        row = h_ptr + r.to(tl.int64) * stride_h
        for s in tl.static_range(SPLIT):
            g += tl.load(row + s * stride_h_split + c, mask=ok, other=0.0)
            u += tl.load(row + s * stride_h_split + N + c, mask=ok, other=0.0)
        a = tl.where(ok, swiglu_oai(g, u, alpha, limit), 0.0)
        if F16:
            a = to_k_order(a)  # within 128-column groups: N still masks the same columns
            tl.store(aq_ptr + r.to(tl.int64) * stride_aq + c, a.to(tl.float16), mask=ok)
        else:
            _store_split_row(a, r, c, ok, aq_ptr, stride_aq_part, stride_aq, fa_ptr)


def swiglu_split(h: Tensor, off: Tensor, E: int, I: int, Is: int, alpha: float, limit: float,
                 f16: bool = False) -> tuple[Tensor, Tensor]:
    """The activations of the gate/up pre-activations ``h [split, P + T, 2 * max(I, Is)]``:
    ``aq [2, P + T, max(I, Is)]`` e4m3 and ``fa [P + T]`` (rows past ``off[E + 1]`` untouched),
    or with ``f16`` ``aq [1, P + T, max(I, Is)]`` f16, its columns in K order (``to_k_order``;
    ``fa`` unused)."""
    S, R, _ = h.shape
    width = max(I, Is)
    aq = torch.empty(1 if f16 else 2, R, width, dtype=torch.float16 if f16 else torch.float8_e4m3fn, device=h.device)
    fa = torch.empty(R, dtype=torch.float32, device=h.device)
    if interpreting() and not f16:  # torch: the interpreter's e4m3 cast is wrong (module docstring)
        n_routed, n_all = int(off[E]), int(off[E + 1])
        hs = h.sum(0)
        aq.zero_()
        fa.fill_(1.0)
        for lo_r, hi_r, n in ((0, n_routed, I), (n_routed, n_all, Is)):
            if hi_r > lo_r:
                a = swiglu_oai_f32(hs[lo_r:hi_r, :n], hs[lo_r:hi_r, n:2 * n], alpha, limit)
                q_hi, q_lo, e = fp8_split_rows_torch(a)
                aq[0, lo_r:hi_r, :n], aq[1, lo_r:hi_r, :n] = q_hi, q_lo
                fa[lo_r:hi_r] = torch.pow(2.0, -e.float()).reshape(-1)
        return aq, fa
    block = next_pow2(width)
    _moe_swiglu_split_kernel[(R,)](h, h.stride(0), h.stride(1), off, aq, aq.stride(0), aq.stride(1), fa, I, Is,
                               float(alpha), float(limit), E=E, SPLIT=S, BLOCK=block, F16=f16,
                               num_warps=8 if block >= 4096 else 4)
    return aq, fa


@triton.jit
def to_k_order(v):
    """``v`` (rows of whole 128-column groups: ``[C]`` or ``[R, C]``) in the f16 form's K order:
    within each 128 columns, column ``32q + 2j + b`` (``q < 4``, ``j < 16``, ``b < 2``) goes to
    ``8j + 2q + b``, the order in which wgmma's register operand hands a thread its columns."""
    return tl.reshape(tl.permute(tl.reshape(v, (v.numel // 128, 4, 16, 2)), (0, 2, 1, 3)), v.shape)


@triton.jit
def k_order_position(c):
    """Where column ``c`` (int tensor) of a row goes in K order (``to_k_order``): within its 128
    columns, ``32q + 2j + b`` -> ``8j + 2q + b``. For stores of a few columns of a row (the
    fused SwiGLU epilogue), where ``to_k_order`` permutes whole 128-column groups."""
    return (c // 128) * 128 + 8 * ((c % 32) // 2) + 2 * ((c % 128) // 32) + c % 2


@triton.jit
def _permute_k_kernel(v_ptr, stride_v, out_ptr, stride_out, BLOCK: tl.constexpr):
    """Columns ``[program_id(1) * BLOCK, +BLOCK)`` of row ``program_id(0)``, in f16 and K order."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + r * stride_v + c)
    tl.store(out_ptr + r * stride_out + c, to_k_order(v).to(tl.float16))


def permute_k(v: Tensor) -> Tensor:
    """``v [R, K]`` (K a multiple of 128) in f16 with its columns in K order (``to_k_order``):
    the rows a K-ordered dot takes as its B operand. One kernel (a strided torch copy of the same
    permutation took 25 us for x at 1054 rows on the H100, against 20 for the plain f16 cast)."""
    R, K = v.shape
    if K % 128 or v.stride(1) != 1:
        raise ValueError(f"permute_k needs rows of whole 128-column groups, contiguous; got {tuple(v.shape)}, "
                         f"strides {v.stride()}")
    block = 128
    while block < 1024 and K % (2 * block) == 0:
        block *= 2
    out = torch.empty(R, K, dtype=torch.float16, device=v.device)
    if R:
        _permute_k_kernel[(R, K // block)](v, v.stride(0), out, out.stride(0), BLOCK=block, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------
# the GEMMs


@triton.jit
def _two_part_dot(w, bh, bl, DOT_F32: tl.constexpr):
    """``w @ (bh + bl)``: two e4m3 dots (weights against the row split's two parts) into one
    fresh fp32 product; ``DOT_F32`` (the interpreter) in fp32 on the same e4m3 values."""
    if DOT_F32:
        wf = w.to(tl.float32)
        p = tl.dot(wf, bh.to(tl.float32), tl.dot(wf, bl.to(tl.float32), input_precision="ieee"), input_precision="ieee")
    else:
        p = tl.dot(w, bh, tl.dot(w, bl))
    return p


@triton.jit
def _mma_rows(w_base, s_base, b_base, stride_b_part, b_ok, k_beg, k_end, BLOCK_N: tl.constexpr,
              BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_T] = sum_{k in [k_beg, k_end)} W[n, k] * scale[n, k // 32] *
    (B[0] + B[1])[k, t]``: ``w_base [BLOCK_N, 32]`` points at each weight row's first 32
    columns, ``s_base [BLOCK_N, 1]`` at each row's int32 scale words, ``b_base [32, BLOCK_T]`` at
    each B column's first 32 entries of part 0 (part 1 ``stride_b_part`` further); ``b_ok
    [1, BLOCK_T]`` masks the B columns (padded pairs read zeros). ``k_beg`` a multiple of
    ``MMA_BLOCK_K``.

    Every 32 columns: two e4m3 dots into a fresh product (its block's factor differs per weight
    row), scaled and added in fp32. The next step's scale words are loaded one step ahead: a
    load that feeds no dot operand is not pipelined by Triton, and would wait a full memory
    latency every step.
    """
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    words = tl.load(s_base + k_beg // 128, mask=k_beg < k_end, other=0)
    for k0 in range(k_beg, k_end, 128):
        cur = words
        words = tl.load(s_base + (k0 + 128) // 128, mask=k0 + 128 < k_end, other=0)
        for b in tl.static_range(4):
            w = tl.load(w_base + k0 + 32 * b)
            bh = tl.load(b_base + k0 + 32 * b, mask=b_ok, other=0.0)
            bl = tl.load(b_base + stride_b_part + k0 + 32 * b, mask=b_ok, other=0.0)
            acc += _two_part_dot(w, bh, bl, DOT_F32) * scale_factor((cur >> (8 * b)) & 0xFF, False)
    return acc


@triton.jit
def _mma_rows_diag(w_base, s_base, b_base, stride_b_part, b_ok, k_beg, k_end, BLOCK_N: tl.constexpr,
                   BT: tl.constexpr, DOT_F32: tl.constexpr):
    """``_mma_rows`` with one product per K step instead of one per 32 columns: the B operand
    laid out block-diagonally (``mma_diag``). ``w_base [BLOCK_N, 128]`` points at each weight
    row's first 128 columns, ``b_base [128, 4 BT]`` at B column ``t``'s first 128 entries in
    columns ``4t + b``, ``b_ok [128, 4 BT]`` keeps row ``k`` of column ``4t + b`` only where
    ``k // 32 == b`` (and ``t`` is a real pair). The product's column ``4t + b`` is then scale
    block ``b``'s product for pair ``t``: each is scaled by its block's factor into a ``[BLOCK_N,
    4 BT]`` accumulator, summed over the four blocks once, after the loop. One wait per 128
    columns where ``_mma_rows`` waits four times (a plain kernel with a product per 32
    columns streams at ~2.5 TB/s, one with a product accumulated in place at ~3.9), for four
    times the tensor-core work and B's shared memory (idle and small at decode sizes)."""
    acc = tl.zeros([BLOCK_N, 4 * BT], dtype=tl.float32)
    shift = 8 * (tl.arange(0, 4 * BT) % 4)[None, :]
    words = tl.load(s_base + k_beg // 128, mask=k_beg < k_end, other=0)
    for k0 in range(k_beg, k_end, 128):
        cur = words
        words = tl.load(s_base + (k0 + 128) // 128, mask=k0 + 128 < k_end, other=0)
        w = tl.load(w_base + k0)
        bh = tl.load(b_base + k0, mask=b_ok, other=0.0)
        bl = tl.load(b_base + stride_b_part + k0, mask=b_ok, other=0.0)
        acc += _two_part_dot(w, bh, bl, DOT_F32) * scale_factor((cur >> shift) & 0xFF, False)
    return tl.sum(tl.reshape(acc, (BLOCK_N, BT, 4)), axis=2)


@triton.jit
def _dequant_rows(w_base, s_base, b_base, b_ok, k_beg, k_end, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                  DOT_F32: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_T] = sum_{k in [k_beg, k_end)} (W[n, k] * scale[n, k // 32]) * B[k, t]``
    with the weights dequantised to f16 in registers: ``w_base [BLOCK_N, 128]`` points at each
    weight row's first 128 columns, ``s_base [BLOCK_N, 1]`` at its int32 scale words, ``b_base
    [128, BLOCK_T]`` at each f16 B column's first 128 entries, stored in K order (``to_k_order``);
    ``b_ok [1, BLOCK_T]`` masks the B columns. ``k_beg`` a multiple of ``MMA_BLOCK_K``.

    The dequantised tile is the dot's first operand, which wgmma takes from registers: no trip
    back through shared memory, and one f16 dot of K = 128 per step, accumulated in place (the
    e4m3 path needs a fresh product per 32 columns, waited for and scaled). Exact: every
    weight times its E8M0 scale is an f16 where the scales fit (``moe.scales_fit_f16``).
    """
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    blk = tl.arange(0, 4)[None, :]
    for k0 in range(k_beg, k_end, 128):
        # [BLOCK_N, 4]: each block's byte from the row's word, loaded once per block rather than
        # once per row and shifted: so loaded, the factors take the layout the dot wants for the
        # weights and the dequantise runs in it (a loaded word broadcast over the blocks made
        # Triton dequantise in another layout and convert through shared memory, with a barrier)
        words = tl.load(s_base + k0 // 128 + blk // 4)
        f = scale_factor((words >> (8 * blk)) & 0xFF, True)
        # the dot's column 8j + 2q + b is the step's column 32q + 2j + b (``to_k_order``, as B's
        # rows are stored): a thread's 32 weights of a row are then 32 contiguous bytes of one
        # scale block (two 16-byte shared loads, one factor); in column order they were 2-byte
        # pairs of four blocks (H100, T=1054: gate/up 402 -> 327 us, down 237 -> 209)
        f = tl.reshape(tl.broadcast_to(f[:, None, :, None], (BLOCK_N, 16, 4, 2)), (BLOCK_N, 128))
        w = to_k_order(tl.load(w_base + k0)).to(tl.float16) * f
        b = tl.load(b_base + k0, mask=b_ok, other=0.0)
        if DOT_F32:
            acc = tl.dot(w.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, b, acc)
    return acc


@triton.jit
def _rows_product(w_base, s_base, b_base, stride_b_part, b_ok, k_beg, k_end, BLOCK_N: tl.constexpr,
                  BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr, F16: tl.constexpr, DIAG: tl.constexpr):
    """``W @ B`` over ``[k_beg, k_end)`` for a program's weight rows: f16 dequantise (``F16``,
    ``_dequant_rows``: bases 128 columns wide), e4m3 dots on the two-part B per step (``DIAG``,
    ``_mma_rows_diag``: 128 wide, B block-diagonal, ``_diag_operand``) or per 32 columns
    (``_mma_rows``: 32 wide); ``_k_cols`` gives the width."""
    if F16:
        acc = _dequant_rows(w_base, s_base, b_base, b_ok, k_beg, k_end, BLOCK_N, BLOCK_T, DOT_F32)
    elif DIAG:
        acc = _mma_rows_diag(w_base, s_base, b_base, stride_b_part, b_ok, k_beg, k_end, BLOCK_N, BLOCK_T, DOT_F32)
    else:
        acc = _mma_rows(w_base, s_base, b_base, stride_b_part, b_ok, k_beg, k_end, BLOCK_N, BLOCK_T, DOT_F32)
    return acc


@triton.jit
def _k_cols(F16: tl.constexpr, DIAG: tl.constexpr = False):
    """Column offsets of the bases ``_rows_product`` takes: 128 (the f16 and the block-diagonal
    forms) or 32 wide."""
    if F16 or DIAG:
        kk = tl.arange(0, 128)
    else:
        kk = tl.arange(0, 32)
    return kk


@triton.jit
def _diag_operand(ptr, stride_row, sorted_ptr, m0, end, TK, TOKENS: tl.constexpr, BT: tl.constexpr,
                  K: tl.constexpr = 1):
    """``(b_base [128, 4 BT], b_ok)``: the block-diagonal B operand of ``_mma_rows_diag`` for pairs
    ``[m0, min(m0 + BT, end))``, the rows of ``ptr`` (the pairs' token rows with ``TOKENS``, else
    their sorted positions). Column ``4t + b`` is pair ``t``'s row, kept on block ``b``'s 32
    columns only."""
    kk = tl.arange(0, 128)
    q = tl.arange(0, 4 * BT)
    rows = m0 + q // 4
    r_ok = rows < end
    if TOKENS:
        pair = tl.load(sorted_ptr + rows, mask=r_ok, other=0)
        rows = tl.where(pair < TK, pair // K, pair - TK)
    b_base = ptr + rows[None, :].to(tl.int64) * stride_row + kk[:, None]
    return b_base, r_ok[None, :] & ((kk[:, None] // 32) == (q % 4)[None, :])


@triton.jit
def _gate_up_pair_tile(xq_ptr, stride_xq_part, stride_xq_t, fx_ptr, w_base, s_base, sorted_ptr, h_base, stride_h,
                       m0, end, N, TK, k_beg, k_end, alpha, limit, cols, offs_n, K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BT: tl.constexpr, DOT_F32: tl.constexpr, F16: tl.constexpr,
                       ACT: tl.constexpr, DIAG: tl.constexpr):
    """Pairs ``[m0, min(m0 + BT, end))`` against a program's weight rows (``_gate_up_tiles``)."""
    kk = _k_cols(F16)
    rows = m0 + tl.arange(0, BT)
    r_ok = rows < end
    pair = tl.load(sorted_ptr + rows, mask=r_ok, other=0)
    tok = tl.where(pair < TK, pair // K, pair - TK)
    if DIAG:  # its 4 BT columns load the pair ids again (L1 hits) rather than reshape ``tok``'s layout
        b_base, b_ok = _diag_operand(xq_ptr, stride_xq_t, sorted_ptr, m0, end, TK, True, BT, K)
    else:
        b_base, b_ok = xq_ptr + tok[None, :].to(tl.int64) * stride_xq_t + kk[:, None], r_ok[None, :]
    acc = _rows_product(w_base, s_base, b_base, stride_xq_part, b_ok, k_beg, k_end, BLOCK_N, BT, DOT_F32, F16,
                        DIAG)
    if ACT:
        HALF: tl.constexpr = BLOCK_N // 2
        g, u = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BT)), (1, 2, 0)))
        tl.store(h_base + rows.to(tl.int64)[None, :] * stride_h + k_order_position(cols)[:, None],
                 swiglu_oai(g, u, alpha, limit).to(tl.float16), mask=r_ok[None, :] & (cols < N // 2)[:, None])
    else:
        if not F16:  # undo the row split's scale
            acc = acc * tl.load(fx_ptr + tok, mask=r_ok, other=0.0)[None, :]
        tl.store(h_base + rows.to(tl.int64)[None, :] * stride_h + offs_n[:, None], acc,
                 mask=r_ok[None, :] & (offs_n < N)[:, None])


@triton.jit
def _gate_up_tiles(xq_ptr, stride_xq_part, stride_xq_t, fx_ptr, w_ptr, stride_wn, s_ptr, stride_sn, sorted_ptr,
                   h_ptr, stride_h_split, stride_h, start, end, N, TK, H, k_per_split, alpha, limit,
                   K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr,
                   F16: tl.constexpr, ACT: tl.constexpr, TAIL_T: tl.constexpr, DIAG: tl.constexpr):
    """N-tile ``j % n_tiles`` of one expert's ``N`` gate/up rows over the pair tiles of
    ``[start, end)`` that fall to this program (an expert with fewer N-tiles than the grid
    hands its spare programs pair tiles, as in ``moe._gate_up_tiles``). ``TAIL_T`` (0: off): a
    tile of at most that many pairs left runs as a ``TAIL_T``-pair tile (an expert's last few
    pairs past a full tile no longer cost a full tile's dots).

    ``ACT`` (the f16 form, K unsplit): the tile's first half is gate rows ``c``, its second the
    matching up rows ``N / 2 + c``, and the epilogue stores SwiGLU-OAI of the sums as the f16
    activation in K order (``h_ptr`` the activation ``[P + T, >= N / 2]``): the same fp32 sums
    and maths as ``_moe_swiglu_split_kernel`` reading them back, without the fp32
    pre-activations' round trip through memory or a launch of its own."""
    j = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    groups = tl.num_programs(1) // n_tiles
    grp = j // n_tiles
    m_lo = tl.where(grp < groups, start + grp * BLOCK_T, end)
    offs_n = (j % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ACT:
        HALF: tl.constexpr = BLOCK_N // 2
        cols = (j % n_tiles) * HALF + tl.arange(0, HALF)  # activation columns: gate rows, and up rows N / 2 on
        r = tl.arange(0, BLOCK_N)
        # a partial last tile re-reads valid rows (discarded) instead of masking
        n_ld = ((j % n_tiles) * HALF + r % HALF) % (N // 2) + (r // HALF) * (N // 2)
    else:
        cols = offs_n
        n_ld = offs_n % N  # a partial last tile re-reads valid rows (discarded) instead of masking
    kk = _k_cols(F16, DIAG)
    k_beg = tl.multiple_of(tl.program_id(2) * k_per_split, 128)
    k_end = tl.minimum(H, k_beg + k_per_split)
    w_base = w_ptr + n_ld[:, None].to(tl.int64) * stride_wn + kk[None, :]
    s_base = s_ptr + n_ld[:, None].to(tl.int64) * stride_sn
    h_base = h_ptr + tl.program_id(2) * stride_h_split
    for m0 in range(m_lo, end, groups * BLOCK_T):
        if TAIL_T > 0:
            if end - m0 <= TAIL_T:
                _gate_up_pair_tile(xq_ptr, stride_xq_part, stride_xq_t, fx_ptr, w_base, s_base, sorted_ptr, h_base,
                                   stride_h, m0, end, N, TK, k_beg, k_end, alpha, limit, cols, offs_n, K, BLOCK_N,
                                   TAIL_T, DOT_F32, F16, ACT, DIAG)
            else:
                _gate_up_pair_tile(xq_ptr, stride_xq_part, stride_xq_t, fx_ptr, w_base, s_base, sorted_ptr, h_base,
                                   stride_h, m0, end, N, TK, k_beg, k_end, alpha, limit, cols, offs_n, K, BLOCK_N,
                                   BLOCK_T, DOT_F32, F16, ACT, DIAG)
        else:
            _gate_up_pair_tile(xq_ptr, stride_xq_part, stride_xq_t, fx_ptr, w_base, s_base, sorted_ptr, h_base,
                               stride_h, m0, end, N, TK, k_beg, k_end, alpha, limit, cols, offs_n, K, BLOCK_N,
                               BLOCK_T, DOT_F32, F16, ACT, DIAG)


@triton.jit(do_not_specialize=["T"])
def _moe_mma_gate_up_kernel(xq_ptr, stride_xq_part, stride_xq_t, fx_ptr,
                    w13_ptr, stride_w13_e, stride_w13_n, s13_ptr, stride_s13_e, stride_s13_n,
                    sgu_ptr, stride_sgu_n, ssgu_ptr, stride_ssgu_n,
                    sorted_ptr, off_ptr, h_ptr, stride_h_split, stride_h, T, H, I, IS, k_per_split, alpha, limit,
                    K: tl.constexpr, E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                    DOT_F32: tl.constexpr, F16: tl.constexpr = False, ACT: tl.constexpr = False,
                    TAIL_T: tl.constexpr = 0, DIAG: tl.constexpr = False):
    """``h[s, pos, n]`` for expert ``program_id(0)`` (``E``: the shared expert), or with ``ACT``
    the activation ``h[pos, c]`` (``_gate_up_tiles``)."""
    e = tl.program_id(0)
    start = tl.load(off_ptr + e)
    end = tl.load(off_ptr + e + 1)
    if e < E:
        _gate_up_tiles(xq_ptr, stride_xq_part, stride_xq_t, fx_ptr, w13_ptr + e.to(tl.int64) * stride_w13_e,
                       stride_w13_n, s13_ptr + e.to(tl.int64) * stride_s13_e, stride_s13_n, sorted_ptr, h_ptr,
                       stride_h_split, stride_h, start, end, 2 * I, T * K, H, k_per_split, alpha, limit, K, BLOCK_N,
                       BLOCK_T, DOT_F32, F16, ACT, TAIL_T, DIAG)
    else:
        _gate_up_tiles(xq_ptr, stride_xq_part, stride_xq_t, fx_ptr, sgu_ptr, stride_sgu_n, ssgu_ptr, stride_ssgu_n,
                       sorted_ptr, h_ptr, stride_h_split, stride_h, start, end, 2 * IS, T * K, H, k_per_split, alpha,
                       limit, K, BLOCK_N, BLOCK_T, DOT_F32, F16, ACT, TAIL_T, DIAG)


@triton.jit
def _down_pair_tile(aq_ptr, stride_aq_part, stride_aq, fa_ptr, w_base, s_base, topk_w_ptr, sorted_ptr, y_base,
                    stride_y, m0, end, TK, H, k_beg, k_end, offs_h, BLOCK_N: tl.constexpr, BT: tl.constexpr,
                    DOT_F32: tl.constexpr, F16: tl.constexpr, DIAG: tl.constexpr):
    """Pairs ``[m0, min(m0 + BT, end))`` against a program's down rows (``_moe_mma_down_kernel``)."""
    kk = _k_cols(F16)
    rows = m0 + tl.arange(0, BT)
    r_ok = rows < end
    pair = tl.load(sorted_ptr + rows, mask=r_ok, other=0)
    is_routed = pair < TK
    wt = tl.where(is_routed, tl.load(topk_w_ptr + pair, mask=r_ok & is_routed, other=0.0), 1.0)
    if DIAG:
        b_base, b_ok = _diag_operand(aq_ptr, stride_aq, sorted_ptr, m0, end, TK, False, BT)
    else:
        b_base, b_ok = aq_ptr + rows.to(tl.int64)[None, :] * stride_aq + kk[:, None], r_ok[None, :]
    acc = _rows_product(w_base, s_base, b_base, stride_aq_part, b_ok, k_beg, k_end, BLOCK_N, BT, DOT_F32, F16,
                        DIAG)
    if not F16:  # undo the row split's scale
        wt = wt * tl.load(fa_ptr + rows, mask=r_ok, other=0.0)
    acc = acc * wt[None, :]
    tl.store(y_base + rows.to(tl.int64)[None, :] * stride_y + offs_h[:, None], acc,
             mask=r_ok[None, :] & (offs_h < H)[:, None])


@triton.jit(do_not_specialize=["T"])
def _moe_mma_down_kernel(aq_ptr, stride_aq_part, stride_aq, fa_ptr,
                 w2_ptr, stride_w2_e, stride_w2_h, s2_ptr, stride_s2_e, stride_s2_h,
                 sd_ptr, stride_sd_h, ssd_ptr, stride_ssd_h,
                 topk_w_ptr, sorted_ptr, off_ptr, y_ptr, stride_y_split, stride_y, T, H, I, IS, k_per_split,
                 K: tl.constexpr, E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                 DOT_F32: tl.constexpr, F16: tl.constexpr = False, TAIL_T: tl.constexpr = 0,
                 DIAG: tl.constexpr = False):
    """``y[s, pos, h] = w_pair * fa[pos] * sum_k W2_e[h, k] aq[pos, k]`` over K-range ``s`` of
    the expert's I (Is for the shared expert, whose pairs weigh 1), one H-tile; ``TAIL_T`` as in
    ``_gate_up_tiles``."""
    e = tl.program_id(0)
    start = tl.load(off_ptr + e)
    end = tl.load(off_ptr + e + 1)
    KD, w_ptr, stride_wh, s_ptr, stride_sh = down_weights(e, E, I, IS, w2_ptr, stride_w2_e, stride_w2_h, s2_ptr,
                                                         stride_s2_e, stride_s2_h, sd_ptr, stride_sd_h, ssd_ptr,
                                                         stride_ssd_h)
    offs_h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ld = offs_h % H
    kk = _k_cols(F16, DIAG)
    k_beg = tl.multiple_of(tl.program_id(2) * k_per_split, 128)
    k_end = tl.minimum(KD, k_beg + k_per_split)  # may be empty (the shared expert's short K): zeros
    w_base = w_ptr + h_ld[:, None].to(tl.int64) * stride_wh + kk[None, :]
    s_base = s_ptr + h_ld[:, None].to(tl.int64) * stride_sh
    y_base = y_ptr + tl.program_id(2) * stride_y_split
    for m0 in range(start, end, BLOCK_T):
        if TAIL_T > 0:
            if end - m0 <= TAIL_T:
                _down_pair_tile(aq_ptr, stride_aq_part, stride_aq, fa_ptr, w_base, s_base, topk_w_ptr, sorted_ptr,
                                y_base, stride_y, m0, end, T * K, H, k_beg, k_end, offs_h, BLOCK_N, TAIL_T, DOT_F32,
                                F16, DIAG)
            else:
                _down_pair_tile(aq_ptr, stride_aq_part, stride_aq, fa_ptr, w_base, s_base, topk_w_ptr, sorted_ptr,
                                y_base, stride_y, m0, end, T * K, H, k_beg, k_end, offs_h, BLOCK_N, BLOCK_T, DOT_F32,
                                F16, DIAG)
        else:
            _down_pair_tile(aq_ptr, stride_aq_part, stride_aq, fa_ptr, w_base, s_base, topk_w_ptr, sorted_ptr, y_base,
                            stride_y, m0, end, T * K, H, k_beg, k_end, offs_h, BLOCK_N, BLOCK_T, DOT_F32, F16,
                            DIAG)


def _k_per_split(k: int, split: int) -> int:
    """Columns per split of a K of ``k``: whole K steps, every split but the last full."""
    return triton.cdiv(triton.cdiv(k, MMA_BLOCK_K), split) * MMA_BLOCK_K


def experts_fp8_mma(x: Tensor, topk_w: Tensor, w13: Tensor, w2: Tensor, shared_gate_up: Tensor, shared_down: Tensor,
                    scales: tuple[Tensor, Tensor, Tensor, Tensor], alpha: float, limit: float, off: Tensor,
                    sorted_pairs: Tensor, K: int, block_n: int, block_t: int, split: int, num_stages: int,
                    f16: bool = False, num_warps: int = 4, act_in_gate_up: bool = True, tail_t: int = 0,
                    max_regs: int = 255, diag: bool = False) -> Tensor:
    """The per-pair expert outputs ``y [split, P + T, H]`` fp32 (weighted, splits unsummed) of the
    sorted pairs ``(off, sorted_pairs)`` of ``moe_align``; ``moe.fused_moe`` combines them.
    Shapes as ``moe.fused_moe``'s (checked there), fitting ``fits_fp8_mma``. ``f16``: the
    weights dequantised to f16 in registers against f16 rows (``_dequant_rows``; scales within
    ``moe.scales_fit_f16``), instead of e4m3 dots on two-part rows; then with K unsplit (``split``
    1) the gate/up kernel applies the activation in its epilogue, unless ``act_in_gate_up`` is
    False (the SwiGLU kernel then reads the fp32 sums back: the same results, for the tests).
    ``tail_t`` (0: off): an expert's last tile of at most that many pairs runs as a tile of
    ``tail_t`` pairs, not ``block_t`` (``MoEConfig.mma_tail_t``). ``max_regs`` (255: none): the
    two GEMM kernels' register cap per thread (``MoEConfig.mma_max_regs``; the interpreter has no
    registers to cap). ``diag``: e4m3 dots of K = 128 against the rows laid out block-diagonally
    (``_mma_rows_diag``, ``MoEConfig.mma_diag``; not with ``f16``)."""
    T, H = x.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    Is = shared_gate_up.shape[0] // 2
    P = T * K
    dev = x.device
    dot_f32 = interpreting()
    s13, s2, ssgu, ssd = (scale_words(s) for s in scales)
    if f16:
        xq, fx = permute_k(x)[None], x  # fx unread
    else:
        xq, fx = split_rows(x)
    width = max(I, Is)
    # the f16 form with K unsplit applies SwiGLU-OAI in the gate/up kernel's epilogue (``ACT``);
    # K split over programs needs the splits' fp32 sums first, in the SwiGLU kernel
    act = f16 and split == 1 and act_in_gate_up
    launch: dict[str, int] = dict(num_warps=num_warps, num_stages=num_stages)
    if max_regs < 255 and not interpreting():
        launch["maxnreg"] = max_regs
    if act:
        aq = torch.empty(1, P + T, width, dtype=torch.float16, device=dev)
        out, fa = aq[0], fx  # fa unread
    else:
        out = torch.empty(split, P + T, 2 * width, dtype=torch.float32, device=dev)
    _moe_mma_gate_up_kernel[(E + 1, triton.cdiv(2 * width, block_n), split)](
        xq, xq.stride(0), xq.stride(1), fx,
        w13, w13.stride(0), w13.stride(1), s13, s13.stride(0), s13.stride(1),
        shared_gate_up, shared_gate_up.stride(0), ssgu, ssgu.stride(0),
        sorted_pairs, off, out, out.stride(0) if not act else 0, out.stride(-2), T, H, I, Is, _k_per_split(H, split),
        float(alpha), float(limit), K=K, E=E, BLOCK_N=block_n, BLOCK_T=block_t, DOT_F32=dot_f32, F16=f16, ACT=act,
        TAIL_T=tail_t, DIAG=diag, **launch)
    if not act:
        aq, fa = swiglu_split(out, off, E, I, Is, alpha, limit, f16)
    y = torch.empty(split, P + T, H, dtype=torch.float32, device=dev)
    _moe_mma_down_kernel[(E + 1, triton.cdiv(H, block_n), split)](
        aq, aq.stride(0), aq.stride(1), fa,
        w2, w2.stride(0), w2.stride(1), s2, s2.stride(0), s2.stride(1),
        shared_down, shared_down.stride(0), ssd, ssd.stride(0),
        topk_w, sorted_pairs, off, y, y.stride(0), y.stride(1), T, H, I, Is, _k_per_split(width, split),
        K=K, E=E, BLOCK_N=block_n, BLOCK_T=block_t, DOT_F32=dot_f32, F16=f16, TAIL_T=tail_t, DIAG=diag, **launch)
    return y


__all__ = ["MMA_BLOCK_K", "experts_fp8_mma", "fits_fp8_mma", "split_rows", "swiglu_split"]
