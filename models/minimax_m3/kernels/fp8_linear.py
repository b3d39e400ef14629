"""A linear layer on MXFP8 weights: ``y = x @ dequant(w, s)^T``, the weight read as fp8 (half
the bytes of bf16) and dequantised in registers, for the projections of an MXFP8 model. The
fused op table's ``linear`` (``ops.FusedLinear``: qkv_proj and o_proj) runs it at the row counts
where the tuner validated it against ``mxfp8.MXFP8Linear``'s dequantise + ``F.linear`` and timed
it faster; ``benchmarks/bench_mxfp8_linear.py`` measures it against that and against bf16.

One program per (N-tile, M-tile, K-split): the x tile ``[BLOCK_M, BLOCK_K]``, the weight tile
``[BLOCK_K, BLOCK_N]`` in fp8 with one E8M0 byte per 32 of its K columns (loaded once per 32
and broadcast), ``tl.dot`` with fp32 accumulation. At decode (a few rows) the weight is the
whole cost and ``N / BLOCK_N`` programs are too few to keep HBM busy, so K is split over
``split_k`` programs that write fp32 partial sums; a second kernel adds them in split order and
casts (no atomics: a graph replay equals an eager run bit for bit).

At one or two rows (``GEMV_MAX_TOKENS``) ``GemvConfig`` runs the weight-row form instead
(``fp8_gemv``: no dot, fp32 accumulators per row, the sum over K once at the end), which streams
the weight about twice as fast there (qkv T=1 on the H200: 5.7 us against 11.7).

At prefill sizes the weight tile is dequantised once per M-tile, which costs more than the bytes
saved; ``dequantized_linear`` is the other candidate there: one elementwise kernel writes the
bf16 weight (fp8 + scales in, bf16 out), then ``F.linear`` (cuBLAS). At T=1054 on the H200 that
takes qkv 36.6 us and o_proj 32.9 us against bf16's 26.3 and 22.0 (the fp8 kernel: 89.7, 46.7).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attention.kernels.pdl import grid_dependency, pdl_launch
from attention.kernels.triton_utils import check_device, check_tile_config, interpreting
from models.minimax_m3.mxfp8 import BLOCK as MX_BLOCK
from models.minimax_m3.mxfp8 import FP8

from .fp8_gemv import gemv_rows
from .fp8_tiles import block_scale_factors, scale_words

Tensor = torch.Tensor


@dataclass(frozen=True)
class LinearConfig:
    """Tiles of ``mxfp8_linear``: ``block_k`` a multiple of 32 (the scale block); ``split_k``
    programs share each output tile's K range (1: no second pass)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        check_tile_config(self, ("block_m", "block_n", "block_k"))
        if self.block_k % MX_BLOCK:
            raise ValueError(f"LinearConfig.block_k must be a multiple of {MX_BLOCK} (the scale block), "
                             f"got {self.block_k}")


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the weight-row form (``fp8_gemv.gemv_rows``), offered at up to
    ``GEMV_MAX_TOKENS`` rows: ``block_n`` weight rows per program, ``block_k`` columns per step (a power of two,
    a multiple of 128: whole scale words, and a divisor of K: no masked steps)."""

    block_n: int = 4
    block_k: int = 512
    num_warps: int = 2
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
        if self.block_k % 128:
            raise ValueError(f"GemvConfig.block_k must be a multiple of 128 (whole scale words), got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8) or self.num_stages < 1:
            raise ValueError(f"GemvConfig: num_warps one of 1, 2, 4, 8 and num_stages >= 1, got {self.num_warps}, "
                             f"{self.num_stages}")


GEMV_MAX_TOKENS = 2  # rows the weight-row form is offered at (one fp32 accumulator tile per row)
# The H200's best weight-row tiles at the rank-of-8 projections (T = 1 and 2; qkv, o_proj, an
# expert's gate/up and down): narrow row sets, 256-1024 columns a step, 64-128 threads.
_GEMV_TILES = ((2, 1024, 2), (4, 512, 2), (8, 256, 2), (16, 512, 4), (16, 256, 4))


def gemv_config_candidates(num_tokens: int, k: int) -> list[GemvConfig]:
    """The weight-row tiles that run ``num_tokens`` rows over a K of ``k`` (none above
    ``GEMV_MAX_TOKENS`` rows or where no step divides K)."""
    if num_tokens > GEMV_MAX_TOKENS:
        return []
    return [GemvConfig(block_n=n, block_k=bk, num_warps=w) for n, bk, w in _GEMV_TILES if k % bk == 0]


DECODE_MAX_TOKENS = 64  # above: prefill tiles, and dequantising first is a candidate
_PROGRAMS_WANTED = 264  # two waves of the H200's 132 SMs


def default_linear_config(num_tokens: int, n: int, k: int) -> LinearConfig:
    """Decode: 16-row tiles and K split until about two programs per SM; prefill: 64-row tiles
    (one wgmma warpgroup), no split."""
    if num_tokens > DECODE_MAX_TOKENS:
        return LinearConfig(block_m=64, block_n=128, block_k=64, split_k=1, num_warps=4, num_stages=4)
    return _split_to_fill(LinearConfig(), num_tokens, n, k)


def linear_config_candidates(num_tokens: int, n: int, k: int) -> list[LinearConfig]:
    """The default first, then larger steps per program: an fp8 tile holds half the bytes of
    the bf16 one of the same shape, and at decode each step's dequantise and layout shuffles
    sit in every program's serial chain, so fewer, fuller steps may keep HBM busier. Above 16
    rows also tiles of all the rows (32 or 64): in 60-layer steps the H100 tuner took them for
    every projection at T=64 and all but one at T=32 (alone, T=64, us: qkv 23.1 -> 17.0, o_proj
    14.3 -> 12.7, dense gate/up 35.1 -> 24.6, down 19.8 -> 15.7; BENCHMARKS.md, MXFP8 fifteenth
    round)."""
    base = default_linear_config(num_tokens, n, k)
    if num_tokens > DECODE_MAX_TOKENS:
        return [base, LinearConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)]
    out = [base]
    for block_n, block_k, warps in ((64, 512, 8), (128, 256, 8), (32, 512, 4)):
        out.append(_split_to_fill(LinearConfig(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=3),
                                  num_tokens, n, k))
    if num_tokens > 16:
        # All the step's rows in one M-tile: 16-row tiles dequantise (and read from L2) each
        # weight tile once per 16 rows, which at 64 rows is 4 times.
        bm = min(64, triton.next_power_of_2(num_tokens))
        for block_n, block_k, warps in ((64, 256, 4), (128, 128, 8)):
            out.append(_split_to_fill(LinearConfig(block_m=bm, block_n=block_n, block_k=block_k, num_warps=warps,
                                                   num_stages=3), num_tokens, n, k))
    return out


def _split_to_fill(cfg: LinearConfig, num_tokens: int, n: int, k: int) -> LinearConfig:
    """``cfg`` with K split until about ``_PROGRAMS_WANTED`` programs run (at least one K step each)."""
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(num_tokens, cfg.block_m)
    return replace(cfg, split_k=max(1, min(k // cfg.block_k, _PROGRAMS_WANTED // max(tiles, 1))))


@triton.jit(do_not_specialize=["T"])
def _mxfp8_linear_kernel(x_ptr, stride_x, w_ptr, stride_w, s_ptr, stride_s, out_ptr, stride_out_split, stride_out,
                         T, N, K, k_per_split,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN: tl.constexpr, DOT_F32: tl.constexpr, S_WORDS: tl.constexpr = False,
                         PDL: tl.constexpr = 0):
    """out[split, rows, cols] = x[rows, K-range] @ dequant(w[cols, K-range])^T (fp32 when split,
    else out's dtype). ``S_WORDS``: ``s_ptr`` and ``stride_s`` are in int32 words of four scale
    bytes (``fp8_tiles.scale_words``)."""
    grid_dependency(PDL)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    r_ok, c_ok = rows < T, cols < N
    c_ld = cols % N  # a partial last tile re-reads valid rows (discarded) instead of masking
    offs_k = tl.arange(0, BLOCK_K)
    # k_per_split is whole BLOCK_K steps: telling the compiler keeps the loads aligned, so they
    # stream through asynchronous copies (without it they went one byte at a time, synchronously)
    k_lo = tl.multiple_of(split * k_per_split, BLOCK_K)
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_x + k_lo + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_base = w_ptr + c_ld.to(tl.int64)[None, :] * stride_w + k_lo + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    s_base = s_ptr + c_ld.to(tl.int64)[None, :] * stride_s  # each column's scale row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if EVEN:
            xa = tl.load(x_base + k0, mask=r_ok[:, None], other=0.0)
            w = tl.load(w_base + k0)
            f = block_scale_factors(s_base, k_lo + k0, K, BLOCK_K, BLOCK_N, False, S_WORDS, False)
        else:
            k_ok = offs_k + k0 + k_lo < K
            xa = tl.load(x_base + k0, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + k0, mask=k_ok[:, None], other=0.0)
            # K is a multiple of 32: blocks mask exactly (per-element scale loads, 4-byte words
            # pipelined into shared memory, asked for 300-400 KB of it on the H200)
            f = block_scale_factors(s_base, k_lo + k0, K, BLOCK_K, BLOCK_N, False, S_WORDS, True)
        wd = w.to(tl.float32) * f
        if DOT_F32:
            acc = tl.dot(xa.to(tl.float32), wd, acc, input_precision="ieee")
        else:
            acc = tl.dot(xa, wd.to(xa.dtype), acc)
    tl.store(out_ptr + split.to(tl.int64) * stride_out_split + rows.to(tl.int64)[:, None] * stride_out
             + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _gemv_linear_kernel(x_ptr, stride_x, w_ptr, stride_w, s_ptr, stride_s, out_ptr, stride_out, T, N, K,
                        TWO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                        PDL: tl.constexpr = 0):
    """out[t, cols] = x[t] @ dequant(w[cols])^T for the rows ``t`` of this program (axis 1: one,
    or with ``TWO`` two rows a program), ``BLOCK_N`` weight rows per program (``stride_s`` in
    int32 scale words)."""
    grid_dependency(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ld = (cols % N).to(tl.int64)  # a partial last tile re-reads valid rows (not stored)
    t0 = tl.program_id(1) * (2 if TWO else 1)
    t1 = t0 + 1
    acc0, acc1 = gemv_rows(x_ptr + t0.to(tl.int64) * stride_x, x_ptr + t1.to(tl.int64) * stride_x, t1 < T,
                           w_ptr + c_ld * stride_w, s_ptr + c_ld * stride_s, K, TWO, BLOCK_K, NUM_STAGES)
    c_ok = cols < N
    tl.store(out_ptr + t0.to(tl.int64) * stride_out + cols, acc0.to(out_ptr.dtype.element_ty), mask=c_ok)
    if TWO:
        tl.store(out_ptr + t1.to(tl.int64) * stride_out + cols, acc1.to(out_ptr.dtype.element_ty), mask=c_ok & (t1 < T))


@triton.jit(do_not_specialize=["T"])
def _split_sum_kernel(part_ptr, stride_split, out_ptr, T, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = 0):
    """out[t, n] = sum over splits (in split order) of part[s, t, n]."""
    grid_dependency(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < T * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * stride_split + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def split_plan(k: int, cfg: LinearConfig) -> tuple[int, int, bool]:
    """``(splits, columns per split, even)`` of a K of ``k`` under ``cfg``: at most
    ``cfg.split_k`` splits of whole K steps, their count a divisor of the steps so that every
    split is full and the K loop needs no masks (``even``) whenever ``block_k`` divides K (the
    masked loop is for other shapes only: a split that did not divide K sent the dense MLP's
    down projection, K = 1536, there at decode)."""
    steps = triton.cdiv(k, cfg.block_k)
    split = max(d for d in range(1, min(cfg.split_k, steps) + 1) if steps % d == 0)
    k_per_split = steps // split * cfg.block_k
    return split, k_per_split, k % k_per_split == 0


def mxfp8_linear(x: Tensor, weight: Tensor, scale_inv: Tensor, out: Tensor | None = None,
                 config: LinearConfig | GemvConfig | None = None) -> Tensor:
    """``x [T, K] @ dequant(weight [N, K], scale_inv [N, K/32])^T -> out [T, N]`` in x's dtype;
    graph-capturable (grids from shapes, scratch from shapes). ``config``: the tiles
    (``LinearConfig``) or the weight-row form (``GemvConfig``: any T, offered by
    ``gemv_config_candidates`` at ``GEMV_MAX_TOKENS`` rows at most).

    Raises:
        ValueError: shapes, dtypes or strides that do not match, or a ``GemvConfig`` that cannot
            run them.
    """
    check_device("mxfp8_linear", x, weight, scale_inv)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with contiguous rows, got {tuple(x.shape)}")
    t, k = x.shape
    if weight.dtype != FP8 or weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be fp8 e4m3 [N, K={k}] with contiguous rows, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n = weight.shape[0]
    if k % MX_BLOCK or scale_inv.dtype != torch.uint8 or tuple(scale_inv.shape) != (n, k // MX_BLOCK) \
            or scale_inv.stride(1) != 1:
        raise ValueError(f"scale_inv must be uint8 [N={n}, K/32={k // MX_BLOCK}] (K a multiple of 32), got "
                         f"{scale_inv.dtype} {tuple(scale_inv.shape)}")
    if out is None:
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (t, n) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [T={t}, N={n}], got {tuple(out.shape)}")
    if t == 0:
        return out
    if isinstance(config, GemvConfig):
        _gemv_linear(x, weight, scale_inv, out, config)
        return out
    cfg = config or default_linear_config(t, n, k)
    split, k_per_split, even = split_plan(k, cfg)
    dot_f32 = interpreting() or x.dtype == torch.float32
    target = out if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(t, cfg.block_m), split)
    words = scale_words(scale_inv)  # pipelined scale loads where the layout allows (fp8_tiles)
    scales = scale_inv if words is None else words
    _mxfp8_linear_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), scales, scales.stride(0), target,
        0 if split == 1 else target.stride(0), n, t, n, k, k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN=even, DOT_F32=dot_f32,
        S_WORDS=words is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device))
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(t * n, block),)](target, target.stride(0), out, t, n, SPLIT=split,
                                                         BLOCK=block, **pdl_launch(x.device))
    return out


def _gemv_linear(x: Tensor, weight: Tensor, scale_inv: Tensor, out: Tensor, cfg: GemvConfig) -> None:
    """The weight-row form: one row per program at T = 1, two otherwise (more rows re-read the
    weights per pair of rows: correct at any T, offered at ``GEMV_MAX_TOKENS`` at most)."""
    t, k = x.shape
    n = weight.shape[0]
    words = scale_words(scale_inv)
    if k % cfg.block_k or words is None:
        raise ValueError(f"GemvConfig runs a K that its block_k divides, with scales readable as int32 words "
                         f"(fp8_tiles.scale_words); got K={k}, block_k={cfg.block_k}: pick a LinearConfig")
    two = t > 1
    _gemv_linear_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(t, 2 if two else 1))](
        x, x.stride(0), weight, weight.stride(0), words, words.stride(0), out, out.stride(0), t, n, k,
        TWO=two, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
        **pdl_launch(x.device))


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out[r, c] = dequant(w[r, c], s[r, c // 32])`` over ``BLOCK_R`` rows x ``BLOCK_C`` columns
    of the ``[N, K]`` weight, held K first (``[BLOCK_C, BLOCK_R]``) as ``block_scale_factors``
    gives a tile's factors: one scale load per 32 columns, broadcast. Two-dimensional so that no
    element divides a flat int64 index by K (the flat form spent ~20 us on a 9 MB weight, H200)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ld = (r % N).to(tl.int64)[None, :]  # a partial last tile re-reads valid rows (not stored)
    ok = (c < K)[:, None] & (r < N)[None, :]
    offs = r_ld * K + c[:, None]
    q = tl.load(w_ptr + offs, mask=ok, other=0.0)
    f = block_scale_factors(s_ptr + r_ld * (K // 32), tl.program_id(1) * BLOCK_C, K, BLOCK_C, BLOCK_R, False, False,
                            True)
    tl.store(out_ptr + offs, (q.to(tl.float32) * f).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_mxfp8_triton(weight: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    """``mxfp8.dequantize_mxfp8`` in one launch: contiguous fp8 ``[N, K]`` and uint8 ``[N, K/32]``
    -> ``[N, K]`` in ``dtype`` (exact: the same power-of-two products)."""
    check_device("dequantize_mxfp8_triton", weight, scale_inv)
    n, k = weight.shape
    if weight.dtype != FP8 or not weight.is_contiguous() or k % MX_BLOCK:
        raise ValueError(f"weight must be contiguous fp8 e4m3 [N, K] with K a multiple of {MX_BLOCK}, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if scale_inv.dtype != torch.uint8 or tuple(scale_inv.shape) != (n, k // MX_BLOCK) or not scale_inv.is_contiguous():
        raise ValueError(f"scale_inv must be contiguous uint8 [N={n}, K/32={k // MX_BLOCK}], got {scale_inv.dtype} "
                         f"{tuple(scale_inv.shape)}")
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    block_r, block_c = 16, 256
    _dequantize_kernel[(triton.cdiv(n, block_r), triton.cdiv(k, block_c))](weight, scale_inv, out, n, k,
                                                                            BLOCK_R=block_r, BLOCK_C=block_c,
                                                                            num_warps=4)
    return out


def dequantized_linear(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """``F.linear(x, dequantize_mxfp8_triton(weight, scale_inv, x.dtype))``: the prefill candidate
    (the bf16 weight lives only for this call)."""
    return F.linear(x, dequantize_mxfp8_triton(weight, scale_inv, x.dtype))


__all__ = ["GEMV_MAX_TOKENS", "GemvConfig", "LinearConfig", "default_linear_config", "dequantize_mxfp8_triton",
           "dequantized_linear", "gemv_config_candidates", "linear_config_candidates", "mxfp8_linear", "split_plan"]
