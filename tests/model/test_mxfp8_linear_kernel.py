"""The MXFP8 linear kernel (``kernels/fp8_linear.py``) against ``F.linear`` on the dequantised
weight: interpreter on CPU (small shapes, fp32), real rank-of-8 projection shapes on the GPU, and
a compile check for Hopper."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.paged import DEV
from helpers.triton_compile import run_compile_reports

from models.minimax_m3.kernels.fp8_linear import (
    GEMV_MAX_TOKENS,
    GemvConfig,
    LinearConfig,
    default_linear_config,
    dequantize_mxfp8_triton,
    dequantized_linear,
    gemv_config_candidates,
    linear_config_candidates,
    mxfp8_linear,
    split_plan,
)
from models.minimax_m3.mxfp8 import dequantize_mxfp8, quantize_mxfp8


def problem(t: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype).to(DEV)
    q, s = quantize_mxfp8(torch.randn(n, k, generator=g) * k**-0.5)
    q, s = q.to(DEV), s.to(DEV)
    return x, q, s, F.linear(x.float(), dequantize_mxfp8(q, s, torch.float32))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("t,n,k,cfg", [
    (1, 40, 64, None),                                  # decode default, N not a tile multiple
    (5, 100, 96, LinearConfig(block_k=64)),             # K not a multiple of the K step: masked loop
    (20, 64, 512, LinearConfig(block_k=64, split_k=3)),  # split K, uneven split (8 steps over 3)
    (70, 48, 128, None),                                # prefill default
], ids=["decode", "masked-k", "split-k", "prefill"])
def test_matches_f_linear_on_the_dequantized_weight(t, n, k, cfg):
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    x, q, s, ref = problem(t, n, k, dtype, seed=t)
    out = mxfp8_linear(x, q, s, config=cfg)
    assert out.dtype == dtype and out.shape == (t, n)
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(mxfp8_linear(x, q, s, config=cfg), out)  # fixed reduction order


def test_decode_splits_k_to_fill_the_gpu_and_prefill_does_not():
    assert default_linear_config(1, 1536, 6144).split_k > 1  # qkv at rank-of-8: 24 N-tiles alone
    assert default_linear_config(1, 6144, 1024).split_k == 2  # o_proj: 96 tiles, K of 4 steps
    assert default_linear_config(1054, 6144, 1024).split_k == 1


def test_refusals():
    x, q, s, _ = problem(2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match=r"weight must be fp8 e4m3 \[N, K=64\]"):
        mxfp8_linear(x, q.float(), s)
    with pytest.raises(ValueError, match=r"scale_inv must be uint8 \[N=32, K/32=2\]"):
        mxfp8_linear(x, q, s[:, :1])
    with pytest.raises(ValueError, match="block_k must be a multiple of 32"):
        LinearConfig(block_k=16)


@pytest.mark.parametrize("t,n,k,cfg", [
    (1, 40, 256, GemvConfig(block_n=16, block_k=128)),   # N not a multiple of the row set
    (2, 24, 512, GemvConfig(block_n=4, block_k=256)),    # two rows, two K steps
    (2, 8, 1024, GemvConfig(block_n=2, block_k=1024, num_warps=2, num_stages=1)),
], ids=["one-row", "two-rows", "one-step"])
def test_weight_row_form_matches_f_linear(t, n, k, cfg):
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    x, q, s, ref = problem(t, n, k, dtype, seed=3 * t + n)
    out = mxfp8_linear(x, q, s, config=cfg)
    assert out.dtype == dtype and out.shape == (t, n)
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    # each row is computed alone: the two-row launch gives the one-row launch's values
    assert torch.equal(mxfp8_linear(x[-1:], q, s, config=cfg), out[-1:])


def test_weight_row_form_is_offered_only_where_it_runs():
    assert gemv_config_candidates(1, 6144) and gemv_config_candidates(GEMV_MAX_TOKENS, 1024)
    assert gemv_config_candidates(GEMV_MAX_TOKENS + 1, 6144) == []
    assert all(1536 % c.block_k == 0 for c in gemv_config_candidates(1, 1536))  # dense MLP down: K = 1536
    x, q, s, ref = problem(3, 16, 256, torch.float32)
    # more rows than it is offered at: correct still (rows two at a time, each pair re-reading w)
    assert rel_err(mxfp8_linear(x, q, s, config=GemvConfig(block_k=256)), ref) < 1e-5
    with pytest.raises(ValueError, match="block_k=512: pick a LinearConfig"):
        mxfp8_linear(x[:1], q, s, config=GemvConfig(block_k=512))  # K = 256: no whole step
    with pytest.raises(ValueError, match="multiple of 128"):
        GemvConfig(block_k=64)
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=6)


# rank-of-8 projections (N, K): qkv of a sparse layer (about), o_proj, dense MLP gate_up and down
REAL = [(1536, 6144), (6144, 1024), (3072, 6144), (6144, 1536)]


def test_kernels_compile_for_hopper():
    cases, prefill = [], []
    for t in (1, 64, 1054):
        for n, k in REAL[:2]:
            for cfg in linear_config_candidates(t, n, k):
                c = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "EVEN": True,
                     "DOT_F32": False, "S_WORDS": True}  # K % 128 == 0: the scales go as int32 words
                ptrs = {"w_ptr": "fp8e4nv", "s_ptr": "i32", "out_ptr": "fp32" if cfg.split_k > 1 else "bf16"}
                prefill.append(t > 64)
                cases.append(["models.minimax_m3.kernels.fp8_linear", "_mxfp8_linear_kernel", c, ptrs, [],
                              cfg.num_warps, cfg.num_stages])
    gemv = []
    for t in (1, GEMV_MAX_TOKENS):
        for _, k in REAL[:2]:
            for cfg in gemv_config_candidates(t, k):
                c = {"TWO": t > 1, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "NUM_STAGES": cfg.num_stages}
                gemv.append(len(cases))
                prefill.append(False)
                cases.append(["models.minimax_m3.kernels.fp8_linear", "_gemv_linear_kernel", c,
                              {"w_ptr": "fp8e4nv", "s_ptr": "i32"}, [], cfg.num_warps, cfg.num_stages])
    reports = run_compile_reports(cases)  # shared memory and spills checked there
    assert all(r["wgmma"] for r, p in zip(reports, prefill) if p)  # prefill tiles use warpgroup MMA
    assert gemv and not any(reports[i]["wgmma"] for i in gemv)  # the weight-row form: no tensor cores
    # Every K loop streams its tiles through asynchronous copies. A first version lost this at
    # decode (the split's K offset had no known alignment, so the loads went one byte at a time,
    # synchronously) and ran slower than bf16 on the H200.
    assert all(r["cp_async"] for r in reports), reports
    # ... the scales too: read as bytes they stayed synchronous loads in the loop (Triton
    # pipelines only loads of >= 4 bytes per element), a memory latency on every K step.
    assert all(r["k_loop_loads"] == 0 for r in reports), reports


def test_real_shapes_take_the_unmasked_k_loop():
    """Every candidate at the real projection shapes splits K into whole, equal K steps (the
    masked loop, for other shapes, reads scales per element: a split that did not divide K sent
    the dense MLP's down projection there, and on the H200 it asked for 300-400 KB of shared
    memory)."""
    for t in (1, 8, 32, 64, 1054):
        for n, k in REAL:
            for cfg in linear_config_candidates(t, n, k):
                split, per, even = split_plan(k, cfg)
                assert even and split * per == k and 1 <= split <= cfg.split_k, (n, k, cfg)


def test_triton_dequantize_is_exact_and_feeds_f_linear():
    x, q, s, ref = problem(70, 48, 128, torch.float32, seed=4)
    w = dequantize_mxfp8_triton(q, s, torch.float32)
    assert torch.equal(w, dequantize_mxfp8(q, s, torch.float32))
    torch.testing.assert_close(dequantized_linear(x, q, s), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(dequantize_mxfp8_triton(q, s, torch.bfloat16), dequantize_mxfp8(q, s, torch.bfloat16))
    _, q2, s2, _ = problem(3, 37, 320, torch.float32, seed=5)  # partial tiles in both dimensions
    assert torch.equal(dequantize_mxfp8_triton(q2, s2, torch.float32), dequantize_mxfp8(q2, s2, torch.float32))
    with pytest.raises(ValueError, match=r"scale_inv must be contiguous uint8 \[N=48, K/32=4\]"):
        dequantize_mxfp8_triton(q, s[:, :2], torch.float32)


@pytest.mark.parametrize("t", [1, 8, 40, 100])
def test_every_candidate_matches_f_linear(t):
    n, k = 96, 1024
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    x, q, s, ref = problem(t, n, k, dtype, seed=t + 1)
    for cfg in linear_config_candidates(t, n, k) + gemv_config_candidates(t, k):
        assert rel_err(mxfp8_linear(x, q, s, config=cfg), ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5), cfg


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 2, 8, 32, 64, 1054])
def test_cuda_real_shapes_and_graph_replay(t):
    for n, k in REAL:
        x, q, s, ref = problem(t, n, k, torch.bfloat16, seed=n + t)
        for cfg in linear_config_candidates(t, n, k) + gemv_config_candidates(t, k):
            assert rel_err(mxfp8_linear(x, q, s, config=cfg), ref) < 1e-2, (n, k, cfg)
        assert rel_err(dequantized_linear(x, q, s), ref) < 1e-2, (n, k)
        out = mxfp8_linear(x, q, s)
        assert rel_err(out, ref) < 1e-2, (n, k)
        configs = [None] + gemv_config_candidates(t, k)[:1]  # the default, and the weight-row form
        eager = [mxfp8_linear(x, q, s, config=c) for c in configs]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = [mxfp8_linear(x, q, s, config=c) for c in configs]
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(c, e) for c, e in zip(captured, eager)), (n, k)
