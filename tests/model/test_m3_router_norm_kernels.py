"""MiniMax-M3 router (fp32 GEMV + biased sigmoid top-k) and Gemma RMSNorm kernels.

On CPU the Triton kernels run in the interpreter at small shapes against fp64 references
written from the formulas (MINIMAX_M3.md section 2), and the torch twins are checked against
``layers.route`` / ``layers.GemmaRMSNorm``; every kernel is also compiled for Hopper at the
real shapes. On a GPU the kernels run at real shapes against the torch twins and through a
capture -> new inputs -> replay test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.paged import DEV
from helpers.triton_compile import run_compile_reports

from models.minimax_m3 import layers
from models.minimax_m3.kernels import norm as nk
from models.minimax_m3.kernels import router as rk
from models.minimax_m3.kernels.moe_align import align_chunk, alignment_buffers, aligns_in_one_program, moe_align
from models.minimax_m3.routing import RoutingSimulation

BF16_ULP = 2.0**-7  # relative spacing of bf16 values (the interpreter truncates, a GPU rounds)
POISON_ID = 12345


# --------------------------------------------------------------------------------------------
# references from the formulas (fp64)


def route_ref64(x, w, b, k, scale, n_real, offset, num_local):
    """fp64 routing: (local ids, weights, global ids, biased scores). Ties: the lower id wins
    (a stable descending sort keeps equal scores in id order)."""
    s = torch.sigmoid(x.double() @ w.double().T)
    sel = s + b.double()
    ids = torch.sort(sel, dim=1, descending=True, stable=True).indices[:, :k]
    wt = s.gather(1, ids)
    wt = wt / wt.sum(1, keepdim=True) * scale
    real = (torch.arange(x.shape[0], device=x.device) < n_real)[:, None]
    gid = torch.where(real, ids, -1)
    local = gid - offset
    mine = real & (local >= 0) & (local < num_local)
    return torch.where(mine, local, -1), torch.where(mine, wt, 0.0), gid, sel


def norm_ref64(v, w, eps):
    v = v.double()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.double())


def boundary_gap(sel, k):
    """Per row: biased score of the k-th choice minus the (k+1)-th (0 when k = E)."""
    top = sel.topk(min(k + 1, sel.shape[1]), dim=1).values
    return top[:, k - 1] - top[:, k] if k < sel.shape[1] else torch.ones(sel.shape[0], dtype=sel.dtype)


class RouteCase:
    """Random router inputs; ``run`` calls an implementation on poisoned output buffers."""

    def __init__(self, T, H, E, seed, dtype=torch.bfloat16, w_scale=None, b_scale=0.1):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.x = torch.randn(T, H, generator=g, device=DEV).to(dtype)
        self.w = torch.randn(E, H, generator=g, device=DEV) * (w_scale if w_scale is not None else H**-0.5)
        self.b = torch.randn(E, generator=g, device=DEV) * b_scale

    def run(self, fn, k, scale, nrt, offset, num_local, with_global=True, **kw):
        T = self.x.shape[0]
        local = torch.full((T, k), POISON_ID, dtype=torch.int32, device=DEV)
        wts = torch.full((T, k), float("nan"), device=DEV)
        glob = torch.full((T, k), -POISON_ID, dtype=torch.int32, device=DEV) if with_global else None
        n = None if nrt is None else torch.tensor([nrt], dtype=torch.int64, device=DEV)
        fn(self.x, self.w, self.b, k, scale, n, offset, num_local, local, wts, glob, **kw)
        return local, wts, glob

    def ref(self, k, scale, nrt, offset, num_local):
        T = self.x.shape[0]
        return route_ref64(self.x, self.w, self.b, k, scale, T if nrt is None else nrt, offset, num_local)


def check_route(got, want, k, wtol=1e-6):
    local, wts, glob = got
    rl, rw, rg, sel = want
    assert (boundary_gap(sel, k) > 1e-5).all(), "test data has a near tie at the top-k boundary: change the seed"
    assert torch.equal(local.long(), rl), "local ids"
    if glob is not None:
        assert torch.equal(glob.long(), rg), "global ids"
    assert not wts.isnan().any(), "every weight must be written"
    torch.testing.assert_close(wts.double(), rw, rtol=wtol, atol=wtol)


# (E, offset, num_local): the full set, a middle slice (pairs of ranks on both sides), the last slice
REMAPS = {8: [(0, 8), (2, 4), (6, 2)], 16: [(0, 16), (4, 8), (12, 4)]}


# --------------------------------------------------------------------------------------------
# router: interpreter (or GPU) at small shapes


SHAPES = [(64, 8, 2), (96, 16, 4), (64, 16, 4), (96, 8, 4)]  # (H, E, K)
DTYPES = [torch.bfloat16, torch.float32]
# every shape and dtype at T = 1 and 5; T = 33 (one 64-token GEMV tile, 33 interpreted top-k
# programs: the slowest case) for each shape once, alternating the dtype, to bound the runtime
ROUTE_CASES = [(*shape, T, dt) for shape in SHAPES for T in (1, 5) for dt in DTYPES]
ROUTE_CASES += [(*shape, 33, DTYPES[i % 2]) for i, shape in enumerate(SHAPES)]


@pytest.mark.parametrize("H,E,K,T,dtype", ROUTE_CASES)
def test_route_triton_matches_fp64(H, E, K, T, dtype):
    case = RouteCase(T, H, E, seed=T * 131 + H + E * 7 + K + (dtype == torch.float32))
    for i, (offset, num_local) in enumerate(REMAPS[E]):
        nrt = [None, max(T - 2, 0), T][i]  # padded rows, none, or a device count equal to T
        got = case.run(rk.route_triton, K, 2.0, nrt, offset, num_local)
        check_route(got, case.ref(K, 2.0, nrt, offset, num_local), K)
        if 0 < num_local < E and T > 1:
            rl, rg = got[0], got[2]
            real = rg >= 0
            assert (real & (rl < 0)).any() and (rl >= 0).any(), "the remap case should hold local and remote pairs"


ALT_CONFIGS = {
    # T=1 GEMV with 3 H splits and 2 expert tiles
    1: rk.RouterConfig(block_t=1, block_e=8, block_h=16, h_per_split=32, splits=3, gemv_warps=4, topk_warps=1),
    # a token tile of 16 with 2 H splits (the second one partial)
    5: rk.RouterConfig(block_t=16, block_e=16, block_h=16, h_per_split=64, splits=2, gemv_warps=4, topk_warps=2),
    # 3 token tiles of 16 (the last one partial), 6 splits
    33: rk.RouterConfig(block_t=16, block_e=16, block_h=16, h_per_split=16, splits=6, gemv_warps=4, topk_warps=2),
}


@pytest.mark.parametrize("T", [1, 5, 33])
def test_route_triton_other_tilings(T):
    """Tile shapes other than the heuristic's (more splits, several expert tiles)."""
    H, E, K = 96, 16, 4
    case = RouteCase(T, H, E, seed=500 + T)
    got = case.run(rk.route_triton, K, 2.5, max(T - 1, 1), 4, 8, config=ALT_CONFIGS[T])
    check_route(got, case.ref(K, 2.5, max(T - 1, 1), 4, 8), K)


