"""The SwiGLU-OAI Triton kernel against the torch reference ``layers.swiglu_oai`` and an fp64
reading of the formula (interpreter on CPU; compiled on a GPU)."""

import math

import pytest
import torch
from helpers.paged import DEV

from models.minimax_m3.kernels.activation import swiglu_oai_triton
from models.minimax_m3.layers import swiglu_oai


def fp64(gate, up, alpha, limit):
    out = torch.empty(gate.shape, dtype=torch.float64)
    for i, (g, u) in enumerate(zip(gate.double().flatten().tolist(), up.double().flatten().tolist())):
        g, u = min(g, limit), max(-limit, min(u, limit))
        out.view(-1)[i] = g * 0.5 * (1 + math.tanh(alpha * g / 2)) * (u + 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,inter", [(1, 24), (5, 96), (3, 1500)])  # 1500: two column blocks, a ragged tail
def test_swiglu_kernel_matches_reference(T, inter, dtype):
    g = torch.Generator(device=DEV).manual_seed(T + inter)
    gu = (torch.randn(T, 2 * inter, generator=g, device=DEV) * 6).to(dtype)  # many values past +-7
    out = torch.full((T, inter), float("nan"), dtype=dtype, device=DEV)
    swiglu_oai_triton(gu, 1.702, 7.0, out)
    want = fp64(gu[:, :inter].cpu(), gu[:, inter:].cpu(), 1.702, 7.0)
    ref = swiglu_oai(gu[:, :inter], gu[:, inter:], 1.702, 7.0)
    assert not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding (the interpreter truncates)
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), atol=tol, rtol=tol)


def test_swiglu_kernel_rejects_bad_shapes():
    with pytest.raises(ValueError, match="gate_up"):
        swiglu_oai_triton(torch.zeros(2, 5, device=DEV), 1.702, 7.0)
    with pytest.raises(ValueError, match="out must be"):
        swiglu_oai_triton(torch.zeros(2, 8, device=DEV), 1.702, 7.0, torch.zeros(2, 3, device=DEV))
