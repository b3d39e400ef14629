"""MiniMax-M3 layers against small plain-torch references (fp64 where exactness matters)."""

from __future__ import annotations

import math

import pytest
import torch

from attention.rope import rope_inv_freq
from models.minimax_m3.kernels.producer import rope_fp32
from models.minimax_m3.layers import (
    BlockSparseMoE,
    DenseMLP,
    GemmaRMSNorm,
    gemma_rms_normalize,
    gemma_rmsnorm,
    route,
    swiglu_oai,
    swiglu_oai_f32,
)
from models.minimax_m3.ops import TorchMoE, make_ops


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 32), (1, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rmsnorm(shape, dtype):
    g = gen(sum(shape))
    norm = GemmaRMSNorm(shape[-1], 1e-6, dtype)
    w = torch.randn(shape[-1], generator=g) * 0.2
    norm.weight.data.copy_(w)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    xd, wd = x.double(), norm.weight.double()
    ref = xd / torch.sqrt((xd**2).mean(-1, keepdim=True) + 1e-6) * (1 + wd)
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), atol=tol, rtol=tol)
    # the weight is an offset: zero weight is a plain RMS normalisation
    norm.weight.data.zero_()
    plain = xd / torch.sqrt((xd**2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x).double(), plain.to(dtype).double(), atol=tol, rtol=tol)


def rope_ref(x: torch.Tensor, pos: torch.Tensor, rd: int, theta: float) -> torch.Tensor:
    """Complex-number form: pair (i, i + rd/2) is the complex number x_i + i x_{i+rd/2}."""
    half = rd // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rd)
    ang = pos.double()[:, None] * inv[None]
    z = (torch.complex(x[..., :half].double(), x[..., half:rd].double())
         * torch.polar(torch.ones_like(ang), ang)[:, None])
    return torch.cat([z.real, z.imag, x[..., rd:].double()], dim=-1)


