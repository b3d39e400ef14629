"""MXFP8 weight tiles in Triton registers: the E8M0 scales of a tile and the dequantised values,
shared by the kernels that read fp8 weights (``moe``, ``fp8_linear``). Format: ``mxfp8``."""

import triton
import triton.language as tl


@triton.jit
def dequant_fp8(q, scale_byte):
    """MXFP8: ``float(q) * 2 ** (scale_byte - 127)`` in fp32, the power of two built from its
    exponent bits (exact; byte 0 is the subnormal ``2 ** -127``), as ``mxfp8.dequantize_mxfp8``."""
    b = scale_byte.to(tl.int32)
    bits = tl.where(b > 0, b << 23, 1 << 22)
    return q.to(tl.float32) * bits.to(tl.float32, bitcast=True)


@triton.jit
def block_scales(s_base, k0, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The E8M0 bytes of columns ``[k0, k0 + BLOCK_K)`` as a ``[BLOCK_K, BLOCK_N]`` tile: one load
    per 32 columns, broadcast over them in registers (``BLOCK_K >= 32``); ``s_base`` points at
    each N row's scales ``[1, BLOCK_N]``."""
    nb: tl.constexpr = BLOCK_K // 32
    sc = tl.load(s_base + (k0 // 32 + tl.arange(0, nb))[:, None])  # [nb, BLOCK_N]
    return tl.reshape(tl.broadcast_to(sc[:, None, :], (nb, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
