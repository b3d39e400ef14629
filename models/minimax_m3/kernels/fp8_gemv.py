"""The weight-row form of an MXFP8 product for a few activation rows (decode): ``acc[t, n] =
sum_k x[t, k] * dequant(w[n, k])`` with no ``tl.dot``, shared by the fp8 linear (one or two
rows) and the fused MoE (a few tokens).

Why not the tensor cores here: a one-token product pads the token to a 16-row tile, and the
weight tile must go global -> shared -> registers (dequantise) -> shared -> wgmma, a chain whose
waits, not the bytes, set the time (qkv at T=1: 11.7 us for 9.7 MB, 0.8 TB/s). Here each step
loads a ``[BLOCK_N, BLOCK_K]`` fp8 tile (pipelined: asynchronous copies into shared memory),
dequantises it in registers (convert, times the block's scale) and multiplies it into fp32
accumulators of the same shape, one per activation row; the sum over K happens once, after the
loop. Per weight that is a convert, a multiply and an FMA per row, well within what the SMs
issue while the weights stream. H200, graph replay over weight sets that do not fit L2,
rank-of-8 shapes (``benchmarks/results/mxfp8_round6/``): qkv 1536 x 6144 at T=1 5.7 us (the
tile kernels' best 11.7, bf16 cuBLAS 9.3), an expert's gate/up 6144 x 6144 14.1 us (2.8 TB/s;
the tile kernel 23.5).

The scales are read as int32 words of four E8M0 bytes (``fp8_tiles.scale_words``): one-byte
scale loads are not pipelined by Triton and would wait a full memory latency every step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_tiles import scale_factor


@triton.jit
def gemv_rows(x0_ptr, x1_ptr, x1_ok, w_rows, s_rows, k_len, TWO: tl.constexpr, BLOCK_K: tl.constexpr,
              NUM_STAGES: tl.constexpr):
    """``(acc0, acc1)``, each ``[BN]`` fp32: the activation row at ``x0_ptr`` (and with ``TWO``
    the one at ``x1_ptr``, read as 0 unless ``x1_ok``) times the fp8 weight rows ``w_rows``
    (``[BN]`` pointers) dequantised with their scale words ``s_rows`` (``[BN]`` int32 pointers,
    four E8M0 bytes a word), over columns ``[0, k_len)``; ``k_len`` a multiple of ``BLOCK_K``,
    itself a multiple of 128 (whole scale words). Without ``TWO`` ``acc1`` is zeros.

    One ``[BN, BLOCK_K]`` accumulator per row, each row's activations a ``[BLOCK_K]`` vector
    broadcast over the weight rows: a third, row axis (``[rows, BN, BLOCK_K]``) made Triton
    shuffle layouts inside the loop and ran 1.6-1.8x slower on the H200 (an expert's gate/up
    at one row: 23-25 us against 14)."""
    BN: tl.constexpr = w_rows.shape[0]
    NB: tl.constexpr = BLOCK_K // 32
    kk = tl.arange(0, BLOCK_K)
    blk = tl.arange(0, NB)
    acc0 = tl.zeros([BN, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BN, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k_len, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_rows[:, None] + k0 + kk[None, :])  # [BN, BLOCK_K] fp8
        words = tl.load(s_rows[:, None] + k0 // 128 + blk[None, :] // 4)  # [BN, NB]: a word per 4 blocks
        f = scale_factor((words >> ((blk[None, :] % 4) * 8)) & 0xFF, False)
        wf = w.to(tl.float32) * tl.reshape(tl.broadcast_to(f[:, :, None], (BN, NB, 32)), (BN, BLOCK_K))
        acc0 += wf * tl.load(x0_ptr + k0 + kk).to(tl.float32)[None, :]
        if TWO:
            acc1 += wf * tl.load(x1_ptr + k0 + kk, mask=(kk < BLOCK_K) & x1_ok, other=0.0).to(tl.float32)[None, :]
    return tl.sum(acc0, axis=1), tl.sum(acc1, axis=1)


__all__ = ["gemv_rows"]
