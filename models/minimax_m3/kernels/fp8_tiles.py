"""MXFP8 weight tiles in Triton registers: the E8M0 scales of a tile and the dequantised values,
shared by the kernels that read fp8 weights (``moe``, ``fp8_linear``). Format: ``mxfp8``."""

import triton
import triton.language as tl

# Scale exponents (byte - 127) for which ``dequant_fp8_f16`` holds every weight of a block: up
# to 2**7 an e4m3 value (<= 448) times the scale stays below f16's 65504; from 2**-24 (f16's
# smallest subnormal) the scale itself exists. Within them the f16 weight equals the exact
# product wherever it is >= 2**-14 (f16's normals; below, it rounds to a multiple of 2**-24).
F16_SCALE_EXPONENTS = (-24, 7)


@triton.jit
def dequant_fp8(q, scale_byte):
    """MXFP8: ``float(q) * 2 ** (scale_byte - 127)`` in fp32, the power of two built from its
    exponent bits (exact; byte 0 is the subnormal ``2 ** -127``), as ``mxfp8.dequantize_mxfp8``."""
    b = scale_byte.to(tl.int32)
    bits = tl.where(b > 0, b << 23, 1 << 22)
    return q.to(tl.float32) * bits.to(tl.float32, bitcast=True)


@triton.jit
def dequant_fp8_f16(q, scale_byte):
    """MXFP8 in f16: ``f16(q) * f16(2 ** (scale_byte - 127))``, a packed e4m3 -> f16 convert and a
    packed f16 multiply per two weights (the fp32 route of :func:`dequant_fp8` spends a convert to
    fp32, an fp32 multiply and a convert back per weight). Exact for scale exponents in
    ``F16_SCALE_EXPONENTS`` down to
    products of 2**-14 (the caller checks the range); the power of two from its bits: normal
    ``(e + 15) << 10`` from 2**-14, subnormal ``1 << (e + 24)`` below."""
    e = scale_byte.to(tl.int32) - 127
    bits = tl.where(e >= -14, (e + 15) << 10, 1 << tl.maximum(e + 24, 0))
    return q.to(tl.float16) * bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def block_scales(s_base, k0, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The E8M0 bytes of columns ``[k0, k0 + BLOCK_K)`` as a ``[BLOCK_K, BLOCK_N]`` tile: one load
    per 32 columns, broadcast over them in registers (``BLOCK_K >= 32``); ``s_base`` points at
    each N row's scales ``[1, BLOCK_N]``."""
    nb: tl.constexpr = BLOCK_K // 32
    sc = tl.load(s_base + (k0 // 32 + tl.arange(0, nb))[:, None])  # [nb, BLOCK_N]
    return tl.reshape(tl.broadcast_to(sc[:, None, :], (nb, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