@pytest.mark.parametrize("heads,d,rd,theta", [(4, 32, 16, 1e4), (2, 128, 64, 5e6), (3, 16, 16, 1e4)])
def test_partial_neox_rope(heads, d, rd, theta):
    g = gen(d + rd)
    t = 9
    x = torch.randn(t, heads, d, generator=g)
    pos = torch.randint(0, 5000, (t,), generator=g)
    pos[0] = 0
    out = rope_fp32(x, pos, rope_inv_freq(theta, rd))
    assert out.dtype == torch.float32
    # fp32 angles (as the model's trained tables) are off by ~pos * 6e-8 rad
    torch.testing.assert_close(out.double(), rope_ref(x, pos, rd, theta), atol=1e-3, rtol=1e-3)
    assert torch.equal(out[..., rd:], x[..., rd:])  # dims past rotary_dim are untouched
    assert torch.allclose(out[0], x[0])  # position 0 is the identity
    # rotation preserves each pair's norm
    n_in = x[..., : rd // 2] ** 2 + x[..., rd // 2 : rd] ** 2
    n_out = out[..., : rd // 2] ** 2 + out[..., rd // 2 : rd] ** 2
    torch.testing.assert_close(n_out, n_in, atol=1e-4, rtol=1e-4)


def test_rope_of_bf16_input_is_fp32():
    x = torch.randn(4, 2, 32, generator=gen(1)).bfloat16()
    pos = torch.arange(4)
    out = rope_fp32(x, pos, rope_inv_freq(1e4, 16))
    assert out.dtype == torch.float32  # one rounding, at the producer's store
    torch.testing.assert_close(out.double(), rope_ref(x.float(), pos, 16, 1e4), atol=1e-5, rtol=1e-5)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    out = torch.empty_like(gate, dtype=torch.float64)
    for i, (g, u) in enumerate(zip(gate.double().flatten().tolist(), up.double().flatten().tolist())):
        g = min(g, limit)
        u = max(-limit, min(u, limit))
        out.view(-1)[i] = g * 0.5 * (1 + math.tanh(alpha * g / 2)) * (u + 1)  # overflow-free sigmoid
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_oai_with_clamps(dtype):
    g = gen(3)
    gate = (torch.randn(6, 40, generator=g) * 6).to(dtype)  # many values beyond +-7
    up = (torch.randn(6, 40, generator=g) * 6).to(dtype)
    assert (gate > 7).any() and (up < -7).any() and (gate < -7).any()
    out = swiglu_oai(gate, up, 1.702, 7.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), swiglu_ref(gate, up, 1.702, 7.0), atol=tol, rtol=tol)
    assert out.dtype == dtype


def test_dense_mlp_fused_gate_up():
    g = gen(4)
    m = DenseMLP(16, 24, 1.702, 7.0, torch.float32)
    wg, wu, wd = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(16, 24, generator=g)
    m.gate_up_proj.weight.data.copy_(torch.cat([wg, wu]))
    m.down_proj.weight.data.copy_(wd)
    x = torch.randn(5, 16, generator=g)
    ref = swiglu_ref(x.double() @ wg.double().T, x.double() @ wu.double().T, 1.702, 7.0) @ wd.double().T
    torch.testing.assert_close(m(x).double(), ref, atol=1e-4, rtol=1e-4)


def route_ref(x, gate_w, bias, k, scale):
    ids, ws = [], []
    for t in range(x.shape[0]):
        s = torch.sigmoid(gate_w.double() @ x[t].double())
        choice = (s + bias.double()).tolist()
        top = sorted(range(len(choice)), key=lambda e: -choice[e])[:k]
        tot = sum(s[e].item() for e in top)
        ids.append(top)
        ws.append([s[e].item() / tot * scale for e in top])
    return ids, ws


@pytest.mark.parametrize("t,e,k", [(7, 8, 2), (3, 16, 4), (1, 4, 1)])
def test_route_matches_reference(t, e, k):
    g = gen(t * e + k)
    x = torch.randn(t, 32, generator=g)
    gw = torch.randn(e, 32, generator=g) * 0.3
    bias = torch.randn(e, generator=g) * 0.3
    ids, w = route(x, gw, bias, k, 2.0)
    rid, rw = route_ref(x, gw, bias, k, 2.0)
    for i in range(t):
        order = {eid: wi for eid, wi in zip(ids[i].tolist(), w[i].tolist())}
        assert sorted(order) == sorted(rid[i])
        for eid, wi in zip(rid[i], rw[i]):
            assert abs(order[eid] - wi) < 1e-5
    torch.testing.assert_close(w.sum(-1), torch.full((t,), 2.0))  # renormalised, times 2.0


def test_route_bias_only_affects_selection():
    x = torch.randn(1, 8, generator=gen(5))
    gw = torch.randn(4, 8, generator=gen(6))
    s = torch.sigmoid(gw @ x[0])
    low = int(s.argmin())
    bias = torch.zeros(4)
    bias[low] = 10.0  # forces the weakest expert into the top-2
    ids, w = route(x, gw, bias, 2, 2.0)
    assert low in ids[0].tolist()
    other = [e for e in ids[0].tolist() if e != low][0]
    assert other == int(torch.topk(s, 1).indices)  # the remaining slot follows the unbiased score
    want = {low: s[low] / (s[low] + s[other]) * 2, other: s[other] / (s[low] + s[other]) * 2}
    for eid, wi in zip(ids[0].tolist(), w[0].tolist()):
        assert abs(wi - want[eid].item()) < 1e-6  # weights from s, without the bias


def test_route_padded_rows():
    g = gen(7)
    x = torch.randn(6, 16, generator=g)
    ids, w = route(x, torch.randn(8, 16, generator=g), torch.zeros(8), 2, 2.0, torch.tensor(4))
    assert (ids[4:] == -1).all() and (w[4:] == 0).all()
    assert (ids[:4] >= 0).all() and torch.allclose(w[:4].sum(-1), torch.full((4,), 2.0))


class MoE:
    """A BlockSparseMoE with the op table of one routed-expert implementation."""

    def __init__(self, module: BlockSparseMoE, impl: str) -> None:
        self.module, self.impl = module, impl

    def __call__(self, x, n=None):
        return make_ops("torch", x.device, x.dtype, self.impl).moe(self.module, x, n)

    def __getattr__(self, name):
        return getattr(self.module, name)


def make_moe(e: int, local: int, k: int, dtype=torch.float32, impl="auto", seed=0) -> MoE:
    g = gen(seed)
    m = BlockSparseMoE(32, e, local, k, 16, 24, 2.0, 1.702, 7.0, dtype).requires_grad_(False)
    for _name, p in m.named_parameters():
        std = 0.3 if p.dim() == 1 else p.shape[-1] ** -0.5 * 2
        p.data.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))
    return MoE(m, impl)


def moe_ref(m: BlockSparseMoE, x: torch.Tensor, num_real: int | None = None) -> torch.Tensor:
    """Per-token loop; experts the rank does not hold contribute nothing."""
    xd = x.double()
    ex, sh = m.experts, m.shared_experts
    i, si = ex.inter, sh.inter
    gu = sh.gate_up_proj.weight.double()
    out = swiglu_ref(xd @ gu[:si].T, xd @ gu[si:].T, 1.702, 7.0) @ sh.down_proj.weight.double().T
    rid, rw = route_ref(x, m.gate.weight, m.e_score_correction_bias, m.top_k, m.scale)
    for t in range(x.shape[0] if num_real is None else num_real):
        for e, wt in zip(rid[t], rw[t]):
            if e >= ex.num_experts:
                continue
            w13 = ex.w13[e].double()
            h = swiglu_ref(w13[:i] @ xd[t], w13[i:] @ xd[t], 1.702, 7.0)
            out[t] += wt * (ex.w2[e].double() @ h)
    return out