def test_route_without_global_ids_and_all_padded():
    case = RouteCase(5, 64, 8, seed=3)
    local, wts, _ = case.run(rk.route_triton, 2, 2.0, None, 0, 8, with_global=False)
    check_route((local, wts, None), case.ref(2, 2.0, None, 0, 8), 2)
    local, wts, glob = case.run(rk.route_triton, 2, 2.0, 0, 0, 8)
    assert (local == -1).all() and (glob == -1).all() and (wts == 0).all()


@pytest.mark.parametrize("T", [1, 5])
def test_bias_changes_near_tied_selection(T):
    """Scores within ~1e-2 of each other; a bias of the same size reorders them. The kernel
    must follow the biased order and weigh with the unbiased scores."""
    H, E, K = 64, 16, 4
    case = RouteCase(max(T, 8), H, E, seed=77 + T, w_scale=0.004, b_scale=0.01)
    case.x = case.x[:T]
    got = case.run(rk.route_triton, K, 2.0, None, 0, E)
    want = case.ref(K, 2.0, None, 0, E)
    check_route(got, want, K)
    unbiased = torch.sort(torch.sigmoid(case.x.double() @ case.w.double().T), 1, descending=True).indices[:, :K]
    assert (unbiased.sort(1).values != want[2].sort(1).values).any(1).all(), "the bias must change each selection"


