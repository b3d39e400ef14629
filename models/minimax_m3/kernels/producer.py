"""Fused attention producer: per-head Gemma RMSNorm + partial NeoX RoPE + paged cache writes.

One kernel turns the fused projection output ``[T, (Hq + 2*Hkv)*D + (Hidx + 1)*Di]`` (laid
out ``[q | k | v | iq | ik]``; dense layers have no ``iq | ik`` part) into: normed and rotated
q (and iq) in place or in caller buffers, normed and rotated K plus raw V in the paged K/V
cache, and normed and rotated ik in the index-K cache. Rows with slot ``-1`` (padding) write
nothing to the caches. It is request-independent, so it is captured inside graph segments.

fp8 caches (``torch.float8_e4m3fn``, unit scale): the kernel stores exactly what
``kvcache.paged.to_cache_dtype`` stores, ``x.clamp(-448, 448)`` rounded to e4m3 (ties to even),
from the same fp32 value the bf16 path rounds once.

``norm_rope_torch`` is the same maths in plain torch (the reference the kernel is tested
against, and with ``PagedKVCache.write`` the CPU path of ``models.minimax_m3.ops``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from attention.kernels.pdl import grid_dependency, pdl_launch
from attention.kernels.triton_utils import check_device, next_pow2
from kvcache.paged import FP8_E4M3_MAX, check_cache_dtype
from models.minimax_m3.layers import gemma_rms_normalize

Tensor = torch.Tensor


@dataclass(frozen=True)
class QKVLayout:
    """Widths of the fused projection output and the norm/RoPE constants.

    Attributes:
        num_q_heads, num_kv_heads, head_dim: main attention shapes.
        num_index_heads, index_dim: index branch shapes; ``num_index_heads = 0`` for dense
            layers, whose projection has no ``iq | ik`` part.
        rotary_dim: dims ``[0, rotary_dim)`` of every head rotate (NeoX split-half pairs).
        eps: RMSNorm epsilon.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_index_heads: int = 0
    index_dim: int = 0
    rotary_dim: int = 64
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if min(self.num_q_heads, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"QKVLayout needs positive head counts and head_dim, got {self}")
        if self.num_index_heads < 0 or (self.num_index_heads > 0 and self.index_dim < 1):
            raise ValueError(f"QKVLayout: index heads need a positive index_dim, got {self}")
        widths = [self.head_dim] + ([self.index_dim] if self.num_index_heads else [])
        if self.rotary_dim < 0 or self.rotary_dim % 2 or self.rotary_dim > min(widths):
            raise ValueError(
                f"QKVLayout.rotary_dim must be even and <= every head width {widths}, got {self.rotary_dim}"
            )

    @property
    def has_index(self) -> bool:
        return self.num_index_heads > 0

    @property
    def width(self) -> int:
        """Columns of the fused projection output."""
        main = (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        return main + ((self.num_index_heads + 1) * self.index_dim if self.has_index else 0)

    @property
    def k_offset(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def v_offset(self) -> int:
        return (self.num_q_heads + self.num_kv_heads) * self.head_dim

    @property
    def iq_offset(self) -> int:
        return (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def ik_offset(self) -> int:
        return self.iq_offset + self.num_index_heads * self.index_dim


class HeadNorms(NamedTuple):
    """One attention layer's per-head Gemma norm weights (offsets): ``q``, ``k`` ``[head_dim]``
    and, on sparse layers, ``index_q``, ``index_k`` ``[index_dim]`` (else ``None``)."""

    q: Tensor
    k: Tensor
    index_q: Tensor | None = None
    index_k: Tensor | None = None


# --------------------------------------------------------------------------------------------
# plain torch


def rope_fp32(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Partial NeoX RoPE in fp32: dims ``[0, rot)`` (``rot = 2 * len(inv_freq)``) of every head
    rotate in split-half pairs ``(i, i + rot/2)`` by ``pos * inv_freq[i]``; the rest pass.

    x: ``[T, heads, D]``; positions: int ``[T]``; inv_freq: fp32 ``[rot / 2]``. Returns fp32.
    """
    x = x.float()
    half = inv_freq.shape[0]
    if half == 0:
        return x
    angle = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, rot/2]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, x[..., 2 * half :]], dim=-1)


def _norm_rope_torch(x: Tensor, weight: Tensor, positions: Tensor, inv_freq: Tensor, eps: float) -> Tensor:
    """x [T, H, D] -> fp32 [T, H, D] normed (Gemma, fp32) and partially rotated (NeoX)."""
    return rope_fp32(gemma_rms_normalize(x, weight, eps), positions, inv_freq)


class NormRoped(NamedTuple):
    """The torch producer's results: fp32 q ``[T, Hq, D]``, k ``[T, Hkv, D]``, raw v
    ``[T, Hkv, D]``, and for layouts with an index branch fp32 iq ``[T, Hidx, Di]`` and ik
    ``[T, Di]`` (else ``None``)."""

    q: Tensor
    k: Tensor
    v: Tensor
    iq: Tensor | None
    ik: Tensor | None


def norm_rope_torch(qkv: Tensor, positions: Tensor, layout: QKVLayout, inv_freq: Tensor, q_norm: Tensor,
                    k_norm: Tensor, index_q_norm: Tensor | None = None,
                    index_k_norm: Tensor | None = None) -> NormRoped:
    """Plain-torch twin of the kernel's maths (fp32 throughout, one rounding at the store).

    The caller writes k, v (and ik) with ``PagedKVCache.write``, whose slot ``-1`` rows land
    in a private sink page: no boolean mask, so the twin is capturable too.
    """
    L, T = layout, qkv.shape[0]

    def heads(off: int, n: int, d: int) -> Tensor:
        return qkv[:, off : off + n * d].view(T, n, d)

    q = _norm_rope_torch(heads(0, L.num_q_heads, L.head_dim), q_norm, positions, inv_freq, L.eps)
    k = _norm_rope_torch(heads(L.k_offset, L.num_kv_heads, L.head_dim), k_norm, positions, inv_freq, L.eps)
    v = heads(L.v_offset, L.num_kv_heads, L.head_dim)
    iq = ik = None
    if L.has_index:
        iq = _norm_rope_torch(heads(L.iq_offset, L.num_index_heads, L.index_dim), index_q_norm, positions, inv_freq,
                              L.eps)
        ik = _norm_rope_torch(heads(L.ik_offset, 1, L.index_dim), index_k_norm, positions, inv_freq, L.eps)[:, 0]
    return NormRoped(q, k, v, iq, ik)


# --------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _norm_rope_tile(src_ptr, src_stride_t, t, col0, n_heads, w_ptr, inv_freq_ptr, pos_f, eps,
                    DIM: tl.constexpr, ROT: tl.constexpr, HB: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load heads [col0 + h*DIM] (h < n_heads) of row t: [HB, BLOCK_D] fp32, normed and rotated."""
    h = tl.arange(0, HB)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < n_heads) & (d < DIM)
    base = src_ptr + t * src_stride_t + col0 + h * DIM
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DIM + eps)  # [HB]
    w = 1.0 + tl.load(w_ptr + d, mask=d < DIM, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w
    if ROT > 0:
        half: tl.constexpr = ROT // 2
        # NeoX pairs (i, i + ROT/2); the partner is re-read from memory (cache hit) rather than
        # shuffled across registers, which Triton cannot express directly.
        partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
        xp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
        wp = 1.0 + tl.load(w_ptr + partner, mask=d < DIM, other=0.0).to(tl.float32)
        yp = xp * rstd[:, None] * wp
        fi = tl.where(d < half, d, d - half)
        angle = pos_f * tl.load(inv_freq_ptr + fi, mask=d < ROT, other=0.0)
        c = tl.cos(angle)
        s = tl.sin(angle)
        y = tl.where(d < half, y * c - yp * s, tl.where(d < ROT, y * c + yp * s, y))
    return y


_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def _e4m3_value(x):
    """fp32 holding ``x.clamp(-448, 448)`` rounded to the nearest e4m3 value, ties to even (NaN
    stays NaN): what torch's cast stores, so the final ``.to(fp8)`` is exact.

    Rounded here rather than left to the cast because the Triton interpreter's fp32 -> fp8 cast
    rounds ties away from zero and drops the mantissa carry (-124 became -64), so CPU tests could
    not check the kernel bit for bit; on the GPU this is a few ALU ops in a memory-bound kernel,
    and both paths then store the same bits.
    """
    x = tl.clamp(x.to(tl.float32), -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = x.to(tl.int32, bitcast=True)
    # e4m3 keeps 3 mantissa bits: values of binary exponent e lie on a grid of step 2**(e - 3),
    # and below the smallest normal (2**-6) on the subnormal grid 2**-9.
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    # |x| / step < 16 is exact (a power of two). Adding 1.5 * 2**23 leaves no fraction bits, so
    # fp32's own round-to-nearest-even makes it an integer; subtracting and scaling back are exact.
    r = ((tl.abs(x) * inv_step + 12582912.0) - 12582912.0) * step
    # The sign goes back as a bit: negating would turn -0.0 into +0.0 in the interpreter.
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _cache_value(x, dst_ptr):
    """fp32 ``x`` ready for the cast into the cache ``dst_ptr`` points into: clamped and rounded
    to e4m3 for an fp8 cache (decided at compile time from the pointer type), as is otherwise."""
    if dst_ptr.dtype.element_ty == tl.float8e4nv:
        y = _e4m3_value(x)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _producer_kernel(
    qkv_ptr, stride_qkv_t, pos_ptr, slot_ptr, inv_freq_ptr,
    qw_ptr, kw_ptr, iqw_ptr, ikw_ptr,
    q_dst_ptr, q_dst_col, stride_qd_t, stride_qd_h,
    iq_dst_ptr, iq_dst_col, stride_iqd_t, stride_iqd_h,
    kc_ptr, vc_ptr, stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h,
    ic_ptr, stride_ic_p, stride_ic_s,
    page_size, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HIDX: tl.constexpr, DI: tl.constexpr,
    ROT: tl.constexpr, HB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr, PDL: tl.constexpr = 0,
):
    grid_dependency(PDL)
    t = tl.program_id(0)
    u = tl.program_id(1)
    NQU: tl.constexpr = (HQ + HB - 1) // HB
    NKU: tl.constexpr = (HKV + HB - 1) // HB
    NIU: tl.constexpr = (HIDX + HB - 1) // HB
    pos_f = tl.load(pos_ptr + t).to(tl.float32)
    slot = tl.load(slot_ptr + t)
    page = slot // page_size
    poff = slot % page_size
    h = tl.arange(0, HB)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    di = tl.arange(0, BLOCK_DI)[None, :]
    # Each branch uses its own names: Triton merges variables assigned in sibling branches,
    # and the index tiles ([HB, BLOCK_DI]) may differ in shape from the main ones.
    if u < NQU:
        hq0 = u * HB
        yq = _norm_rope_tile(qkv_ptr, stride_qkv_t, t, hq0 * D, HQ - hq0, qw_ptr, inv_freq_ptr, pos_f, eps,
                             D, ROT, HB, BLOCK_D)
        q_dst = q_dst_ptr + t * stride_qd_t + q_dst_col + (hq0 + h) * stride_qd_h + d
        tl.store(q_dst, yq.to(q_dst_ptr.dtype.element_ty), mask=(hq0 + h < HQ) & (d < D))
    elif u < NQU + NKU:
        hk0 = (u - NQU) * HB
        yk = _norm_rope_tile(qkv_ptr, stride_qkv_t, t, (HQ + hk0) * D, HKV - hk0, kw_ptr, inv_freq_ptr, pos_f, eps,
                             D, ROT, HB, BLOCK_D)
        k_dst = kc_ptr + page * stride_kc_p + poff * stride_kc_s + (hk0 + h) * stride_kc_h + d
        yk = _cache_value(yk, kc_ptr)
        tl.store(k_dst, yk.to(kc_ptr.dtype.element_ty), mask=(hk0 + h < HKV) & (d < D) & (slot >= 0))
    elif u < NQU + 2 * NKU:
        hv0 = (u - NQU - NKU) * HB
        v_mask = (hv0 + h < HKV) & (d < D)
        v = tl.load(qkv_ptr + t * stride_qkv_t + (HQ + HKV + hv0 + h) * D + d, mask=v_mask, other=0.0)
        v_dst = vc_ptr + page * stride_vc_p + poff * stride_vc_s + (hv0 + h) * stride_vc_h + d
        v = _cache_value(v, vc_ptr)
        tl.store(v_dst, v.to(vc_ptr.dtype.element_ty), mask=v_mask & (slot >= 0))
    elif u < NQU + 2 * NKU + NIU:
        hi0 = (u - NQU - 2 * NKU) * HB
        yi = _norm_rope_tile(qkv_ptr, stride_qkv_t, t, (HQ + 2 * HKV) * D + hi0 * DI, HIDX - hi0, iqw_ptr,
                             inv_freq_ptr, pos_f, eps, DI, ROT, HB, BLOCK_DI)
        iq_dst = iq_dst_ptr + t * stride_iqd_t + iq_dst_col + (hi0 + h) * stride_iqd_h + di
        tl.store(iq_dst, yi.to(iq_dst_ptr.dtype.element_ty), mask=(hi0 + h < HIDX) & (di < DI))
    else:
        yik = _norm_rope_tile(qkv_ptr, stride_qkv_t, t, (HQ + 2 * HKV) * D + HIDX * DI, 1, ikw_ptr,
                              inv_freq_ptr, pos_f, eps, DI, ROT, HB, BLOCK_DI)
        ik_dst = ic_ptr + page * stride_ic_p + poff * stride_ic_s + h * 0 + di
        yik = _cache_value(yik, ic_ptr)
        tl.store(ik_dst, yik.to(ic_ptr.dtype.element_ty), mask=(h == 0) & (di < DI) & (slot >= 0))


def norm_rope_cache_write(
    qkv: Tensor,
    positions: Tensor,
    slot_mapping: Tensor,
    layout: QKVLayout,
    inv_freq: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    index_q_norm: Tensor | None = None,
    index_k_norm: Tensor | None = None,
    index_k_cache: Tensor | None = None,
    q_out: Tensor | None = None,
    iq_out: Tensor | None = None,
) -> None:
    """Norm + RoPE q, k, iq, ik; write K/V and index-K into the paged caches (one launch).

    Args:
        qkv: ``[T, layout.width]`` fused projection output ``[q | k | v | iq | ik]``, rows
            contiguous. q (and iq) are rewritten in place unless ``q_out`` / ``iq_out`` is given.
        positions: int64 ``[T]``; slot_mapping: int64 ``[T]``, ``-1`` rows write no cache.
        inv_freq: fp32 ``[rotary_dim // 2]`` (see :func:`rope_inv_freq`).
        q_norm, k_norm: ``[head_dim]`` Gemma weights (offsets: the norm uses ``1 + w``).
        k_cache, v_cache: one layer's ``[num_pages, page_size, num_kv_heads, head_dim]``, of a
            cache dtype (``kvcache.paged.CACHE_DTYPES``; fp8 e4m3 is clamped to +-448 and rounded
            to nearest even, as ``to_cache_dtype``).
        index_q_norm, index_k_norm: ``[index_dim]``; index_k_cache: one sparse layer's
            ``[num_pages, page_size, index_dim]``; all three required iff ``layout.has_index``.
        q_out: optional ``[T, num_q_heads, head_dim]``; iq_out: optional ``[T, Hidx, index_dim]``.
    """
    _check_args(qkv, positions, slot_mapping, layout, inv_freq, k_cache, v_cache, index_k_cache, q_out, iq_out)
    check_device("norm_rope_cache_write", qkv, k_cache, v_cache)
    L, T = layout, qkv.shape[0]
    if T == 0:
        return
    hb = max(2, min(16, next_pow2(max(L.num_q_heads, L.num_kv_heads, L.num_index_heads))))
    n_units = -(-L.num_q_heads // hb) + 2 * -(-L.num_kv_heads // hb)
    if L.has_index:
        n_units += -(-L.num_index_heads // hb) + 1
    if q_out is None:
        q_dst, q_col, q_st, q_sh = qkv, 0, qkv.stride(0), L.head_dim
    else:
        q_dst, q_col, q_st, q_sh = q_out, 0, q_out.stride(0), q_out.stride(1)
    icache, iqw, ikw = (index_k_cache, index_q_norm, index_k_norm) if L.has_index else (k_cache, q_norm, k_norm)
    if not L.has_index:
        iq_dst, iq_col, iq_st, iq_sh = qkv, 0, 0, 0
    elif iq_out is None:
        iq_dst, iq_col, iq_st, iq_sh = qkv, L.iq_offset, qkv.stride(0), L.index_dim
    else:
        iq_dst, iq_col, iq_st, iq_sh = iq_out, 0, iq_out.stride(0), iq_out.stride(1)
    di = L.index_dim if L.has_index else L.head_dim
    _producer_kernel[(T, n_units)](
        qkv, qkv.stride(0), positions, slot_mapping, inv_freq,
        q_norm, k_norm, iqw, ikw,
        q_dst, q_col, q_st, q_sh,
        iq_dst, iq_col, iq_st, iq_sh,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        icache, icache.stride(0), icache.stride(1),
        k_cache.shape[1], L.eps,
        HQ=L.num_q_heads, HKV=L.num_kv_heads, D=L.head_dim, HIDX=L.num_index_heads, DI=di,
        ROT=L.rotary_dim, HB=hb, BLOCK_D=next_pow2(L.head_dim), BLOCK_DI=next_pow2(di),
        num_warps=4, **pdl_launch(qkv.device),
    )


def _check_args(qkv: Tensor, positions: Tensor, slot_mapping: Tensor, layout: QKVLayout, inv_freq: Tensor,
                k_cache: Tensor, v_cache: Tensor, index_k_cache: Tensor | None,
                q_out: Tensor | None, iq_out: Tensor | None) -> None:
    L = layout
    T = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != L.width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {L.width}] with contiguous rows for {L}, got {tuple(qkv.shape)}")
    if positions.shape != (T,) or slot_mapping.shape != (T,):
        raise ValueError(f"positions and slot_mapping must be [{T}], got {tuple(positions.shape)}, "
                         f"{tuple(slot_mapping.shape)}")
    if inv_freq.shape != (L.rotary_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be fp32 [{L.rotary_dim // 2}] (use rope_inv_freq), got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache), ("index_k_cache", index_k_cache)):
        if c is not None:
            check_cache_dtype(name, c.dtype)
    want = (L.num_kv_heads, L.head_dim)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != want or c.stride(3) != 1:
            raise ValueError(f"{name} must be one layer's [num_pages, page_size, {want[0]}, {want[1]}], "
                             f"got {tuple(c.shape)}")
    if L.has_index and (index_k_cache is None or index_k_cache.dim() != 3 or index_k_cache.shape[2] != L.index_dim):
        raise ValueError(f"a layout with index heads needs index_k_cache [num_pages, page_size, {L.index_dim}]")
    if q_out is not None and (tuple(q_out.shape) != (T, L.num_q_heads, L.head_dim) or q_out.stride(2) != 1):
        raise ValueError(f"q_out must be [{T}, {L.num_q_heads}, {L.head_dim}], got {tuple(q_out.shape)}")
    if iq_out is not None and (tuple(iq_out.shape) != (T, L.num_index_heads, L.index_dim) or iq_out.stride(2) != 1):
        raise ValueError(f"iq_out must be [{T}, {L.num_index_heads}, {L.index_dim}], got {tuple(iq_out.shape)}")


__all__ = ["HeadNorms", "NormRoped", "QKVLayout", "norm_rope_cache_write", "norm_rope_torch"]
