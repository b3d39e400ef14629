"""Fused producer (Gemma norm + partial NeoX RoPE + paged cache writes): the Triton kernel
against its plain-torch twin, the twin against a per-element reading of the spec, and the
model's torch op (twin + ``PagedKVCache.write``) against the kernel op.

On CPU the kernel runs in the Triton interpreter; on a GPU it also runs at real shapes and
through a capture -> new positions/slots -> replay test.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.paged import DEV
from helpers.triton_compile import run_compile_reports

from attention.rope import rope_inv_freq
from models.minimax_m3.kernels import producer as cw
from models.minimax_m3.kernels.producer import QKVLayout, norm_rope_torch


def norm_rope_cache_write_torch(qkv, positions, slot_mapping, layout, inv_freq, q_norm, k_norm, k_cache, v_cache, *,
                                index_q_norm=None, index_k_norm=None, index_k_cache=None, q_out=None, iq_out=None):
    """The torch twin with the kernel's signature: ``norm_rope_torch`` plus direct cache writes
    (a boolean mask is fine in a test; the model's path writes through the cache's sink page)."""
    L, T = layout, qkv.shape[0]
    r = norm_rope_torch(qkv, positions, L, inv_freq, q_norm, k_norm, index_q_norm, index_k_norm)
    live = slot_mapping >= 0
    pages, offs = slot_mapping[live] // k_cache.shape[1], slot_mapping[live] % k_cache.shape[1]
    k_cache[pages, offs] = r.k[live].to(k_cache.dtype)
    v_cache[pages, offs] = r.v[live].to(v_cache.dtype)
    if L.has_index:
        index_k_cache[pages, offs] = r.ik[live].to(index_k_cache.dtype)
        dst = (iq_out if iq_out is not None
               else qkv[:, L.iq_offset : L.ik_offset].view(T, L.num_index_heads, L.index_dim))
        dst.copy_(r.iq)
    (q_out if q_out is not None else qkv[:, : L.k_offset].view(T, L.num_q_heads, L.head_dim)).copy_(r.q)


LAYOUTS = {
    "sparse": QKVLayout(4, 2, 32, num_index_heads=2, index_dim=16, rotary_dim=16),
    "dense": QKVLayout(6, 2, 32, rotary_dim=16),
    "mqa_no_rope": QKVLayout(2, 1, 16, num_index_heads=1, index_dim=32, rotary_dim=0, eps=1e-5),
}


class Inputs:
    """Random projection output, weights, positions, slots (some -1) and NaN-poisoned caches."""

    def __init__(self, layout, T, seed, dtype=torch.bfloat16, num_pages=6, page_size=4, max_pos=1_000_000):
        g = torch.Generator(device=DEV).manual_seed(seed)
        L = layout
        r = lambda *s, scale=1.0: (scale * torch.randn(s, generator=g, device=DEV)).to(dtype)  # noqa: E731
        self.layout, self.dtype = L, dtype
        self.qkv = r(T, L.width)
        self.positions = torch.randint(0, max_pos, (T,), generator=g, device=DEV)
        slots = torch.randperm(num_pages * page_size, generator=g, device=DEV)[:T]
        slots[torch.arange(T, device=DEV) % 3 == 1] = -1  # padded rows
        self.slot_mapping = slots
        self.inv_freq = rope_inv_freq(5e6, L.rotary_dim, DEV)
        self.q_norm, self.k_norm = r(L.head_dim, scale=0.1), r(L.head_dim, scale=0.1)
        di = max(L.index_dim, 1)
        self.index_q_norm, self.index_k_norm = r(di, scale=0.1), r(di, scale=0.1)
        nan = float("nan")
        self.k_cache = torch.full((num_pages, page_size, L.num_kv_heads, L.head_dim), nan, dtype=dtype, device=DEV)
        self.v_cache = torch.full_like(self.k_cache, nan)
        self.index_k_cache = torch.full((num_pages, page_size, di), nan, dtype=dtype, device=DEV)

    def run(self, fn, q_out=False, iq_out=False):
        """Apply ``fn`` to copies; return (qkv, q_out, iq_out, k_cache, v_cache, index_k_cache)."""
        L, T = self.layout, self.qkv.shape[0]
        qkv, kc, vc, ic = self.qkv.clone(), self.k_cache.clone(), self.v_cache.clone(), self.index_k_cache.clone()
        qo = torch.full((T, L.num_q_heads, L.head_dim), float("nan"), dtype=self.dtype, device=DEV) if q_out else None
        io = (torch.full((T, L.num_index_heads, L.index_dim), float("nan"), dtype=self.dtype, device=DEV)
              if iq_out else None)
        idx = (dict(index_q_norm=self.index_q_norm, index_k_norm=self.index_k_norm, index_k_cache=ic) if L.has_index
               else {})
        fn(qkv, self.positions, self.slot_mapping, L, self.inv_freq, self.q_norm, self.k_norm, kc, vc,
           q_out=qo, iq_out=io, **idx)
        return qkv, qo, io, kc, vc, ic


def assert_close_nan_aware(a, b, tol):
    if a is None:
        assert b is None
        return
    assert torch.equal(a.isnan(), b.isnan()), "written elements differ (NaN pattern)"
    m = ~b.isnan()
    if m.any():
        err = ((a[m].double() - b[m].double()).norm() / b[m].double().norm()).item()
        assert err < tol, err


@pytest.mark.parametrize("outputs", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_triton_matches_torch(name, dtype, outputs):
    L = LAYOUTS[name]
    x = Inputs(L, T=7, seed=4 * list(LAYOUTS).index(name) + 2 * (dtype == torch.float32) + outputs[0], dtype=dtype)
    got = x.run(cw.norm_rope_cache_write, *outputs)
    want = x.run(norm_rope_cache_write_torch, *outputs)
    # bf16: both round once from fp32 (the interpreter truncates, hence ~4e-3); fp32: ulps
    # (the kernel computes cos/sin itself).
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for a, b in zip(got, want):
        assert_close_nan_aware(a, b, tol)
    kc = got[3]
    live = x.slot_mapping >= 0
    assert kc.isnan().flatten(0, 1).all(-1).all(-1).sum() == kc.shape[0] * kc.shape[1] - int(live.sum()), \
        "exactly the live slots must be written"
    if not outputs[0]:
        qkv = got[0]
        assert not torch.equal(qkv[:, : L.head_dim], x.qkv[:, : L.head_dim]), "q must be rewritten in place"
        assert torch.equal(qkv[:, L.v_offset : L.iq_offset], x.qkv[:, L.v_offset : L.iq_offset]), "v must stay"


def spec_norm_rope(x, w, pos, rot, eps, theta=5e6):
    """One head vector, fp64, straight from MINIMAX_M3.md section 2."""
    x = x.double()
    y = x / math.sqrt(float((x * x).mean()) + eps) * (1 + w.double())
    out = y.clone()
    for i in range(rot // 2):
        ang = pos * theta ** (-2 * i / rot)
        c, s = math.cos(ang), math.sin(ang)
        out[i] = y[i] * c - y[i + rot // 2] * s
        out[i + rot // 2] = y[i + rot // 2] * c + y[i] * s
    return out


def test_torch_twin_matches_spec():
    L = LAYOUTS["sparse"]
    x = Inputs(L, T=3, seed=11, dtype=torch.float32, max_pos=50)  # fp32 angles exact enough
    qkv, _, _, kc, vc, ic = x.run(norm_rope_cache_write_torch)
    ps = kc.shape[1]
    for t in range(3):
        p = int(x.positions[t])
        q0 = spec_norm_rope(x.qkv[t, : L.head_dim].cpu(), x.q_norm.cpu(), p, L.rotary_dim, L.eps)
        torch.testing.assert_close(qkv[t, : L.head_dim].double().cpu(), q0, rtol=1e-4, atol=1e-4)
        iq1 = x.qkv[t, L.iq_offset + L.index_dim : L.iq_offset + 2 * L.index_dim].cpu()
        want = spec_norm_rope(iq1, x.index_q_norm.cpu(), p, L.rotary_dim, L.eps)
        got = qkv[t, L.iq_offset + L.index_dim : L.iq_offset + 2 * L.index_dim].double().cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        s = int(x.slot_mapping[t])
        if s < 0:
            continue
        k1 = spec_norm_rope(x.qkv[t, L.k_offset + L.head_dim : L.v_offset].cpu(), x.k_norm.cpu(), p, L.rotary_dim,
                            L.eps)
        torch.testing.assert_close(kc[s // ps, s % ps, 1].double().cpu(), k1, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vc[s // ps, s % ps].flatten().cpu(), x.qkv[t, L.v_offset : L.iq_offset].cpu())
        ik = spec_norm_rope(x.qkv[t, L.ik_offset :].cpu(), x.index_k_norm.cpu(), p, L.rotary_dim, L.eps)
        torch.testing.assert_close(ic[s // ps, s % ps].double().cpu(), ik, rtol=1e-4, atol=1e-4)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rotary_dim"):
        QKVLayout(4, 2, 32, rotary_dim=40)
    with pytest.raises(ValueError, match="index_dim"):
        QKVLayout(4, 2, 32, num_index_heads=2)
    L = LAYOUTS["sparse"]
    x = Inputs(L, T=2, seed=1)
    with pytest.raises(ValueError, match="qkv"):
        cw.norm_rope_cache_write(x.qkv[:, 1:], x.positions, x.slot_mapping, L, x.inv_freq, x.q_norm, x.k_norm,
                                 x.k_cache, x.v_cache, index_q_norm=x.index_q_norm, index_k_norm=x.index_k_norm,
                                 index_k_cache=x.index_k_cache)
    with pytest.raises(ValueError, match="index_k_cache"):
        cw.norm_rope_cache_write(x.qkv, x.positions, x.slot_mapping, L, x.inv_freq, x.q_norm, x.k_norm, x.k_cache,
                                 x.v_cache)


# ---- compile for Hopper (no GPU needed) -------------------------------------------------


def test_kernel_compiles_for_hopper():
    def producer(hq, hkv, d, hidx, di, rot):
        hb = max(2, min(16, 1 << (max(hq, hkv, hidx) - 1).bit_length()))
        c = dict(HQ=hq, HKV=hkv, D=d, HIDX=hidx, DI=di, ROT=rot, HB=hb, BLOCK_D=d, BLOCK_DI=di)
        return ["models.minimax_m3.kernels.producer", "_producer_kernel", c,
                dict(pos_ptr="i64", slot_ptr="i64", inv_freq_ptr="fp32"), ["eps"], 4, 1]

    run_compile_reports([producer(64, 4, 128, 4, 128, 64), producer(8, 1, 128, 1, 128, 64),
                         producer(2, 1, 16, 1, 32, 0)])  # index tiles wider than the main ones


# ---- GPU ------------------------------------------------------------------------------------

REAL = {"real": QKVLayout(64, 4, 128, 4, 128, 64), "rank_of_8": QKVLayout(8, 1, 128, 1, 128, 64),
        "real_dense": QKVLayout(64, 4, 128, rotary_dim=64)}


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 300])
@pytest.mark.parametrize("name", list(REAL))
def test_cuda_real_shapes(name, T):
    x = Inputs(REAL[name], T=T, seed=T, num_pages=8, page_size=128)
    got, want = x.run(cw.norm_rope_cache_write), x.run(norm_rope_cache_write_torch)
    for a, b in zip(got, want):
        assert_close_nan_aware(a, b, 1e-2)


@pytest.mark.cuda
def test_cuda_graph_replay_with_new_positions_and_slots():
    L = REAL["real"]
    x = Inputs(L, T=16, seed=5, num_pages=4, page_size=128)
    qkv, pos, slots = x.qkv.clone(), x.positions.clone(), x.slot_mapping.clone()
    kc, vc, ic = x.k_cache.clone(), x.v_cache.clone(), x.index_k_cache.clone()
    idx = dict(index_q_norm=x.index_q_norm, index_k_norm=x.index_k_norm, index_k_cache=ic)

    def step():
        cw.norm_rope_cache_write(qkv, pos, slots, L, x.inv_freq, x.q_norm, x.k_norm, kc, vc, **idx)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    y = Inputs(L, T=16, seed=6, num_pages=4, page_size=128)  # new rows, positions, padding pattern
    y.inv_freq, y.q_norm, y.k_norm, y.index_q_norm, y.index_k_norm = (
        x.inv_freq, x.q_norm, x.k_norm, x.index_q_norm, x.index_k_norm)
    for dst, src in ((qkv, y.qkv), (pos, y.positions), (slots, y.slot_mapping), (kc, y.k_cache), (vc, y.v_cache),
                     (ic, y.index_k_cache)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want = y.run(norm_rope_cache_write_torch)
    for a, b in zip((qkv, None, None, kc, vc, ic), want):
        assert_close_nan_aware(a, b, 1e-2)


def test_model_ops_write_the_same_cache_through_the_sink_page():
    """The op table's torch producer (capturable: padded rows land in the sink page) and the
    Triton one write identical caches and queries."""
    from models.minimax_m3 import build_from_preset
    from models.minimax_m3.ops import norm_rope_write_torch, norm_rope_write_triton

    r = build_from_preset("tiny", DEV, torch.float32, backend="torch", max_tokens=16, max_seqs=2, max_seq_len=32)
    attn = r.model.model.layers[1].self_attn
    r.cache.add_sequence(0)
    r.cache.reserve(0, 8)
    slots = torch.tensor(r.cache.slots(0, 0, 5) + [-1, -1], device=DEV)
    pos = torch.arange(7, device=DEV)
    qkv = torch.randn(7, attn.qkv_proj.out_features, device=DEV)
    outs = []
    for op in (norm_rope_write_torch, norm_rope_write_triton):
        r.cache.k_cache.fill_(7.0), r.cache.index_k_cache.fill_(7.0)
        q = torch.full((7, attn.num_heads, attn.head_dim), float("nan"), device=DEV)
        iq = torch.full((7, attn.num_index_heads, attn.index_dim), float("nan"), device=DEV)
        op(qkv.clone(), pos, r.model.rope_inv_freq, slots, attn.layout, attn.head_norms(), r.cache, attn.layer, q, iq)
        outs.append((q, iq, r.cache.k_cache.clone(), r.cache.index_k_cache.clone()))
    for a, b in zip(*outs):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    written = (outs[0][2][1] != 7.0).flatten(0, 1).any(-1).any(-1)
    assert written.sum() == 5  # exactly the live slots; padded rows wrote nothing visible
