"""SwiGLU-OAI on a fused gate/up projection output, one kernel (the dense MLP's activation).

``out = min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1)`` with
``g, u`` the gate and up halves of ``gate_up [T, 2I]`` (gate first), computed in fp32 and stored
in ``out``'s dtype. The torch reference is ``models.minimax_m3.layers.swiglu_oai``: same maths,
about six elementwise kernels and two fp32 temporaries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.triton_utils import check_device

Tensor = torch.Tensor


@triton.jit
def swiglu_oai(g, u, alpha, limit):
    """SwiGLU-OAI of fp32 gate and up values of any (equal) shape: the one definition every
    kernel applying the activation calls (the dense MLP's, the MoE epilogues and row kernels)."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(alpha * g) * (u + 1.0)


@triton.jit
def _swiglu_oai_kernel(gu_ptr, stride_gu, out_ptr, stride_out, inter, alpha, limit, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + t * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = swiglu_oai(g, u, alpha, limit)
    tl.store(out_ptr + t * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_oai_triton(gate_up: Tensor, alpha: float, limit: float, out: Tensor | None = None) -> Tensor:
    """``gate_up [T, 2I]`` (rows contiguous) -> ``out [T, I]`` (allocated if None); capturable.

    Raises:
        ValueError: shapes that do not match, or non-contiguous rows.
    """
    check_device("swiglu_oai", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tuple(out.shape) != (T, inter) or out.stride(1) != 1:
        raise ValueError(f"out must be [{T}, {inter}] with contiguous rows, got {tuple(out.shape)}")
    if T:
        block = min(1024, triton.next_power_of_2(inter))
        _swiglu_oai_kernel[(T, triton.cdiv(inter, block))](gate_up, gate_up.stride(0), out, out.stride(0), inter,
                                                          float(alpha), float(limit), BLOCK=block, num_warps=4)
    return out
