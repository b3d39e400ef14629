"""MXFP8 weight tiles in Triton registers: the E8M0 scales of a tile and the dequantised values,
shared by the kernels that read fp8 weights (``moe``, ``fp8_linear``). Format: ``mxfp8``.

Scales reach the kernels as bytes or, where the layout allows (``scale_words``), as the same
memory read in little-endian int32 words of four scales. The words matter on the GPU: Triton
pipelines a load through asynchronous copies only when each element is at least 4 bytes, so
one-byte scale loads stayed synchronous inside the K loop and every K step of an fp8 kernel
waited a full memory latency for its scales (H200 SASS: ``LDG.E.U8`` in the loop, no
``LDGSTS`` for the scales); read as words they stream ahead with the weights.
"""

import torch
import triton
import triton.language as tl

# Scale exponents (byte - 127) for which f16 factors (``scale_factor(F16=True)``) hold every
# weight of a block: up
# to 2**7 an e4m3 value (<= 448) times the scale stays below f16's 65504; from 2**-24 (f16's
# smallest subnormal) the scale itself exists. Within them the f16 weight equals the exact
# product wherever it is >= 2**-14 (f16's normals; below, it rounds to a multiple of 2**-24).
F16_SCALE_EXPONENTS = (-24, 7)


def scale_words(scale: torch.Tensor) -> torch.Tensor | None:
    """``scale`` (uint8 ``[..., K/32]``) viewed as int32 words of four scales ``[..., K/128]``
    (the same memory), or None where its layout does not allow it (a row of scales not a
    multiple of 4 bytes, or unaligned); the kernels then read bytes."""
    if scale.dtype != torch.uint8 or scale.dim() == 0 or scale.shape[-1] % 4 or scale.stride(-1) != 1 \
            or scale.storage_offset() % 4 or any(s % 4 for s in scale.stride()[:-1]):
        return None
    return scale.view(torch.int32)


@triton.jit
def scale_bytes(s_base, blk, mask, WORDS: tl.constexpr):
    """The E8M0 bytes (int32) of scale blocks ``blk`` (32 columns each) from each row's scales at
    ``s_base``: bytes, or with ``WORDS`` byte ``blk % 4`` of word ``blk // 4``. Masked-off
    elements read 127 (a unit scale)."""
    if WORDS:
        w = tl.load(s_base + blk // 4, mask=mask, other=0x7F7F7F7F)
        out = (w >> ((blk % 4) * 8)) & 0xFF
    else:
        out = tl.load(s_base + blk, mask=mask, other=127).to(tl.int32)
    return out


@triton.jit
def scale_factor(byte, F16: tl.constexpr):
    """``2 ** (byte - 127)`` from its exponent bits (exact; log2 and exp2 are approximate on the
    GPU): in fp32 (byte 0 is the subnormal ``2 ** -127``) or, with ``F16``, in f16 (normal
    ``(e + 15) << 10`` from 2**-14, subnormal ``1 << (e + 24)`` below; exact for exponents in
    ``F16_SCALE_EXPONENTS``, which the caller checks)."""
    if F16:
        e = byte - 127
        bits = tl.where(e >= -14, (e + 15) << 10, 1 << tl.maximum(e + 24, 0))
        out = bits.to(tl.int16).to(tl.float16, bitcast=True)
    else:
        out = tl.where(byte > 0, byte << 23, 1 << 22).to(tl.float32, bitcast=True)
    return out


@triton.jit
def block_scale_factors(s_base, k, k_end, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, F16: tl.constexpr,
                        WORDS: tl.constexpr, MASKED: tl.constexpr):
    """The scale factors (``scale_factor``) of columns ``[k, k + BLOCK_K)`` as a ``[BLOCK_K,
    BLOCK_N]`` tile (``BLOCK_K >= 32``, ``k`` a multiple of 32): one load and one factor per 32
    columns, broadcast over them in registers; ``s_base`` points at each N row's scales
    ``[1, BLOCK_N]``. With ``WORDS`` each load is the int32 word holding the block's byte (four
    neighbouring blocks load the same word: the bytes from memory are the same, and a 4-byte
    load is one Triton pipelines). ``MASKED``: blocks from column ``k_end`` on (a multiple of
    32) read a unit scale (their weights are masked off by the caller)."""
    nb: tl.constexpr = BLOCK_K // 32
    blk = (k // 32 + tl.arange(0, nb))[:, None]
    if MASKED:
        sc = scale_bytes(s_base, blk, blk < k_end // 32, WORDS)  # [nb, BLOCK_N]
    elif WORDS:
        sc = (tl.load(s_base + blk // 4) >> ((blk % 4) * 8)) & 0xFF
    else:
        sc = tl.load(s_base + blk).to(tl.int32)
    f = scale_factor(sc, F16)
    return tl.reshape(tl.broadcast_to(f[:, None, :], (nb, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
