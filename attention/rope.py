"""The rotary frequency table, shared by the model's torch path and the fused Triton producer."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_inv_freq(theta: float, rotary_dim: int, device: torch.device | str | None = "cpu") -> Tensor:
    """``inv_freq[i] = theta ** (-2i / rotary_dim)``, fp32 ``[rotary_dim // 2]``.

    Both paths take this tensor rather than recomputing it, so the kernel's angle
    ``fp32(pos) * inv_freq[i]`` rounds exactly like the torch path's (at positions near 1M an
    ulp of difference in inv_freq would move the angle by ~0.1 rad).
    """
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return (1.0 / (theta**exponent)).to(torch.float32).to(device)