@pytest.mark.parametrize("T,config", [(1, None), (5, None), (1, ALT_CONFIGS[1])])
def test_exact_tie_goes_to_lower_expert_id(T, config):
    """Experts 3 and 9 have identical weight rows and biases and compete for the last slot."""
    H, E, K = 96, 16, 4
    case = RouteCase(T, H, E, seed=9)
    case.w[9] = case.w[3]
    case.b[:] = 0.0
    case.b[[1, 6, 12]] = 10.0  # always chosen first: the 4th slot is the tie
    case.b[[3, 9]] = 5.0
    _, wts, glob = case.run(rk.route_triton, K, 2.0, None, 0, E, config=config)
    assert (glob[:, 3] == 3).all(), glob
    assert torch.equal(glob[:, :3].sort(1).values.cpu(), torch.tensor([[1, 6, 12]] * T, dtype=torch.int32))
    _, rw, rg, _ = case.ref(K, 2.0, None, 0, E)
    assert torch.equal(glob.long(), rg)
    torch.testing.assert_close(wts.double(), rw, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the NaN row's max and 0 / 0
def test_nan_row_picks_no_expert_and_leaves_other_rows_alone():
    """A token whose hidden state holds a NaN (every score NaN) is routed nowhere: no local or
    global id, weight 0, and the other tokens' picks are unchanged."""
    H, E, K, T = 64, 16, 4, 5
    case = RouteCase(T, H, E, seed=31)
    want = case.ref(K, 2.0, None, 0, E)
    case.x[2, 7] = float("nan")
    local, wts, glob = case.run(rk.route_triton, K, 2.0, None, 0, E)
    assert (local[2] == -1).all() and (glob[2] == -1).all() and (wts[2] == 0).all()
    rows = [0, 1, 3, 4]
    assert torch.equal(glob[rows].long(), want[2][rows]) and torch.equal(local[rows].long(), want[0][rows])
    torch.testing.assert_close(wts[rows].double(), want[1][rows], rtol=1e-6, atol=1e-6)


def test_route_torch_matches_layers_route_and_fp64():
    H, E, K, T = 96, 16, 4, 7
    case = RouteCase(T, H, E, seed=21)
    for nrt in (None, 4):
        n = None if nrt is None else torch.tensor([nrt], device=DEV)
        ids, w = layers.route(case.x, case.w, case.b, K, 2.0, n)
        local, wts, glob = case.run(rk.route_torch, K, 2.0, nrt, 0, E)
        assert torch.equal(glob.long(), ids) and torch.equal(local.long(), ids) and torch.equal(wts, w)
        for offset, num_local in REMAPS[E]:
            check_route(case.run(rk.route_torch, K, 2.0, nrt, offset, num_local),
                        case.ref(K, 2.0, nrt, offset, num_local), K)


def test_route_rejects_bad_arguments():
    case = RouteCase(3, 64, 8, seed=1)
    ok = {"k": 2, "scale": 2.0, "nrt": None, "offset": 0, "num_local": 8}
    for fn in (rk.route_triton, rk.route_torch):
        with pytest.raises(ValueError, match="top_k"):
            case.run(fn, **dict(ok, k=9))
        with pytest.raises(ValueError, match="local experts"):
            case.run(fn, **dict(ok, offset=4, num_local=8))
    bad_w = RouteCase(3, 64, 8, seed=1)
    bad_w.w = bad_w.w.bfloat16()
    with pytest.raises(ValueError, match="gate_weight"):
        bad_w.run(rk.route_triton, **ok)
    T = 3
    with pytest.raises(ValueError, match="weights_out"):
        rk.route_triton(case.x, case.w, case.b, 2, 2.0, None, 0, 8, torch.empty(T, 2, dtype=torch.int32, device=DEV),
                        torch.empty(T, 2, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="local_ids_out"):
        rk.route_triton(case.x, case.w, case.b, 2, 2.0, None, 0, 8, torch.empty(T, 2, dtype=torch.int64, device=DEV),
                        torch.empty(T, 2, device=DEV))
    with pytest.raises(ValueError, match="router config"):
        case.run(rk.route_triton, **ok, config=rk.RouterConfig(1, 8, 16, 24, 3, 4, 1))


def test_router_config_spreads_the_weight_read():
    """At the real shape even one token reads the 3 MB weight with >= ~100 programs, and the
    token tile grows with T so the weight is read once per 64 tokens; bf16 token tiles take the
    three-part bf16 dot (fp32 x the fp32 FMA dot), prefill sizes one config for every size."""
    E, H, sms = 128, 6144, 132
    for T in (1, 2, 3, 8, 32, 64, 100, 300, 1054):
        big = T >= rk.CUBLAS_MIN_TOKENS and DEV == "cuda"  # the interpreter keeps the Triton GEMV
        f32 = rk.router_config(T, E, H, sms, torch.float32)
        assert f32.cublas == big and not f32.bf16_split  # fp32 x: cuBLAS SGEMM or the fp32 dot
        c = rk.router_config(T, E, H, sms)
        assert c.bf16_split == (T > 2) and not c.cublas  # bf16 x: the three-part bf16 dot on token tiles
        if big:  # one build for every prefill size: nothing compiles after capture
            assert c == rk.bf16_split_config(E, H) and c.splits == 8
            continue
        for cfg in (c, f32):
            programs = -(-E // cfg.block_e) * cfg.splits * -(-T // cfg.block_t)
            assert programs >= 96, (T, cfg)
            assert cfg.splits * cfg.h_per_split >= H and cfg.h_per_split % cfg.block_h == 0 and cfg.splits <= 32
            assert cfg.block_t in (1, 16, 32, 64)


def test_cublas_logits_path_matches_fp64():
    """Prefill-sized steps take their fp32 logits from one cuBLAS SGEMM, then the same top-k kernel."""
    H, E, K, T = 96, 16, 4, 33
    case = RouteCase(T, H, E, seed=77)
    cfg = rk.RouterConfig(block_t=16, block_e=16, block_h=16, h_per_split=H, splits=1, gemv_warps=4, topk_warps=1,
                          cublas=True)
    got = case.run(rk.route_triton, K, 2.0, T - 3, 4, 8, config=cfg)
    check_route(got, case.ref(K, 2.0, T - 3, 4, 8), K)


@pytest.mark.parametrize(("T", "weight_a"), [(5, False), (20, False), (33, False), (70, False), (33, True),
                                             (70, True)])
def test_bf16_split_logits_match_fp64(T, weight_a):
    """bf16 x against the fp32 weight as three bf16 parts: the logits within fp32 rounding of
    the fp64 ones (not bf16's or tf32's: the weights here need all their bits), then the same
    routing as the fp64 reference; refused for activations that are not bf16. Decode sizes in
    ``router_config``'s token tiles (16 or 32 tokens, 64 columns a step, H split in 4), the
    larger ones in the prefill tiles, the weight parts as the dots' first operand or second."""
    H, E, K = 256, 16, 4
    case = RouteCase(T, H, E, seed=T + 5)
    g = torch.Generator(device=DEV).manual_seed(T)
    case.w += torch.randn(case.w.shape, generator=g, device=DEV) * 2.0**-12  # bits a bf16 or tf32 weight drops
    if T < 32:
        cfg = rk.router_config(T, E, H, 132)
        assert (cfg.block_t, cfg.block_h, cfg.splits) == (16 if T <= 16 else 32, 64, 4)
    else:
        # partials summed too; the 16-expert tile here takes the weight parts second unless asked
        cfg = dataclasses.replace(rk.bf16_split_config(E, H), h_per_split=128, splits=2, weight_a=weight_a)
        assert cfg.block_t == 64
    assert cfg.bf16_split
    part = rk.router_logit_partials(case.x, case.w, cfg)
    ref = case.x.double() @ case.w.double().T
    scale = case.x.double().abs() @ case.w.double().abs().T
    err = ((part.double().sum(0) - ref).abs() / scale).max().item()
    assert err < 2e-6, err  # H * 2^-24 would be 1.5e-5; a bf16 weight alone errs ~2^-9
    bf16_w = ((case.x.double() @ case.w.bfloat16().double().T - ref).abs() / scale).max().item()
    assert bf16_w > 50 * err, (bf16_w, err)  # the check can tell three parts from one
    got = case.run(rk.route_triton, K, 2.0, T - 3, 4, 8, config=cfg)
    check_route(got, case.ref(K, 2.0, T - 3, 4, 8), K)
    with pytest.raises(ValueError, match="bf16 activations"):
        rk.router_logit_partials(case.x.float(), case.w, cfg)


# --------------------------------------------------------------------------------------------
# norms: interpreter (or GPU) at small shapes


def assert_within_ulps(got, want, dtype, ulps=1.0):
    """|got - want| <= ulps * spacing(dtype) * |want| + a small fp32 allowance."""
    got = got.double()
    tol = (BF16_ULP * ulps if dtype == torch.bfloat16 else 2e-6) * want.abs() + 1e-6
    bad = (got - want).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements off, worst {((got - want).abs() - tol).max().item():.3g}"


def norm_inputs(T, H, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (2.0 * torch.randn(T, H, generator=g, device=DEV)).to(dtype)
    r = torch.randn(T, H, generator=g, device=DEV).to(dtype)
    w = (0.1 * torch.randn(H, generator=g, device=DEV)).to(dtype)
    return x, r, w


@pytest.fixture(params=["row_in_registers", "chunked"])
def row_mode(request, monkeypatch):
    """The whole row in registers (M3), or rows wider than the register tile (two passes)."""
    if request.param == "chunked":
        monkeypatch.setattr(nk, "_MAX_ROW", 32)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("H", [64, 96])
def test_gemma_rmsnorm_matches_fp64(H, T, dtype, row_mode):
    x, _, w = norm_inputs(T, H, dtype, seed=H + T)
    out = torch.full_like(x, float("nan"))
    x0 = x.clone()
    nk.gemma_rmsnorm(x, w, 1e-6, out)
    assert torch.equal(x, x0), "x must not change"
    assert_within_ulps(out, norm_ref64(x, w, 1e-6), dtype)
    y = x.clone()
    nk.gemma_rmsnorm(y, w, 1e-6, y)  # in place
    assert torch.equal(y, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("H", [64, 96])
def test_gemma_fused_add_rmsnorm_matches_fp64(H, T, dtype, row_mode):
    x, r, w = norm_inputs(T, H, dtype, seed=3 * H + T)
    s = x.double() + r.double()  # exact: both are bf16/fp32 values of similar size
    xo, ro = x.clone(), r.clone()
    nk.gemma_fused_add_rmsnorm(xo, ro, w, 1e-5)
    assert_within_ulps(ro, s, dtype)
    assert_within_ulps(xo, norm_ref64(s, w, 1e-5), dtype)


@pytest.mark.parametrize("row_in_regs", [True, False])
def test_fused_add_normalises_the_unrounded_sum(row_in_regs, monkeypatch):
    """fp32 x with a bf16 residual: x gets the norm of the fp32 sum, not of the bf16 residual."""
    if not row_in_regs:
        monkeypatch.setattr(nk, "_MAX_ROW", 32)
    H, T = 96, 5
    x, r, w = norm_inputs(T, H, torch.float32, seed=8)
    r = r.bfloat16()
    s32 = (x + r.float()).double()  # the fp32 sum (exact in fp64)
    for fn in (nk.gemma_fused_add_rmsnorm, nk.gemma_fused_add_rmsnorm_torch):
        xo, ro = x.clone(), r.clone()
        fn(xo, ro, w, 1e-6)
        assert_within_ulps(ro, s32, torch.bfloat16)
        want, rounded = norm_ref64(s32, w, 1e-6), norm_ref64(ro, w, 1e-6)
        assert_within_ulps(xo, want, torch.float32, ulps=4)
        assert (xo.double() - want).abs().max() < 0.05 * (rounded - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_torch_twins_match_layers(dtype):
    H, T = 96, 6
    x, r, w = norm_inputs(T, H, dtype, seed=2)
    mod = layers.GemmaRMSNorm(H, 1e-6, dtype, DEV)
    with torch.no_grad():
        mod.weight.copy_(w)
        want = mod(x)
    out = torch.empty_like(x)
    nk.gemma_rmsnorm_torch(x, w, 1e-6, out)
    assert torch.equal(out, want)
    xo, ro = x.clone(), r.clone()
    nk.gemma_fused_add_rmsnorm_torch(xo, ro, w, 1e-6)
    assert torch.equal(ro, r + x)  # fp32 add + one rounding == torch's bf16 add
    with torch.no_grad():
        layer_out = mod(r + x)
    if dtype == torch.float32:
        assert torch.equal(xo, layer_out)
    else:  # normalising the unrounded sum: within a bf16 rounding or two of the layer's output
        assert_within_ulps(xo, layer_out.double(), dtype, ulps=2.5)


def test_norm_rejects_bad_arguments():
    x, r, w = norm_inputs(3, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="weight"):
        nk.gemma_rmsnorm(x, w[:32], 1e-6, torch.empty_like(x))
    with pytest.raises(ValueError, match="out"):
        nk.gemma_rmsnorm(x, w, 1e-6, torch.empty(3, 32, device=DEV))
    with pytest.raises(ValueError, match="residual"):
        nk.gemma_fused_add_rmsnorm(x, r[:2], w, 1e-6)
    with pytest.raises(ValueError, match="different"):
        nk.gemma_fused_add_rmsnorm(x, x, w, 1e-6)
    with pytest.raises(ValueError, match="x must"):
        nk.gemma_rmsnorm_torch(x.t(), w, 1e-6, x)


# --------------------------------------------------------------------------------------------
# compile for Hopper at the real shapes (no GPU needed)

REAL_E, REAL_H, REAL_K, H200_SMS = 128, 6144, 4, 132
ROUTER_PTRS = {"x_ptr": "bf16", "w_ptr": "fp32", "part_ptr": "fp32", "bias_ptr": "fp32", "nrt_ptr": "i64",
               "local_ptr": "i32", "wout_ptr": "fp32", "glob_ptr": "i32", "count_ptr": "i32", "off_ptr": "i32",
               "sorted_ptr": "i32", "pos_ptr": "i32"}
REAL_LOCAL = 16  # local experts of a rank-of-8 rank


def router_cases(T):
    c = rk.router_config(T, REAL_E, REAL_H, H200_SMS)
    gemv = {"E": REAL_E, "H": REAL_H, "BLOCK_T": c.block_t, "BLOCK_E": c.block_e, "BLOCK_H": c.block_h,
            "H_PER_SPLIT": c.h_per_split, "BF16_SPLIT": c.bf16_split, "DOT_F32": False}
    topk = {"E": REAL_E, "K": REAL_K, "E_PAD": REAL_E, "K_PAD": REAL_K, "SPLITS": c.splits,
            "SPLITS_PAD": max(2, 1 << (c.splits - 1).bit_length()), "HAS_NRT": True, "HAS_GLOBAL": True}
    mod = "models.minimax_m3.kernels.router"
    cases = [[mod, "_router_logits_kernel", gemv, ROUTER_PTRS, [], c.gemv_warps, 3],
             [mod, "_router_topk_kernel", topk, ROUTER_PTRS, ["scale"], c.topk_warps, 3]]
    if aligns_in_one_program(T, REAL_K, REAL_LOCAL):  # decode: the simulation and the alignment inside
        fused = dict(topk, SIMULATE=True, UNIFORM=True, ALIGN=True, NL=REAL_LOCAL, NL_PAD=REAL_LOCAL,
                     CHUNK=align_chunk(T * REAL_K, REAL_LOCAL))
        cases.append([mod, "_router_topk_kernel", fused, ROUTER_PTRS, ["scale"], c.topk_warps, 3])
    return cases


def norm_case(H, fused):
    block, warps = nk.norm_launch_config(H)
    return ["models.minimax_m3.kernels.norm", "_gemma_norm_kernel", {"H": H, "BLOCK_H": block, "FUSED_ADD": fused},
            {}, ["eps"], warps, 3]


def bf16_split_case(T, weight_a=True):
    c = rk.bf16_split_config(REAL_E, REAL_H)
    assert (c.splits, c.h_per_split, c.block_t, c.block_e) == (8, 768, 64, 64)  # the config timed on the H100
    assert c.weight_a  # 64-expert tiles: the weight parts as wgmma's register operand
    gemv = {"E": REAL_E, "H": REAL_H, "BLOCK_T": c.block_t, "BLOCK_E": c.block_e, "BLOCK_H": c.block_h,
            "H_PER_SPLIT": c.h_per_split, "BF16_SPLIT": True, "DOT_F32": False, "WEIGHT_A": weight_a}
    return ["models.minimax_m3.kernels.router", "_router_logits_kernel", gemv, ROUTER_PTRS, [], c.gemv_warps, 3]


def test_kernels_compile_for_hopper():
    cases = router_cases(1) + router_cases(8) + router_cases(64) + router_cases(1054)
    cases += [norm_case(REAL_H, False), norm_case(REAL_H, True), norm_case(3 * REAL_H, True)]
    cases += [bf16_split_case(1054, weight_a=False), bf16_split_case(1054)]
    reports = run_compile_reports(cases)
    for case, rep in zip(cases, reports):
        assert rep["spill_bytes"] == 0, (case[1], case[2], rep)
        # >= 2 programs of 4 warps per SM (a 1054-token step runs ~2 per SM); the register
        # operand form holds its three parts a step: 3 programs
        assert rep["regs"] <= (168 if case[2].get("WEIGHT_A") else 128), (case[1], case[2], rep)
    assert reports[-2]["wgmma"] and reports[-1]["wgmma"], "the three-part bf16 dot should use Hopper wgmma"
    # its weight parts, made in registers, feed wgmma from there (no shared-memory store first)
    assert reports[-1]["wgmma_reg_a"] and not reports[-2]["wgmma_reg_a"], reports[-2:]


@pytest.mark.parametrize("T,nrt,strategy", [(1, None, None), (5, 3, "uniform"), (64, 60, "balanced")])
def test_router_aligns_the_pairs_in_its_last_program(T, nrt, strategy):
    """``route_triton(align_out=...)``: the top-k kernel's last program makes the same alignment
    of the local ids that ``moe_align`` makes of them (offsets, positions and sorted pairs, the
    same ints; padded rows and other ranks' pairs dropped), with the routing simulation in the
    same kernel or without it, and leaves the arrival counter at zero."""
    case = RouteCase(T, 64, 32, seed=40 + T)
    aligned = alignment_buffers(T, 4, 16, DEV)
    for buf in aligned:
        buf.fill_(POISON_ID)
    sim = RoutingSimulation(strategy) if strategy else None
    local, wts, _ = case.run(rk.route_triton, 4, 2.0, nrt, 16, 16, simulation=sim, align_out=aligned)
    want = moe_align(local, 16)
    assert torch.equal(aligned.off, want.off) and torch.equal(aligned.pair_pos, want.pair_pos)
    n = int(want.off[-1])  # routed pairs, then every row's shared pair
    assert n == int((local >= 0).sum()) + T and torch.equal(aligned.sorted_pairs[:n], want.sorted_pairs[:n])
    if nrt is not None:
        assert (local[nrt:] == -1).all()
    from attention.kernels.arrival import arrival_counters

    assert not arrival_counters(case.x.device, 1).any()


def test_router_align_refusals():
    """Alignment in the top-k kernel only where one program holds every pair, into buffers of
    the step's shapes; refused before any launch, with what to do instead."""
    assert aligns_in_one_program(64, 4, 16) and not aligns_in_one_program(65, 4, 16)
    case = RouteCase(65, 64, 32, seed=3)
    with pytest.raises(ValueError, match="more than one align program; leave align_out None"):
        case.run(rk.route_triton, 4, 2.0, None, 16, 16, align_out=alignment_buffers(65, 4, 16, DEV))
    small = RouteCase(2, 64, 32, seed=4)
    bad = alignment_buffers(2, 4, 16, DEV)._replace(pair_pos=torch.empty(9, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match=r"align_out.pair_pos must be a contiguous int32 \[10\] tensor"):
        small.run(rk.route_triton, 4, 2.0, None, 16, 16, align_out=bad)


# --------------------------------------------------------------------------------------------
# GPU: real shapes and graph replay


def same_routing(got, want, sel32, k, wtol=1e-5):
    """Routing sets equal per row except where the top-k boundary is within 1e-6 of a tie;
    weights (matched by expert id) within ``wtol``. Returns the number of near-tie rows."""
    (gl, gw, gg), (wl, ww, wg) = got, want
    gg_s, gi = gg.long().sort(1)
    wg_s, wi = wg.long().sort(1)
    same = (gg_s == wg_s).all(1)
    tie = boundary_gap(sel32, k) <= 1e-6
    assert (same | tie).all(), f"{int((~same & ~tie).sum())} rows route differently without a near tie"
    assert torch.equal(gl.long().gather(1, gi)[same], wl.long().gather(1, wi)[same])
    torch.testing.assert_close(gw.gather(1, gi)[same], ww.gather(1, wi)[same], rtol=wtol, atol=wtol)
    return int((~same).sum())


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 8, 32, 1054])
def test_cuda_route_real_shapes(T):
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch twin must be a true fp32 GEMM too
    case = RouteCase(T, REAL_H, REAL_E, seed=T)
    for nrt, offset, num_local in ((None, 0, REAL_E), (max(T - 3, 1), 32, 16)):
        got = case.run(rk.route_triton, REAL_K, 2.0, nrt, offset, num_local)
        want = case.run(rk.route_torch, REAL_K, 2.0, nrt, offset, num_local)
        sel32 = torch.sigmoid(case.x.float() @ case.w.T) + case.b
        same_routing(got, want, sel32, REAL_K)
        assert not got[1].isnan().any() and (got[0] != POISON_ID).all()


@pytest.mark.cuda
@pytest.mark.parametrize("T", [3, 32, 64, 100, 128, 1054])
def test_cuda_bf16_split_logits_as_accurate_as_an_fp32_gemm(T):
    """bf16 steps of more than two tokens take the three-part bf16 dot: its logits are as close to the
    fp64 ones as cuBLAS SGEMM's (the earlier path) or closer, far closer than a bf16 weight's
    (chaining the whole split in the MMA accumulator failed this: 3.6x SGEMM's error)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    case = RouteCase(T, REAL_H, REAL_E, seed=T + 1)
    cfg = rk.router_config(T, REAL_E, REAL_H, torch.cuda.get_device_properties(0).multi_processor_count)
    assert cfg.bf16_split
    ref = case.x.double() @ case.w.double().T
    split = rk.router_logit_partials(case.x, case.w, cfg).sum(0)
    sgemm = case.x.float() @ case.w.T
    bf16_w = case.x.double() @ case.w.bfloat16().double().T
    e_split, e_sgemm, e_bf16 = ((v.double() - ref).abs().max().item() for v in (split, sgemm, bf16_w))
    print(f"T={T}: max |logit - fp64| three-part bf16 {e_split:.2e}, cuBLAS SGEMM {e_sgemm:.2e}, bf16 weight "
          f"{e_bf16:.2e}")
    assert e_split <= 2 * e_sgemm, (e_split, e_sgemm)
    assert e_bf16 > 30 * e_split, (e_bf16, e_split)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 8, 32, 1054])
def test_cuda_norms_real_shapes(T):
    x, r, w = norm_inputs(T, REAL_H, torch.bfloat16, seed=T)
    out, ref = torch.full_like(x, float("nan")), torch.empty_like(x)
    nk.gemma_rmsnorm(x, w, 1e-6, out)
    nk.gemma_rmsnorm_torch(x, w, 1e-6, ref)
    assert_within_ulps(out, ref.double(), torch.bfloat16)
    xa, ra, xb, rb = x.clone(), r.clone(), x.clone(), r.clone()
    nk.gemma_fused_add_rmsnorm(xa, ra, w, 1e-6)
    nk.gemma_fused_add_rmsnorm_torch(xb, rb, w, 1e-6)
    assert torch.equal(ra, rb), "the residual is one fp32 add rounded to nearest: bit-exact"
    assert_within_ulps(xa, xb.double(), torch.bfloat16)


@pytest.mark.cuda
def test_cuda_graph_replay_router_and_norms():
    torch.backends.cuda.matmul.allow_tf32 = False
    T, H, E, K = 32, REAL_H, REAL_E, REAL_K
    a, b = RouteCase(T, H, E, seed=1), RouteCase(T, H, E, seed=2)
    b.w, b.b = a.w, a.b  # same layer weights, new activations
    x = a.x.clone()
    nrt = torch.tensor([T], dtype=torch.int64, device=DEV)
    local = torch.empty(T, K, dtype=torch.int32, device=DEV)
    wts = torch.empty(T, K, device=DEV)
    glob = torch.empty(T, K, dtype=torch.int32, device=DEV)
    nx, nr, nw = norm_inputs(T, H, torch.bfloat16, seed=3)
    n_out = torch.empty_like(nx)
    fx, fr = nx.clone(), nr.clone()

    def step():
        rk.route_triton(x, a.w, a.b, K, 2.0, nrt, 16, 32, local, wts, glob)
        nk.gemma_rmsnorm(nx, nw, 1e-6, n_out)
        nk.gemma_fused_add_rmsnorm(fx, fr, nw, 1e-6)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # new inputs in the captured buffers, fewer real rows
    x.copy_(b.x)
    nrt.fill_(T - 5)
    nx2, nr2, _ = norm_inputs(T, H, torch.bfloat16, seed=4)
    nx.copy_(nx2)
    fx.copy_(nx2)
    fr.copy_(nr2)
    local.fill_(POISON_ID)
    wts.fill_(float("nan"))
    n_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = b.run(rk.route_torch, K, 2.0, T - 5, 16, 32)
    sel32 = torch.sigmoid(b.x.float() @ b.w.T) + b.b
    same_routing((local, wts, glob), want, sel32, K)
    ref = torch.empty_like(nx2)
    nk.gemma_rmsnorm_torch(nx2, nw, 1e-6, ref)
    assert_within_ulps(n_out, ref.double(), torch.bfloat16)
    xb, rb = nx2.clone(), nr2.clone()
    nk.gemma_fused_add_rmsnorm_torch(xb, rb, nw, 1e-6)
    assert torch.equal(fr, rb)
    assert_within_ulps(fx, xb.double(), torch.bfloat16)
