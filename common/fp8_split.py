"""A row of values as two e4m3 parts scaled by a power of two, in torch: the rounding the Triton
kernels' fp8 tensor-core dots use (``attention.kernels.triton_utils.fp8_split_rows`` is the
kernel side, and must round the same way).

Each row ``v`` gets the largest power of two ``2**e`` with ``amax(|v|) * 2**e <= 448`` (e4m3's
largest finite value); ``hi = e4m3(v * 2**e)`` carries e4m3's 4 significant bits and
``lo = e4m3(v * 2**e - hi)`` the next 4, so ``hi + lo`` holds about a bf16's 8 relative to the
row's largest entry (one e4m3 alone errs by up to 2**-4 per entry). ``e`` is computed from the
float's exponent and mantissa (``frexp``), not from ``log2``, which the GPU only approximates.
"""

from __future__ import annotations

import torch


def fp8_split_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``v [..., C]`` -> ``(hi, lo)`` e4m3 ``[..., C]`` and ``e`` int32 ``[..., 1]`` with
    ``hi + lo ~= v * 2**e`` (an all-zero row: ``e = 0``; ``e`` clamped to ``[-126, 127]``)."""
    vf = v.float()
    mant, exp = torch.frexp(vf.abs().amax(dim=-1, keepdim=True))  # amax = mant * 2**exp, mant in [0.5, 1)
    e = (9 - exp - (mant > 0.875).int()).clamp(-126, 127)  # amax = (2 mant) 2**(exp - 1); 448 = 1.75 * 2**8
    e = torch.where(mant > 0, e, torch.zeros_like(e)).to(torch.int32)
    vs = vf * torch.pow(2.0, e.float())
    hi = vs.to(torch.float8_e4m3fn)
    return hi, (vs - hi.float()).to(torch.float8_e4m3fn), e
