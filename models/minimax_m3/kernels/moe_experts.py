"""Which down-projection weights a fused-MoE program reads: one rule for the kernels of both
MoE paths (``moe``'s dequantising kernels, ``moe_fp8_mma``'s fp8 tensor-core ones)."""

import triton
import triton.language as tl


@triton.jit
def down_weights(e, E: tl.constexpr, I, IS, w2_ptr, stride_w2_e, stride_w2_h, s2_ptr, stride_s2_e, stride_s2_h,
                 sd_ptr, stride_sd_h, ssd_ptr, stride_ssd_h):
    """``(K, weights, row stride, scales, scale row stride)`` of expert ``e``'s down projection:
    routed expert ``e < E`` from the stacked ``w2 [E, H, I]`` (and its scales), else the shared
    expert's ``[H, Is]``."""
    if e < E:
        KD = I
        w_ptr = w2_ptr + e.to(tl.int64) * stride_w2_e
        stride_wh = stride_w2_h
        s_ptr = s2_ptr + e.to(tl.int64) * stride_s2_e
        stride_sh = stride_s2_h
    else:
        KD = IS
        w_ptr = sd_ptr
        stride_wh = stride_sd_h
        s_ptr = ssd_ptr
        stride_sh = stride_ssd_h
    return KD, w_ptr, stride_wh, s_ptr, stride_sh
