"""Fused MoE of one rank: its routed experts plus the shared expert, SwiGLU-OAI, bf16 in/out.

Maths (fp32 accumulation throughout)::

    out[t] = sum_k w[t, k] * FFN_{ids[t, k]}(x[t]) + FFN_shared(x[t])
    FFN(x) = down(act(gate x, up x))
    act(g, u) = min(g, L) * sigmoid(alpha * min(g, L)) * (clamp(u, -L, L) + 1)

``act`` is computed in fp32 from the fp32 accumulators and rounded to ``x.dtype`` before the
down projection; the weighted combine is summed in fp32 and stored in ``out.dtype``. Pairs
whose id is ``-1`` (routed to another rank, or a padded row) are dropped; every row gets the
shared expert.

"Sorted pairs" design, four launches, so each expert's weights are read once per M-tile of the
pairs routed to it (once per step at decode) and never for an expert with no pairs:

1. ``moe_align`` (one program per chunk of pairs, after per-chunk histograms where there are
   several chunks; a decode step's one chunk counts its own pairs, or the router's last top-k
   program does: ``aligned``): per-expert pair counts and offsets, the pair ids in expert
   order (routed pair ``p = t*K + k``, shared pair ``p = T*K + t``; the shared expert is expert
   ``E`` and holds every row), and each pair's sorted position (``-1`` when dropped). Ranks are
   running sums in pair order, so the order is stable and the same every run.
2. ``_moe_gate_up_kernel``, grid ``(E + 1, max(cdiv(I, BLOCK_N), cdiv(Is, BLOCK_N_SHARED)),
   m_split)``: gathers the x rows of an M-tile of the expert's pairs, two ``tl.dot`` s over H
   (gate and up rows of the same N-tile), the SwiGLU-OAI epilogue, ``act`` rows stored at the
   pairs' sorted positions in ``act [T*K + T, max(I, Is)]``. Programs of an expert with no pairs
   return at once; the spare N-tile programs of the shared expert (Is < I) take some of its
   M-tiles instead of idling.
3. ``_moe_down_kernel``, grid ``(E + 1, cdiv(H, BLOCK_H), m_split)``:
   ``y[pos] = w_pair * (act[pos] @ w2[e]^T)`` in fp32 (shared pairs weigh 1).
4. ``_moe_combine_kernel``, grid ``(T, cdiv(H, BLOCK))``: ``out[t] = sum_k y[pos(t, k)] +
   y[pos(shared, t)]`` in that fixed order.

No atomics anywhere, and every output element is produced by exactly one program with a fixed
reduction order, so a CUDA-graph replay is bit-identical to an eager run of the same shapes.
Graph-safe: grids depend on T and the weight shapes only; per-expert work (how many M-tiles,
whether any) is read from the device inside the kernels, and the scratch is allocated from
shapes (allocation under capture uses the graph's pool).

MXFP8 weights run these kernels dequantising in registers, or (``MoEConfig.fp8_mma``) the
weight-row GEMMs of ``moe_fp8_mma`` (fp8 tensor-core dots, or with ``mma_f16`` the weights
dequantised as wgmma's register operand), or at a few tokens (``MoEConfig.gemv``) the
weight-row products of ``moe_gemv`` (no dot), between the same align and combine launches.

``fused_moe_torch`` is the same function in plain torch: the reference the kernels are tested
against, and the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attention.kernels.pdl import grid_dependency, pdl_launch
from attention.kernels.triton_utils import check_device, check_tile_config, interpreting, next_pow2
from models.minimax_m3.layers import swiglu_oai_f32
from models.minimax_m3.mxfp8 import BLOCK as MX_BLOCK
from models.minimax_m3.mxfp8 import FP8, dequantize_mxfp8

from .activation import swiglu_oai
from .fp8_tiles import F16_SCALE_EXPONENTS, block_scale_factors, scale_words
from .moe_align import MoEAlignment, moe_align
from .moe_experts import down_weights
from .moe_fp8_mma import MMA_BLOCK_K, experts_fp8_mma, fits_fp8_mma
from .moe_gemv import GEMV_MAX_TOKENS, experts_gemv

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class MoEConfig:
    """Tile shapes and launch options of the fused MoE kernels.

    Attributes:
        block_m: pairs per M-tile (both GEMM kernels; the sorted pairs are packed, not padded
            per expert, so any power of two >= 16 works).
        gu_block_n: gate/up N-tile width of the routed experts (columns of I; the same for
            gate and up).
        gu_block_n_shared: the same for the shared expert. At decode it is often the only
            expert with pairs on this rank (at rank-of-8 a token routes none of its 4 experts
            here 58% of the time), so its 2*Is rows want narrow tiles to spread over programs.
        gu_block_k: gate/up step over H.
        gu_num_warps, gu_num_stages: gate/up launch options.
        down_block_h: down N-tile width (columns of H).
        down_block_k: down step over I (and Is).
        down_num_warps, down_num_stages: down launch options.
        m_split: programs per (expert, N-tile) splitting that expert's M-tiles (prefill: a hot
            expert or the shared expert's T rows would otherwise run serially in one program).
        combine_block: columns of H per combine program.
        fp8_f16: MXFP8 weights only (ignored for bf16 ones): dequantise to f16 and dot with f16
            activations (x converted once before the kernels, the gate/up activation stored in
            f16) instead of through fp32 to x's dtype: one packed convert and one packed
            multiply per two weights instead of three conversions and a multiply per weight
            (H200: 6-8% faster at decode, equal at prefill). Results
            differ from the bf16 path by f16 rounding of x and the activation (finer than
            bf16's within f16's range); only for scales within ``F16_SCALE_EXPONENTS``
            (``scales_fit_f16``).
        fp8_mma: MXFP8 weights only: the fp8 tensor-core path of ``moe_fp8_mma`` (weights as
            the dots' e4m3 operand, the rows split into two e4m3 parts; no dequantise) with its
            own tiles: ``mma_block_n`` weight rows per program (64: one wgmma), ``mma_block_t``
            pairs per tile (the wgmma N), ``mma_split`` programs splitting each K,
            ``mma_num_stages`` and ``mma_num_warps`` (8: two warpgroups split the tile). The
            other tile fields are unused then.
        gemv: MXFP8 weights only: the weight-row kernels of ``moe_gemv`` (no ``tl.dot``; fp32
            accumulators, an expert's pairs one at a time), for steps of a few tokens
            (``moe_gemv.GEMV_MAX_TOKENS``): ``gemv_block_n`` weight rows per program (gate/up: half of
            them gate rows, half up rows), ``gemv_block_k`` columns per step (or the largest
            power of two below it that divides K), ``gemv_num_warps``, ``gemv_num_stages``.
            Same shapes as ``fp8_mma`` (whole scale words per step).
        gemv_combine: with ``gemv``, the down products summed per token in the down kernel
            (a program per token and block of output rows, over the token's pairs in the
            combine's order; ``moe_gemv._moe_gemv_down_combine_kernel``) and written to ``out``:
            no combine launch and no fp32 per-pair outputs. The same sums term by term; each
            expert's rows are read once per token that picked it (from L2 after the first).
            Not to be confused with the combine in the slot kernels' last programs through an
            arrival count, measured slower and dropped (BENCHMARKS.md, MXFP8 rounds).
        mma_f16: with ``fp8_mma``, the same tiles with the weights dequantised to f16 in
            registers and dotted with f16 rows (the weight tile is wgmma's register operand:
            one K = 128 dot per step, no per-block product to wait for, no row split); only
            for scales within ``F16_SCALE_EXPONENTS`` (``scales_fit_f16``).
        mma_tail_t: with ``fp8_mma`` and below ``mma_block_t``: an expert's last tile of at
            most that many pairs runs as a tile of that size (a 1054-token step routes ~33 pairs
            to each of the 16 local experts at TP8, 4 of 128 experts a token: about half of them
            then fit a 32-pair tile, where a 64-pair tile's dots would pad them to 64); at or
            above ``mma_block_t`` (the default) no smaller tile.
        mma_max_regs: with ``fp8_mma``, a cap on each thread's registers in its two GEMM
            kernels (Triton's ``maxnreg``; 255, the default: no cap below the hardware's). The
            f16 form at 64 x 64 tiles takes 216-244 registers, two 128-thread programs an SM;
            capped at 168, three fit the SM's 64K registers (and at 3 stages its shared memory)
            with a few bytes spilled. Not offered to the tuner: slower (H100, T=1054, per MoE
            layer: 568.1 us at 3 stages capped, gate/up 5% faster and down 8% slower than
            uncapped, against 549.9 for the tuner's 4-stage choice; BENCHMARKS.md, MXFP8
            thirteenth round).
        mma_diag: with ``fp8_mma`` (e4m3 dots), one dot of K = 128 per step against the pairs'
            rows laid out block-diagonally (each pair four times, one copy per 32-column scale
            block) instead of a dot per 32 columns, each waited for before its scaling: one wait
            a step for four times the tensor-core work and B's shared memory
            (``moe_fp8_mma._mma_rows_diag``). Kernels alone at T=32 (H100, 8-pair tiles, 3
            stages): 169.3 us against 213.3 for the per-block dots, same error. Offered to the
            tuner at decode sizes (8-pair tiles, 3 stages, K unsplit): in 60-layer steps the H100
            tuner took it at decode 8, 32 and 64 (BENCHMARKS.md, MXFP8 fifteenth round).
    """

    block_m: int = 16
    gu_block_n: int = 32
    gu_block_n_shared: int = 16
    gu_block_k: int = 256
    gu_num_warps: int = 4
    gu_num_stages: int = 4
    down_block_h: int = 64
    down_block_k: int = 128
    down_num_warps: int = 4
    down_num_stages: int = 4
    m_split: int = 1
    combine_block: int = 1024
    fp8_f16: bool = False
    fp8_mma: bool = False
    mma_block_n: int = 64
    mma_block_t: int = 16
    mma_split: int = 1
    mma_num_stages: int = 4
    mma_num_warps: int = 4
    mma_f16: bool = False
    mma_tail_t: int = 128
    mma_max_regs: int = 255
    mma_diag: bool = False
    gemv: bool = False
    gemv_block_n: int = 4
    gemv_block_k: int = 512
    gemv_num_warps: int = 2
    gemv_num_stages: int = 3
    gemv_combine: bool = False

    @property
    def mma_tail_tile(self) -> int:
        """The pairs of an expert's smaller last tile as the ``fp8_mma`` kernels take it
        (``TAIL_T``): ``mma_tail_t`` where below ``mma_block_t``, else 0 (no smaller tile)."""
        return self.mma_tail_t if self.mma_tail_t < self.mma_block_t else 0

    def __post_init__(self) -> None:
        check_tile_config(self, ("block_m", "gu_block_n", "gu_block_n_shared", "gu_block_k", "down_block_h",
                                 "down_block_k"))
        for name in ("gu_num_warps", "down_num_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"MoEConfig.{name} must be one of 1, 2, 4, 8, 16, got {getattr(self, name)}")
        if self.mma_block_n not in (64, 128) or self.mma_block_t not in (8, 16, 32, 64, 128) or self.mma_split < 1 \
                or self.mma_num_warps not in (4, 8):
            raise ValueError(f"MoEConfig: mma_block_n must be 64 or 128, mma_block_t one of 8, 16, 32, 64, 128, "
                             f"mma_split >= 1 and mma_num_warps 4 or 8, got {self.mma_block_n}, {self.mma_block_t}, "
                             f"{self.mma_split}, {self.mma_num_warps}")
        if self.mma_tail_t not in (8, 16, 32, 64, 128):
            raise ValueError(f"MoEConfig.mma_tail_t must be one of 8, 16, 32, 64, 128 (at or above mma_block_t: no "
                             f"smaller last tile), got {self.mma_tail_t}")
        if not 64 <= self.mma_max_regs <= 255:
            raise ValueError(f"MoEConfig.mma_max_regs must be in 64..255 (255: no cap), got {self.mma_max_regs}")
        for name in ("mma_f16", "mma_diag"):
            if getattr(self, name) and not self.fp8_mma:
                raise ValueError(f"MoEConfig.{name} is a form of the fp8_mma tiles: set fp8_mma=True too")
        if self.mma_f16 and self.mma_diag:
            raise ValueError("MoEConfig.mma_f16 and mma_diag are two forms of the fp8_mma tiles: set one")
        if self.gemv_block_n < 2 or self.gemv_block_n & (self.gemv_block_n - 1) or self.gemv_block_k < 128 \
                or self.gemv_block_k & (self.gemv_block_k - 1):
            raise ValueError(f"MoEConfig: gemv_block_n must be a power of two >= 2 and gemv_block_k one >= 128, got "
                             f"{self.gemv_block_n}, {self.gemv_block_k}")
        if self.gemv and self.fp8_mma:
            raise ValueError("MoEConfig.gemv and fp8_mma are two paths: set one")
        if self.gemv_combine and not self.gemv:
            raise ValueError("MoEConfig.gemv_combine is a form of the gemv kernels: set gemv=True too")
        if self.combine_block & (self.combine_block - 1):
            raise ValueError(f"MoEConfig.combine_block must be a power of two, got {self.combine_block}")


# Decode (T <= 64: at most a few pairs per expert): M-tiles of 16 and narrow N tiles, so that a
# single active expert still spreads over ~100 programs (I=3072 / 32 gate/up tiles; H=6144 / 64
# down tiles) and each program keeps several 40 KB / 20 KB weight stages in flight; the shared
# expert's 384 gate/up rows go in tiles of 16 (24 programs).
_DECODE = MoEConfig()
# Prefill (hundreds of pairs per step): 64-row tiles (one wgmma warpgroup), wider N tiles, the
# M-tiles of the shared expert's T rows (and of a hot expert) split over programs.
_PREFILL = MoEConfig(block_m=64, gu_block_n=64, gu_block_n_shared=64, gu_block_k=64, gu_num_warps=4,
                     gu_num_stages=4, down_block_h=128, down_block_k=64, down_num_warps=4, down_num_stages=4,
                     m_split=2)
_DECODE_MAX_TOKENS = 64


def default_moe_config(num_tokens: int) -> MoEConfig:
    """The config for a step of ``num_tokens`` rows (a function of the token count only)."""
    return _DECODE if num_tokens <= _DECODE_MAX_TOKENS else _PREFILL


# MXFP8 weights run the same tile shapes. Larger decode steps for fp8 (twice the N per step, 8
# warps) were candidates until the H200 measured them, twice, no faster: at most 2.7% at T=1
# (83.7 vs 86.0 us) and slower at T=8-64 (T=32: 197.4 vs 180.4 us); what did help is the f16
# dequantise-and-dot math of ``MoEConfig.fp8_f16`` (T=32: 176.1 vs 180.4 us, T=64: 331.5 vs
# 351.6 us, T=1: 76.8 vs 86.0 us).


def moe_config_candidates(num_tokens: int, f16: bool = False, fp8_mma: bool = False) -> list[MoEConfig]:
    """A few valid configs for ``num_tokens`` rows, the default first (for warm-up checks and
    timing on the GPU). All of them fit Hopper's shared memory at the M3 shapes. ``f16``
    (MXFP8 weights whose scales fit, ``scales_fit_f16``): then each of them again with
    ``fp8_f16`` math. ``fp8_mma`` (MXFP8 weights whose shapes fit, ``fits_fp8_mma``): then the
    weight-row tile sets of ``moe_fp8_mma`` too (with ``f16`` also their f16-dequantise form)."""
    base = _shared_candidates(num_tokens)
    out = base + [replace(c, fp8_f16=True) for c in base] if f16 else list(base)
    return out + _mma_candidates(num_tokens, f16) + _gemv_candidates(num_tokens) if fp8_mma else out


def _gemv_candidates(num_tokens: int) -> list[MoEConfig]:
    """Weight-row sets (``moe_gemv``) for steps of at most ``GEMV_MAX_TOKENS`` tokens, where an
    expert holds a pair or two: the row sets and steps the H200 measured fastest for rank-of-8
    expert rows at one and two tokens (``fp8_gemv``), each also with the combine in the down
    kernel (``gemv_combine``)."""
    if num_tokens > GEMV_MAX_TOKENS:
        return []
    sets = [MoEConfig(gemv=True, gemv_block_n=n, gemv_block_k=k, gemv_num_warps=w)
            for n, k, w in ((4, 512, 2), (16, 512, 4), (8, 256, 2))]
    return sets + [replace(c, gemv_combine=True) for c in sets]


def _mma_candidates(num_tokens: int, f16: bool = False) -> list[MoEConfig]:
    """Weight-row tile sets (``moe_fp8_mma``). The e4m3 tensor-core ones at decode steps only:
    an expert's pairs fit one 16-pair tile, and splitting K adds programs where few experts
    have pairs (decode 1: one expert and the shared one). The H200 measured (kernels alone,
    us): T=1 55.0 with K split in 4 (77.1 on the best dequantising set), T=32 / 64 within 1-3%
    of it; 128-row tiles and 6 stages were slower at every T, and at T=1054 the best
    tensor-core set took 768 us against 725, so prefill steps are not offered any (each
    candidate costs compile and tuning time at start).

    ``f16`` (scales within ``F16_SCALE_EXPONENTS``): at prefill sizes one set of the f16
    form (``mma_f16``: 64 weight rows, 64-pair tiles, 3 stages), the fastest MXFP8 MoE the
    H200 measured at T=1054 (666 us against 726 for the best dequantising set; bf16 weights
    558), and in K order 12.5% faster again (H100: 684.5 -> 598.7 us; 128-pair tiles, 8 warps
    over 128 weight rows and 2-3 stages of those were 656-916 us, benchmarks/results/mxfp8_round8/).
    On the H100 4 stages and 32-pair tiles for each expert's last pairs (``mma_tail_t``) were
    faster again (T=1054, kernels alone: 570.5 -> 542.7 us, benchmarks/results/mxfp8_round11/):
    both are offered, the tuner keeps the faster on the GPU it runs on.
    At decode sizes the f16 form ran as fast as the others but not faster (H200, T=1 59.6 vs
    55.3 us, T=32 172.9 vs 168.7, T=64 324.9 vs 319.0; in K order on the H100, T=32 182.4 vs
    183.6, T=64 353.2 vs 354.4), so it is not offered there.

    At decode sizes also the block-diagonal form (``mma_diag``: 8-pair tiles, 3 stages). Kernels
    alone on the H100 (T=32 / 64, us): 168.6 / 340.3 against 214.8 / 422.4 for the per-block
    dots and 186.1 / 352.3 for the dequantising tiles; K split in 2 was slower (177.6 / 353.0)
    and so is not offered. In 60-layer steps (H100, uniform routing) the tuner took it at decode
    8, 32 and 64 (BENCHMARKS.md, MXFP8 fifteenth round)."""
    if num_tokens > _DECODE_MAX_TOKENS:
        if not f16:
            return []
        prefill = MoEConfig(fp8_mma=True, mma_f16=True, mma_block_n=64, mma_block_t=64, mma_num_stages=3)
        return [prefill, replace(prefill, mma_num_stages=4, mma_tail_t=32)]
    return [MoEConfig(fp8_mma=True, mma_block_n=64, mma_block_t=16, mma_split=split, mma_num_stages=4)
            for split in (1, 2, 4)] + [MoEConfig(fp8_mma=True, mma_diag=True, mma_block_t=8, mma_num_stages=3)]


def scales_fit_f16(scales: "MoEScales") -> bool:
    """Whether every E8M0 scale of ``scales`` is a power of two within ``F16_SCALE_EXPONENTS``
    (``MoEConfig.fp8_f16`` holds those weights; the bytes' range, read on the host)."""
    lo, hi = F16_SCALE_EXPONENTS
    return all(lo <= int(s.min()) - 127 and int(s.max()) - 127 <= hi for s in scales)


def _shared_candidates(num_tokens: int) -> list[MoEConfig]:
    if num_tokens <= _DECODE_MAX_TOKENS:
        return [
            _DECODE,
            # ~2x the programs, half the bytes each
            MoEConfig(gu_block_n=16, gu_block_n_shared=16, gu_block_k=256, down_block_h=32, down_block_k=128),
            # smaller stages, deeper pipeline
            MoEConfig(gu_block_n=32, gu_block_n_shared=32, gu_block_k=128, gu_num_stages=6, down_block_h=64,
                      down_block_k=64, down_num_stages=6),
            # fewer, fatter programs
            MoEConfig(gu_block_n=64, gu_block_n_shared=16, gu_block_k=128, gu_num_stages=4, down_block_h=128,
                      down_block_k=64, down_num_stages=4),
        ]
    return [
        _PREFILL,
        MoEConfig(block_m=64, gu_block_n=128, gu_block_n_shared=64, gu_block_k=64, gu_num_warps=8,
                  gu_num_stages=3, down_block_h=128, down_block_k=64, down_num_warps=8, down_num_stages=3,
                  m_split=2),
        MoEConfig(block_m=64, gu_block_n=64, gu_block_n_shared=32, gu_block_k=128, gu_num_warps=4,
                  gu_num_stages=3, down_block_h=64, down_block_k=128, down_num_warps=4, down_num_stages=3,
                  m_split=4),
        MoEConfig(block_m=32, gu_block_n=64, gu_block_n_shared=32, gu_block_k=128, gu_num_warps=4,
                  gu_num_stages=4, down_block_h=128, down_block_k=64, down_num_warps=4, down_num_stages=4,
                  m_split=2),
    ]


# --------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _dequant(w, factor, dtype: tl.constexpr, W_F16: tl.constexpr):
    """An MXFP8 weight tile for the dot, ``w`` times its scale ``factor`` (``scale_factor`` of
    ``W_F16``): in f16 (``W_F16``; the activations go to f16 too; a packed convert and a packed
    multiply per two weights) or, through fp32, in the activations' ``dtype``."""
    if W_F16:
        out = w.to(tl.float16) * factor
    else:
        out = (w.to(tl.float32) * factor).to(dtype)
    return out


@triton.jit
def _gate_up_tiles(x_ptr, stride_x_t, wg_ptr, wu_ptr, stride_wn, sg_ptr, su_ptr, stride_sn, sorted_ptr, act_ptr,
                   stride_act, start, end, N, TK, H, alpha, limit,
                   K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, W_FP8: tl.constexpr, W_F16: tl.constexpr,
                   S_WORDS: tl.constexpr):
    """One expert's share of this program: N-tile ``j % n_tiles`` of its ``N`` gate/up rows,
    over the M-tiles of its pairs ``[start, end)`` that fall to this program.

    Axis 1 of the grid has as many programs as the expert with the most N-tiles needs; an
    expert with fewer (the shared expert: Is = 384 at TP8) hands its spare programs M-tiles
    (``groups`` > 1) instead of idling, and axis 2 splits the M-tiles further. With no pairs
    the loop runs zero times: no weight is read. ``W_FP8``: the weights are fp8 e4m3 with an
    E8M0 byte per 32 columns of H at ``sg_ptr`` / ``su_ptr`` (row stride ``stride_sn``),
    dequantised in registers to x's dtype before the dot (weight bytes halve; the dot and its
    inputs are those of the bf16 kernel on the dequantised weights), or with ``W_F16`` to f16,
    x in f16 (see ``MoEConfig.fp8_f16``). ``S_WORDS``: the scale pointers and strides are in
    int32 words of four scale bytes (``fp8_tiles.scale_words``).
    """
    j = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    groups = tl.num_programs(1) // n_tiles
    grp = j // n_tiles
    n_groups = groups * tl.num_programs(2)
    m_lo = start + (grp + groups * tl.program_id(2)) * BLOCK_M
    m_lo = tl.where(grp < groups, m_lo, end)  # spare programs past the last group: nothing to do
    offs_n = (j % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n_ld = offs_n % N  # a partial last tile re-reads valid rows (discarded) instead of masking
    offs_k = tl.arange(0, BLOCK_K)
    wg_base = wg_ptr + n_ld[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    wu_base = wu_ptr + n_ld[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    sg_base = sg_ptr + n_ld[None, :].to(tl.int64) * stride_sn  # + scale block (W_FP8 only; S_WORDS: in words)
    su_base = su_ptr + n_ld[None, :].to(tl.int64) * stride_sn
    for m0 in range(m_lo, end, n_groups * BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < end
        pair = tl.load(sorted_ptr + rows, mask=r_ok, other=0)
        tok = tl.where(pair < TK, pair // K, pair - TK)
        x_base = x_ptr + tok.to(tl.int64)[:, None] * stride_x_t + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                xa = tl.load(x_base + k0, mask=r_ok[:, None], other=0.0)
                wg = tl.load(wg_base + k0)
                wu = tl.load(wu_base + k0)
                if W_FP8:  # BLOCK_K >= 32 with fp8 weights (fused_moe checks)
                    fg = block_scale_factors(sg_base, k0, H, BLOCK_K, BLOCK_N, W_F16, S_WORDS, False)
                    fu = block_scale_factors(su_base, k0, H, BLOCK_K, BLOCK_N, W_F16, S_WORDS, False)
                    wg = _dequant(wg, fg, xa.dtype, W_F16)
                    wu = _dequant(wu, fu, xa.dtype, W_F16)
            else:
                k_ok = offs_k + k0 < H
                xa = tl.load(x_base + k0, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(wg_base + k0, mask=k_ok[:, None], other=0.0)
                wu = tl.load(wu_base + k0, mask=k_ok[:, None], other=0.0)
                if W_FP8:  # H is a multiple of 32 with fp8 weights: blocks mask exactly
                    fg = block_scale_factors(sg_base, k0, H, BLOCK_K, BLOCK_N, W_F16, S_WORDS, True)
                    fu = block_scale_factors(su_base, k0, H, BLOCK_K, BLOCK_N, W_F16, S_WORDS, True)
                    wg = _dequant(wg, fg, xa.dtype, W_F16)
                    wu = _dequant(wu, fu, xa.dtype, W_F16)
            if W_F16:
                xa = xa.to(tl.float16)  # a no-op where fused_moe passed x in f16
            if DOT_F32:
                xa = xa.to(tl.float32)
                acc_g = tl.dot(xa, wg.to(tl.float32), acc_g, input_precision="ieee")
                acc_u = tl.dot(xa, wu.to(tl.float32), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(xa, wg, acc_g)
                acc_u = tl.dot(xa, wu, acc_u)
        a = swiglu_oai(acc_g, acc_u, alpha, limit)
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_act + offs_n[None, :],
                 a.to(act_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _moe_gate_up_kernel(
    x_ptr, stride_x_t,
    w13_ptr, stride_w13_e, stride_w13_n, stride_w13_up,
    sgu_ptr, stride_sgu_n, stride_sgu_up,
    s13_ptr, stride_s13_e, stride_s13_n, stride_s13_up,
    ssgu_ptr, stride_ssgu_n, stride_ssgu_up,
    sorted_ptr, off_ptr, act_ptr, stride_act,
    T, H, I, IS, alpha, limit,
    K: tl.constexpr, E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_SHARED: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, W_FP8: tl.constexpr,
    W_F16: tl.constexpr = False, S_WORDS: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    """act[pos, n] = SwiGLU-OAI(x[tok(pos)] . gate[n], x[tok(pos)] . up[n]) for the pairs of
    expert ``program_id(0)`` (``E``: the shared expert, whose N-tiles may be narrower so that
    its 2*Is rows spread over more programs when it is the only expert with work)."""
    grid_dependency(PDL)
    e = tl.program_id(0)
    start = tl.load(off_ptr + e)
    end = tl.load(off_ptr + e + 1)
    if e < E:
        wg_ptr = w13_ptr + e.to(tl.int64) * stride_w13_e
        sg_ptr = s13_ptr + e.to(tl.int64) * stride_s13_e
        _gate_up_tiles(x_ptr, stride_x_t, wg_ptr, wg_ptr + stride_w13_up, stride_w13_n, sg_ptr,
                       sg_ptr + stride_s13_up, stride_s13_n, sorted_ptr, act_ptr,
                       stride_act, start, end, I, T * K, H, alpha, limit,
                       K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32, W_FP8, W_F16, S_WORDS)
    else:
        _gate_up_tiles(x_ptr, stride_x_t, sgu_ptr, sgu_ptr + stride_sgu_up, stride_sgu_n, ssgu_ptr,
                       ssgu_ptr + stride_ssgu_up, stride_ssgu_n, sorted_ptr, act_ptr,
                       stride_act, start, end, IS, T * K, H, alpha, limit,
                       K, BLOCK_M, BLOCK_N_SHARED, BLOCK_K, EVEN_K, DOT_F32, W_FP8, W_F16, S_WORDS)


@triton.jit(do_not_specialize=["T"])
def _moe_down_kernel(
    act_ptr, stride_act,
    w2_ptr, stride_w2_e, stride_w2_h,
    sd_ptr, stride_sd_h,
    s2_ptr, stride_s2_e, stride_s2_h,
    ssd_ptr, stride_ssd_h,
    topk_w_ptr, sorted_ptr, off_ptr, y_ptr, stride_y,
    T, H, I, IS,
    K: tl.constexpr, E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, W_FP8: tl.constexpr, W_F16: tl.constexpr = False,
    S_WORDS: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    """y[pos, h] = w_pair * (act[pos, :N_e] . w2_e[h, :N_e]) in fp32, one H-tile of one expert,
    over the M-tiles of its pairs this program owns (axis 2 splits them). ``W_FP8``: fp8 weights,
    dequantised in registers (see ``_gate_up_tiles``); with ``W_F16`` to f16, the activations
    being f16 already (the gate/up kernel wrote them so)."""
    grid_dependency(PDL)
    e = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(off_ptr + e)
    end = tl.load(off_ptr + e + 1)
    TK = T * K
    KD, w_ptr, stride_wh, s_ptr, stride_sh = down_weights(e, E, I, IS, w2_ptr, stride_w2_e, stride_w2_h, s2_ptr,
                                                         stride_s2_e, stride_s2_h, sd_ptr, stride_sd_h, ssd_ptr,
                                                         stride_ssd_h)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    h_ld = offs_h % H
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + h_ld[None, :].to(tl.int64) * stride_wh + offs_k[:, None]  # [BLOCK_K, BLOCK_H]
    s_base = s_ptr + h_ld[None, :].to(tl.int64) * stride_sh  # + scale block (W_FP8 only; S_WORDS: in words)
    for m0 in range(start + s * BLOCK_M, end, tl.num_programs(2) * BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < end
        pair = tl.load(sorted_ptr + rows, mask=r_ok, other=0)
        is_routed = pair < TK
        wt = tl.load(topk_w_ptr + pair, mask=r_ok & is_routed, other=0.0)
        wt = tl.where(is_routed, wt, 1.0)
        a_base = act_ptr + rows.to(tl.int64)[:, None] * stride_act + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for k0 in range(0, KD, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_base + k0, mask=r_ok[:, None], other=0.0)
                w = tl.load(w_base + k0)
                if W_FP8:  # BLOCK_K >= 32 with fp8 weights (fused_moe checks)
                    f = block_scale_factors(s_base, k0, KD, BLOCK_K, BLOCK_H, W_F16, S_WORDS, False)
                    w = _dequant(w, f, a.dtype, W_F16)
            else:
                k_ok = offs_k + k0 < KD
                a = tl.load(a_base + k0, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_base + k0, mask=k_ok[:, None], other=0.0)
                if W_FP8:  # KD is a multiple of 32 with fp8 weights: blocks mask exactly
                    f = block_scale_factors(s_base, k0, KD, BLOCK_K, BLOCK_H, W_F16, S_WORDS, True)
                    w = _dequant(w, f, a.dtype, W_F16)
            if W_F16:
                a = a.to(tl.float16)  # f16 already when the gate/up kernel wrote it (as fused_moe does)
            if DOT_F32:
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        acc = acc * wt[:, None]
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + offs_h[None, :], acc,
                 mask=r_ok[:, None] & h_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _moe_combine_kernel(y_ptr, stride_y_split, stride_y, pos_ptr, out_ptr, stride_o_t, T, H,
                        K: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = 0):
    """out[t] = sum_k y[pos(t, k)] (valid pairs, k ascending) + y[pos(shared, t)], each pair's
    ``SPLIT`` partial sums (``y [SPLIT, P + T, H]``) in split order."""
    grid_dependency(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h_ok = h < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        pos = tl.load(pos_ptr + t * K + k)
        for s in tl.static_range(SPLIT):
            acc += tl.load(y_ptr + s * stride_y_split + pos.to(tl.int64) * stride_y + h, mask=h_ok & (pos >= 0),
                           other=0.0)
    pos_s = tl.load(pos_ptr + T * K + t)
    for s in tl.static_range(SPLIT):
        acc += tl.load(y_ptr + s * stride_y_split + pos_s.to(tl.int64) * stride_y + h, mask=h_ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o_t + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


# --------------------------------------------------------------------------------------------
# launchers


class MoEScales(NamedTuple):
    """MXFP8 scales of fp8 weights: uint8 E8M0 bytes, one per 32 input columns
    (``w13 [E, 2I, H/32]``, ``w2 [E, H, I/32]``, ``shared_gate_up [2Is, H/32]``,
    ``shared_down [H, Is/32]``)."""

    w13: Tensor
    w2: Tensor
    shared_gate_up: Tensor
    shared_down: Tensor


@dataclass(frozen=True)
class _Dims:
    T: int
    H: int
    K: int
    E: int
    I: int
    Is: int


def _check_args(x: Tensor, topk_ids: Tensor, topk_w: Tensor, w13: Tensor, w2: Tensor, shared_gate_up: Tensor,
                shared_down: Tensor, out: Tensor, scales: MoEScales | None = None) -> _Dims:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    T, H = x.shape
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int32 [T={T}, K], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    K = topk_ids.shape[1]
    if K < 1:
        raise ValueError("topk_ids needs K >= 1 columns")
    if topk_w.shape != topk_ids.shape or topk_w.dtype != torch.float32 or not topk_w.is_contiguous():
        raise ValueError(f"topk_w must be contiguous fp32 {tuple(topk_ids.shape)}, got {topk_w.dtype} "
                         f"{tuple(topk_w.shape)}")
    if w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2 or w13.shape[0] < 1 or w13.stride(2) != 1:
        raise ValueError(f"w13 must be [E >= 1, 2I, H={H}] with contiguous rows, got {tuple(w13.shape)}")
    E, I = w13.shape[0], w13.shape[1] // 2
    if w2.dim() != 3 or tuple(w2.shape) != (E, H, I) or w2.stride(2) != 1:
        raise ValueError(f"w2 must be [E={E}, H={H}, I={I}] with contiguous rows, got {tuple(w2.shape)}")
    if shared_gate_up.dim() != 2 or shared_gate_up.shape[1] != H or shared_gate_up.shape[0] % 2 \
            or shared_gate_up.shape[0] < 2 or shared_gate_up.stride(1) != 1:
        raise ValueError(f"shared_gate_up must be [2*Is, H={H}] with contiguous rows, "
                         f"got {tuple(shared_gate_up.shape)}")
    Is = shared_gate_up.shape[0] // 2
    if shared_down.dim() != 2 or tuple(shared_down.shape) != (H, Is) or shared_down.stride(1) != 1:
        raise ValueError(f"shared_down must be [H={H}, Is={Is}] with contiguous rows, got {tuple(shared_down.shape)}")
    weights = (("w13", w13), ("w2", w2), ("shared_gate_up", shared_gate_up), ("shared_down", shared_down))
    if scales is None:
        for name, w in weights:
            if w.dtype != x.dtype:
                raise ValueError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}"
                                 + (" (fp8 weights need their MoEScales)" if w.dtype == FP8 else ""))
    else:
        for (name, w), sc in zip(weights, scales):
            want = (*w.shape[:-1], w.shape[-1] // MX_BLOCK)
            if w.dtype != FP8 or w.shape[-1] % MX_BLOCK:
                raise ValueError(f"{name} with scales must be fp8 e4m3 with a multiple of {MX_BLOCK} columns, got "
                                 f"{w.dtype} {tuple(w.shape)}")
            if sc.dtype != torch.uint8 or tuple(sc.shape) != want or sc.stride(-1) != 1:
                raise ValueError(f"the scales of {name} must be uint8 {want} with contiguous rows, got {sc.dtype} "
                                 f"{tuple(sc.shape)}")
    if out.dim() != 2 or tuple(out.shape) != (T, H) or out.stride(1) != 1:
        raise ValueError(f"out must be [T={T}, H={H}] with contiguous rows, got {tuple(out.shape)}")
    devs = {t.device for t in (x, topk_ids, topk_w, w13, w2, shared_gate_up, shared_down, out, *(scales or ()))}
    if len(devs) != 1:
        raise ValueError(f"all fused_moe tensors must be on one device, got {sorted(map(str, devs))}")
    return _Dims(T, H, K, E, I, Is)


# Triton keeps up to num_stages operand buffers plus epilogue scratch in shared memory (227 KiB
# per block on H200); every bf16 candidate stays within this budget as given.
_SMEM_BUDGET = 160 * 1024


def _fit_stages(num_stages: int, stage_bytes: int) -> int:
    """Pipeline depth that keeps ``num_stages`` operand stages within shared memory (the bf16
    configs fit as given; fp32 inputs double the stage size and would not launch)."""
    return max(1, min(num_stages, _SMEM_BUDGET // stage_bytes))


def fused_moe(x: Tensor, topk_ids: Tensor, topk_w: Tensor, w13: Tensor, w2: Tensor, shared_gate_up: Tensor,
              shared_down: Tensor, alpha: float, limit: float, out: Tensor,
              config: MoEConfig | None = None, scales: MoEScales | None = None,
              aligned: MoEAlignment | None = None) -> Tensor:
    """Routed experts of this rank + the shared expert, five launches (four where one align
    program holds every pair, as at decode; three where the router's last program aligned
    them: ``aligned``; two more on the fp8 tensor-core path, one fewer with the weight-row
    path's combine in its down kernel), graph-capturable.

    Args:
        x: ``[T, H]`` (bf16 on GPU; fp32 allowed, then the dots run in fp32 "ieee").
        topk_ids: int32 ``[T, K]`` LOCAL expert ids in ``[0, E)``; any other value (``-1``:
            routed to another rank, or a padded row) drops the pair.
        topk_w: fp32 ``[T, K]`` routing weights (ignored for dropped pairs).
        w13: ``[E, 2I, H]``, rows ``[0, I)`` gate, ``[I, 2I)`` up.  w2: ``[E, H, I]``.
        shared_gate_up: ``[2*Is, H]`` (gate rows first).  shared_down: ``[H, Is]``.
        alpha, limit: SwiGLU-OAI constants (1.702, 7.0 for M3).
        out: ``[T, H]``, written in full (every row gets at least the shared expert).
        config: tiles; default :func:`default_moe_config` of T.
        scales: MXFP8 weights: the four weights are fp8 e4m3 and these their E8M0 scales; the
            kernels read fp8 (half the bytes) and dequantise in registers, so the result equals
            the bf16 kernels on the dequantised weights.
        aligned: the alignment of ``topk_ids`` already made (``route_triton(align_out=...)``,
            in the router's last program); None: aligned here.
    Returns:
        ``out``.
    """
    d = _check_args(x, topk_ids, topk_w, w13, w2, shared_gate_up, shared_down, out, scales)
    check_device("fused_moe", x, topk_ids, topk_w, w13, w2, shared_gate_up, shared_down, out, *(scales or ()))
    if d.T == 0:
        return out
    cfg = config or default_moe_config(d.T)
    T, H, K, E, I, Is = d.T, d.H, d.K, d.E, d.I, d.Is
    fp8_mma = cfg.fp8_mma and scales is not None
    gemv = cfg.gemv and scales is not None
    # config checks before any launch
    if (fp8_mma or gemv) and not fits_fp8_mma(H, I, Is, tuple(scales)):
        raise ValueError(f"MoEConfig.{'gemv' if gemv else 'fp8_mma'} needs H, I and Is multiples of {MMA_BLOCK_K} (got "
                         f"{H}, {I}, {Is}) and scales readable as int32 words (fp8_tiles.scale_words); pick another "
                         "config")
    if scales is not None and not (fp8_mma or gemv) and min(cfg.gu_block_k, cfg.down_block_k) < MX_BLOCK:
        raise ValueError(f"MoEConfig with MXFP8 weights needs gu_block_k and down_block_k >= {MX_BLOCK} (one scale per "
                         f"{MX_BLOCK} columns), got {cfg.gu_block_k} and {cfg.down_block_k}")
    off, sorted_pairs, pair_pos = aligned if aligned is not None else moe_align(topk_ids, E)
    if fp8_mma:
        y = experts_fp8_mma(x, topk_w, w13, w2, shared_gate_up, shared_down, tuple(scales), alpha, limit, off,
                            sorted_pairs, K, cfg.mma_block_n, cfg.mma_block_t, cfg.mma_split, cfg.mma_num_stages,
                            cfg.mma_f16, cfg.mma_num_warps, tail_t=cfg.mma_tail_tile, max_regs=cfg.mma_max_regs,
                            diag=cfg.mma_diag)
    elif gemv:
        combine = (topk_ids, pair_pos, out) if cfg.gemv_combine else None
        y = experts_gemv(x, topk_w, w13, w2, shared_gate_up, shared_down, tuple(scales), alpha, limit, off,
                         sorted_pairs, K, cfg.gemv_block_n, cfg.gemv_block_k, cfg.gemv_num_warps, cfg.gemv_num_stages,
                         combine=combine)
        if combine is not None:  # summed into out by the down kernel: no combine launch
            return out
    else:
        y = _experts_dequant(x, topk_w, w13, w2, shared_gate_up, shared_down, alpha, limit, cfg, scales, d, off,
                             sorted_pairs)[None]
    cb = min(cfg.combine_block, max(16, next_pow2(H)))
    _moe_combine_kernel[(T, triton.cdiv(H, cb))](y, y.stride(0), y.stride(1), pair_pos, out, out.stride(0), T, H, K=K,
                                                 BLOCK=cb, SPLIT=y.shape[0], num_warps=4, **pdl_launch(out.device))
    return out


def _experts_dequant(x: Tensor, topk_w: Tensor, w13: Tensor, w2: Tensor, shared_gate_up: Tensor, shared_down: Tensor,
                     alpha: float, limit: float, cfg: MoEConfig, scales: MoEScales | None, d: _Dims, off: Tensor,
                     sorted_pairs: Tensor) -> Tensor:
    """The weighted per-pair outputs ``y [P + T, H]`` fp32 of the bf16 (or dequantised MXFP8)
    gate/up and down kernels, for the combine."""
    T, H, K, E, I, Is = d.T, d.H, d.K, d.E, d.I, d.Is
    P = T * K
    dev = x.device
    dot_f32 = interpreting() or x.dtype == torch.float32  # the interpreter's bf16 dot is wrong
    w_f16 = scales is not None and cfg.fp8_f16
    act = torch.empty(P + T, max(I, Is), dtype=torch.float16 if w_f16 and not dot_f32 else x.dtype, device=dev)
    y = torch.empty(P + T, H, dtype=torch.float32, device=dev)

    bn, bns, bk = cfg.gu_block_n, cfg.gu_block_n_shared, cfg.gu_block_k
    esz, wsz = x.element_size(), w13.element_size()  # activation and weight bytes (fp8: 1)
    # Without scales the scale pointers are never read (W_FP8=False): the weights stand in.
    # The scales go as int32 words where all four allow it (pipelined loads: fp8_tiles), at
    # every tile size: side by side on the H200 at T=1054 the 64-column prefill tiles took
    # 727-729 us on words and 766-797 us on bytes (an earlier reading the other way compared
    # two different runs).
    s13, s2, ssgu, ssd = scales if scales is not None else (w13, w2, shared_gate_up, shared_down)
    words = [scale_words(sc) for sc in scales] if scales is not None else [None]
    s_words = all(w is not None for w in words)
    if s_words:
        s13, s2, ssgu, ssd = words
    # f16 math: x converted once here (in the kernel, each warp would convert the whole
    # M-tile, its dot operand, on every K step: as many conversions as the weights take)
    x_in = x.to(torch.float16) if w_f16 and not dot_f32 else x
    _moe_gate_up_kernel[(E + 1, max(triton.cdiv(I, bn), triton.cdiv(Is, bns)), cfg.m_split)](
        x_in, x_in.stride(0),
        w13, w13.stride(0), w13.stride(1), I * w13.stride(1),
        shared_gate_up, shared_gate_up.stride(0), Is * shared_gate_up.stride(0),
        s13, s13.stride(0), s13.stride(1), I * s13.stride(1),
        ssgu, ssgu.stride(0), Is * ssgu.stride(0),
        sorted_pairs, off, act, act.stride(0),
        T, H, I, Is, float(alpha), float(limit),
        K=K, E=E, BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_N_SHARED=bns, BLOCK_K=bk, EVEN_K=H % bk == 0,
        DOT_F32=dot_f32, W_FP8=scales is not None, W_F16=w_f16, S_WORDS=s_words,
        num_warps=cfg.gu_num_warps,
        num_stages=_fit_stages(cfg.gu_num_stages, (cfg.block_m * esz + 2 * max(bn, bns) * wsz) * bk),
        **pdl_launch(dev),
    )
    bh, bkd = cfg.down_block_h, cfg.down_block_k
    _moe_down_kernel[(E + 1, triton.cdiv(H, bh), cfg.m_split)](
        act, act.stride(0),
        w2, w2.stride(0), w2.stride(1),
        shared_down, shared_down.stride(0),
        s2, s2.stride(0), s2.stride(1),
        ssd, ssd.stride(0),
        topk_w, sorted_pairs, off, y, y.stride(0),
        T, H, I, Is,
        K=K, E=E, BLOCK_M=cfg.block_m, BLOCK_H=bh, BLOCK_K=bkd, EVEN_K=(I % bkd == 0 and Is % bkd == 0),
        DOT_F32=dot_f32, W_FP8=scales is not None, W_F16=w_f16, S_WORDS=s_words, num_warps=cfg.down_num_warps,
        num_stages=_fit_stages(cfg.down_num_stages, (cfg.block_m * esz + bh * wsz) * bkd), **pdl_launch(dev),
    )
    return y


# --------------------------------------------------------------------------------------------
# plain torch


def fused_moe_torch(x: Tensor, topk_ids: Tensor, topk_w: Tensor, w13: Tensor, w2: Tensor, shared_gate_up: Tensor,
                    shared_down: Tensor, alpha: float, limit: float, out: Tensor,
                    config: MoEConfig | None = None, scales: MoEScales | None = None,
                    aligned: MoEAlignment | None = None) -> Tensor:
    """Plain-torch twin of :func:`fused_moe` (same arguments; ``config`` and ``aligned`` are
    ignored; with ``scales`` the fp8 weights are dequantised to x's dtype first,
    ``mxfp8.dequantize_mxfp8``).

    Same rounding points as the kernels: fp32 gate/up products, the activation rounded to
    ``x.dtype``, fp32 down products, weights and sum, one cast into ``out``. Each local expert
    runs on all T rows, weighted by a dense ``[T]`` column that is 0 where it is not routed:
    no data-dependent shapes (capturable), at E / K times the work of the kernels.
    """
    d = _check_args(x, topk_ids, topk_w, w13, w2, shared_gate_up, shared_down, out, scales)
    if d.T == 0:
        return out
    if scales is not None:
        w13, w2, shared_gate_up, shared_down = (dequantize_mxfp8(w, sc, x.dtype) for w, sc in
                                                zip((w13, w2, shared_gate_up, shared_down), scales))
    xf = x.float()
    ids = topk_ids.long()

    def ffn(gate_up: Tensor, down: Tensor, inter: int) -> Tensor:
        h = F.linear(xf, gate_up.float())
        a = swiglu_oai_f32(h[:, :inter], h[:, inter:], alpha, limit).to(x.dtype)
        return F.linear(a.float(), down.float())

    acc = torch.zeros(d.T, d.H, dtype=torch.float32, device=x.device)
    for e in range(d.E):
        w_e = torch.where(ids == e, topk_w, 0.0).sum(dim=1)  # [T]; a pair routed twice adds up
        acc += w_e[:, None] * ffn(w13[e], w2[e], d.I)
    acc += ffn(shared_gate_up, shared_down, d.Is)
    out.copy_(acc)
    return out


__all__ = ["MoEConfig", "MoEScales", "default_moe_config", "fused_moe", "fused_moe_torch", "moe_config_candidates",
           "scales_fit_f16"]
