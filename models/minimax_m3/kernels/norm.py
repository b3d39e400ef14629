"""Gemma RMSNorm, plain and fused with the residual add, in Triton (one program per row).

``y = x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim, all in fp32, stored in the
output dtype; the stored weight is the checkpoint's offset (near zero), not ``1 + w``.

``gemma_fused_add_rmsnorm`` has flashinfer's in-place semantics, which the layer boundaries of
the model use (``residual`` carries the stream, ``x`` the sub-layer output):
``residual = residual + x`` (added in fp32, stored rounded to the residual dtype), then
``x = norm(the fp32 sum, not the rounded one) * (1 + w)``. Normalising the unrounded sum
differs from ``GemmaRMSNorm(residual)`` by the bf16 rounding of the sum only.

Rows of up to ``_MAX_ROW`` columns (H = 6144 for M3) stay in registers, so x and the residual
are read once; wider rows take two passes over memory (sum of squares, then the output; the
second pass re-reads x and the not yet overwritten residual, so the fp32 sum is recomputed
exactly). Both launches are graph-safe: grid ``(T,)``, no host work.

``gemma_rmsnorm_torch`` and ``gemma_fused_add_rmsnorm_torch`` are the same semantics in plain
torch (the references and the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.pdl import grid_dependency, pdl_launch
from attention.kernels.triton_utils import check_device, next_pow2
from models.minimax_m3.layers import gemma_rms_normalize

Tensor = torch.Tensor
_MAX_ROW = 8192  # widest row kept in registers (32 fp32 per thread at 8 warps)


# --------------------------------------------------------------------------------------------
# plain torch


def gemma_rmsnorm_torch(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    """Plain-torch twin of :func:`gemma_rmsnorm`."""
    _check_args("gemma_rmsnorm", x, weight, out=out)
    out.copy_(gemma_rms_normalize(x, weight, eps))


def gemma_fused_add_rmsnorm_torch(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """Plain-torch twin of :func:`gemma_fused_add_rmsnorm` (in place on ``x`` and ``residual``)."""
    _check_args("gemma_fused_add_rmsnorm", x, weight, residual=residual)
    s = residual.float() + x.float()
    residual.copy_(s)
    x.copy_(gemma_rms_normalize(s, weight, eps))


# --------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _gemma_norm_kernel(
    x_ptr, stride_x, res_ptr, stride_res, w_ptr, out_ptr, stride_out, eps,
    H: tl.constexpr, BLOCK_H: tl.constexpr, FUSED_ADD: tl.constexpr, PDL: tl.constexpr = 0,
):
    """Row t: [residual += x;] out = norm(x or the fp32 sum) * (1 + w)."""
    grid_dependency(PDL)
    t = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + t * stride_x
    r_row = res_ptr + t * stride_res
    o_row = out_ptr + t * stride_out
    c = tl.arange(0, BLOCK_H)
    if BLOCK_H >= H:
        m = c < H
        v = tl.load(x_row + c, mask=m, other=0.0).to(tl.float32)
        if FUSED_ADD:
            v += tl.load(r_row + c, mask=m, other=0.0).to(tl.float32)
            tl.store(r_row + c, v.to(res_ptr.dtype.element_ty), mask=m)
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
        w = 1.0 + tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(o_row + c, (v * rstd * w).to(out_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([BLOCK_H], tl.float32)
        for k in range(0, H, BLOCK_H):
            m = k + c < H
            v = tl.load(x_row + k + c, mask=m, other=0.0).to(tl.float32)
            if FUSED_ADD:
                v += tl.load(r_row + k + c, mask=m, other=0.0).to(tl.float32)
            acc += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
        for k in range(0, H, BLOCK_H):
            m = k + c < H
            v = tl.load(x_row + k + c, mask=m, other=0.0).to(tl.float32)
            if FUSED_ADD:
                # read before this chunk of the residual is overwritten: the same fp32 sum
                v += tl.load(r_row + k + c, mask=m, other=0.0).to(tl.float32)
                tl.store(r_row + k + c, v.to(res_ptr.dtype.element_ty), mask=m)
            w = 1.0 + tl.load(w_ptr + k + c, mask=m, other=0.0).to(tl.float32)
            tl.store(o_row + k + c, (v * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


def norm_launch_config(H: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for rows of H columns: the whole row up to ``_MAX_ROW``, else
    ``_MAX_ROW``-wide chunks; about 32 fp32 values per thread."""
    block = min(next_pow2(H), _MAX_ROW)
    return block, max(1, min(8, block // 1024))


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, out: Tensor) -> None:
    T, H = x.shape
    if T == 0:
        return
    block, warps = norm_launch_config(H)
    res = residual if residual is not None else x  # unused without FUSED_ADD
    _gemma_norm_kernel[(T,)](
        x, x.stride(0), res, res.stride(0), weight, out, out.stride(0), float(eps),
        H=H, BLOCK_H=block, FUSED_ADD=residual is not None, num_warps=warps, **pdl_launch(x.device),
    )


def gemma_rmsnorm(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    """``out = x * rsqrt(mean(x^2) + eps) * (1 + weight)`` per row, in fp32.

    Args:
        x: ``[T, H]``, rows contiguous. weight: ``[H]`` (the Gemma offset; any float dtype).
        eps: added to the mean square. out: ``[T, H]`` (any float dtype; may be ``x`` itself).
    """
    _check_args("gemma_rmsnorm", x, weight, out=out)
    check_device("gemma_rmsnorm", x, weight, out)
    _launch(x, None, weight, eps, out)


def gemma_fused_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: ``residual += x`` (fp32 add, stored in residual's dtype), then
    ``x = norm(fp32 sum) * (1 + weight)`` (flashinfer's ``gemma_fused_add_rmsnorm``).

    Args:
        x: ``[T, H]`` sub-layer output, overwritten with the normed sum; rows contiguous.
        residual: ``[T, H]`` residual stream, overwritten with ``residual + x``.
        weight: ``[H]`` Gemma offset. eps: added to the mean square.
    """
    _check_args("gemma_fused_add_rmsnorm", x, weight, residual=residual)
    check_device("gemma_fused_add_rmsnorm", x, residual, weight)
    _launch(x, residual, weight, eps, x)


def _check_args(name: str, x: Tensor, weight: Tensor, out: Tensor | None = None,
                residual: Tensor | None = None) -> None:
    if x.dim() != 2 or not x.is_floating_point() or x.stride(1) != 1:
        raise ValueError(f"{name}: x must be a float [T, H] tensor with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)}")
    T, H = x.shape
    if weight.shape != (H,) or not weight.is_floating_point() or not weight.is_contiguous():
        raise ValueError(f"{name}: weight must be a contiguous float [{H}] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    for arg, t in (("out", out), ("residual", residual)):
        if t is not None and (t.shape != (T, H) or not t.is_floating_point() or t.stride(1) != 1):
            raise ValueError(f"{name}: {arg} must be a float [{T}, {H}] tensor with contiguous rows, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if residual is not None and residual.data_ptr() == x.data_ptr():
        raise ValueError(f"{name}: residual and x must be different tensors")


__all__ = ["gemma_fused_add_rmsnorm", "gemma_fused_add_rmsnorm_torch", "gemma_rmsnorm", "gemma_rmsnorm_torch",
           "norm_launch_config"]