@pytest.mark.parametrize("impl", ["grouped", "loop"])
@pytest.mark.parametrize("t,e,local,k", [(9, 8, 8, 2), (5, 16, 16, 4), (1, 8, 8, 2), (12, 16, 4, 4)])
def test_moe_matches_reference(impl, t, e, local, k):
    m = make_moe(e, local, k, impl=impl, seed=t + e)
    x = torch.randn(t, 32, generator=gen(t))
    torch.testing.assert_close(m(x).double(), moe_ref(m, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_moe_padded_rows_never_reach_experts(impl):
    m = make_moe(8, 8, 2, impl=impl, seed=11)
    x = torch.randn(7, 32, generator=gen(12))
    n = torch.tensor(4)
    base = m(x, n)
    x2 = x.clone()
    x2[4:] = torch.randn(3, 32, generator=gen(13)) * 100  # wild padding must not leak into real rows
    out = m(x2, n)
    torch.testing.assert_close(out[:4], base[:4], atol=0, rtol=0)
    torch.testing.assert_close(out.double(), moe_ref(m, x2, num_real=4), atol=1e-3, rtol=1e-4)
    # padded rows carry only the (request-independent) shared expert: exactly, on the same batch shape
    # (a 3-row slice may take another GEMM blocking and differ in the last bits)
    torch.testing.assert_close(out[4:], m.shared_experts(x2)[4:], atol=0, rtol=0)


def test_moe_grouped_equals_loop_bf16():
    a = make_moe(16, 16, 4, torch.bfloat16, impl="grouped", seed=3)
    b = make_moe(16, 16, 4, torch.bfloat16, impl="loop", seed=3)
    x = torch.randn(10, 32, generator=gen(14)).bfloat16()
    ya, yb = a(x), b(x)
    assert ya.dtype == torch.bfloat16
    torch.testing.assert_close(ya.float(), yb.float(), atol=2e-2, rtol=2e-2)


def test_moe_impl_choice_is_one_op_table_entry():
    auto = make_ops("torch", "cpu", torch.float32, "auto").moe
    assert isinstance(auto, TorchMoE) and auto.grouped and auto.simulation is None
    assert make_ops("torch", "cpu", torch.float32, "loop").name == "torch+loop"
    with pytest.raises(ValueError, match="moe_impl"):
        make_ops("torch", "cpu", torch.float32, "fast")


@pytest.mark.cuda
def test_moe_grouped_cuda_no_sync_and_graph_replay():
    """The grouped MoE on CUDA bf16: no host sync, and one captured graph replays correctly
    for new inputs, new routings and a new real-token count."""
    host = make_moe(16, 16, 4, torch.bfloat16, impl="grouped", seed=5)  # same weights, fp64 reference
    m = make_moe(16, 16, 4, torch.bfloat16, impl="grouped", seed=5)
    m.module.cuda()
    x = torch.randn(8, 32, generator=gen(20)).bfloat16().cuda()
    n = torch.tensor(8, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        m(x, n)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(x, n)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(x, n)
    for seed, real in ((21, 8), (22, 5), (23, 1)):
        x.copy_(torch.randn(8, 32, generator=gen(seed)).bfloat16())
        n.fill_(real)
        graph.replay()
        eager = m(x, n)
        torch.testing.assert_close(out.float(), eager.float(), atol=2e-2, rtol=2e-2)
        ref = moe_ref(host, x.cpu(), num_real=real)
        assert torch.nn.functional.cosine_similarity(out.double().cpu()[:real], ref[:real], dim=-1).min() > 0.98


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_block_sparse_moe_forward_is_the_torch_op_tables_moe(impl):
    """The torch op table's MoE equals BlockSparseMoE.forward (one copy of the formula: route,
    then ``routed_and_shared``), and its rmsnorm and mlp are the layers' own."""
    m = make_moe(8, 8, 2, impl=impl, seed=17)
    x, n = torch.randn(6, 32, generator=gen(18)), torch.tensor(4)
    ops = make_ops("torch", "cpu", torch.float32, impl)
    assert isinstance(ops.moe, TorchMoE) and ops.moe.grouped == (impl == "grouped")
    assert torch.equal(ops.moe(m.module, x, n), m.module(x, n, grouped=impl == "grouped"))
    torch.testing.assert_close(m.module(x, n, grouped=impl == "grouped").double(), moe_ref(m, x, num_real=4),
                               atol=1e-4, rtol=1e-4)
    mlp = DenseMLP(32, 16, 1.702, 7.0, torch.float32).requires_grad_(False)
    assert torch.equal(ops.mlp(mlp, x), mlp(x))
    norm = GemmaRMSNorm(32, 1e-6, torch.float32).requires_grad_(False)
    norm.weight.normal_(generator=gen(19))
    assert ops.rmsnorm is gemma_rmsnorm and torch.equal(ops.rmsnorm(x, norm.weight, 1e-6), norm(x))
    xb = x.bfloat16()
    fp32 = gemma_rms_normalize(xb, norm.weight, 1e-6)
    assert fp32.dtype == torch.float32 and torch.equal(fp32.to(torch.bfloat16), gemma_rmsnorm(xb, norm.weight, 1e-6))
    gate, up = torch.randn(5, 16, generator=gen(20)).bfloat16() * 4, torch.randn(5, 16, generator=gen(21)).bfloat16()
    act = swiglu_oai_f32(gate, up, 1.702, 7.0)
    assert act.dtype == torch.float32 and torch.equal(act.to(torch.bfloat16), swiglu_oai(gate, up, 1.702, 7.0))
