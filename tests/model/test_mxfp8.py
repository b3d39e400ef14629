"""The MXFP8 format (models/minimax_m3/mxfp8.py): quantization_config parsing and its refusals,
the config's MXFP8 variants and block rule, quantize/dequantize against a float64 reference,
and the modules an MXFP8 model holds (fp8 parameters, the torch MoE path, the fused MoE's
refusal)."""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers.paged import DEV

from graphcap.startup.tuning import KernelTuner
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.layers import BlockSparseMoE, DenseMLP
from models.minimax_m3.model import MiniMaxM3ForCausalLM
from models.minimax_m3.mxfp8 import (
    BLOCK,
    FP8,
    MXFP8Config,
    MXFP8Linear,
    dequantize_mxfp8,
    quantize_mxfp8,
)
from models.minimax_m3.ops import FusedLinear, FusedMoE, mlp_triton

TINY8 = MiniMaxM3Config.tiny(quantization="mxfp8")
RELEASE = {  # MiniMax-M3-MXFP8's quantization_config as spec §1 lists it (gates named per layer)
    "quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
    "ignored_layers": ["lm_head", "model.embed_tokens", "vision_tower", "multi_modal_projector", "patch_merge_mlp"]
    + [f"model.layers.{i}.block_sparse_moe.gate" for i in range(3, 60)],
}


# ---- quantization_config ---------------------------------------------------------------------

def test_release_config_parses_and_round_trips():
    q = MXFP8Config.from_hf(RELEASE)
    assert q.weight_block_size == (1, 32) and q.activation_scheme == "dynamic"
    assert q.ignored_layers[-1] == "model.layers.59.block_sparse_moe.gate"
    assert MXFP8Config.from_hf(q.to_hf()) == q
    # the release's entries name nothing the model quantizes; a projection is named by any spelling
    assert q.covering_entry("model.layers.3.self_attn.o_proj") is None
    bad = MXFP8Config.from_hf({**RELEASE, "ignored_layers": ["language_model.model.layers.3.self_attn"]})
    assert bad.covering_entry("model.layers.3.self_attn.o_proj") == "model.layers.3.self_attn"
    assert bad.covering_entry("model.layers.30.self_attn.o_proj") is None
    assert MXFP8Config.from_hf({**RELEASE, "ignored_layers": ["o_proj"]}).covering_entry(
        "model.layers.7.self_attn.o_proj") == "o_proj"
    # absent block size and scheme mean MXFP8's own
    assert MXFP8Config.from_hf({"quant_method": "mxfp8"}) == MXFP8Config((1, 32), "dynamic", ())


REFUSED = [
    ("not a dict", ["mxfp8"], "quantization_config must be a JSON object"),
    ("other method", {**RELEASE, "quant_method": "fp8"}, "quantization_config.quant_method='fp8' is unsupported"),
    ("no method", {k: v for k, v in RELEASE.items() if k != "quant_method"}, "quant_method=None is unsupported"),
    ("block 128x128", {**RELEASE, "weight_block_size": [128, 128]},
     "quantization_config.weight_block_size=[128, 128] is unsupported"),
    ("block 1x16", {**RELEASE, "weight_block_size": [1, 16]}, "weight_block_size=[1, 16] is unsupported"),
    ("block str", {**RELEASE, "weight_block_size": "1x32"},
     "quantization_config.weight_block_size must be a list of two integers, got '1x32'"),
    ("block float", {**RELEASE, "weight_block_size": [1, 32.0]}, "must be a list of two integers"),
    ("block three", {**RELEASE, "weight_block_size": [1, 1, 32]}, "must be a list of two integers"),
    ("static", {**RELEASE, "activation_scheme": "static"},
     "quantization_config.activation_scheme='static' is unsupported; only 'dynamic'"),
    ("scheme int", {**RELEASE, "activation_scheme": 1}, "quantization_config.activation_scheme must be a string"),
    ("ignored str", {**RELEASE, "ignored_layers": "lm_head"},
     "quantization_config.ignored_layers must be a list of module names"),
    ("ignored int", {**RELEASE, "ignored_layers": ["lm_head", 3]}, "ignored_layers must be a list of module names"),
]


@pytest.mark.parametrize("raw,message", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_quantization_config_refusals_name_the_field(raw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        MXFP8Config.from_hf(raw)


@pytest.mark.parametrize("layout", ["vl", "text"])
def test_from_hf_reads_quantization_config(layout):
    text = TINY8.with_quantization(None).to_hf_text()
    raw = {"text_config": text, "quantization_config": RELEASE} if layout == "vl" else {**text,
                                                                                      "quantization_config": RELEASE}
    c = MiniMaxM3Config.from_hf(raw)
    assert c.quantization == MXFP8Config.from_hf(RELEASE)
    assert MiniMaxM3Config.from_hf(text).quantization is None
    assert MiniMaxM3Config.from_hf(TINY8.to_hf_text()) == TINY8  # to_hf_text carries it back
    bad = copy.deepcopy(raw)
    (bad if layout == "text" else bad["text_config"])["quantization_config"] = {**RELEASE, "quant_method": "awq"}
    with pytest.raises(ValueError, match="quant_method='awq'" if layout == "text" else "different quantization_config"):
        MiniMaxM3Config.from_hf(bad)


def test_variants_keep_quantization_and_refuse_broken_blocks():
    assert MiniMaxM3Config.preset("tiny", "mxfp8") == TINY8 == dataclasses.replace(TINY8, quantization="mxfp8")
    assert TINY8.first_layers(2).quantization == TINY8.quantization == TINY8.shard(2, 2).quantization
    assert MiniMaxM3Config.tiny().quantization is None and TINY8.with_quantization(None).quantization is None
    r8 = MiniMaxM3Config.preset("rank-of-8", "mxfp8")
    assert r8.quantization == MXFP8Config() and r8 == MiniMaxM3Config.rank_of_8().with_quantization("mxfp8")
    assert MiniMaxM3Config.preset("slice", "mxfp8").num_hidden_layers == 7
    with pytest.raises(ValueError, match=re.escape("shared_intermediate_size * n_shared_experts=48 (the shared "
                                                   "expert's down_proj input) is not a multiple of 32")):
        MiniMaxM3Config.tiny().with_quantization("mxfp8")  # tiny's own widths are not whole blocks
    narrow = dataclasses.replace(TINY8, dense_intermediate_size=64)
    narrow.shard(2, 2)  # 32 columns per rank: whole blocks
    with pytest.raises(ValueError, match=re.escape("at tp_size=4 each rank holds dense_intermediate_size=16 columns "
                                                   "of the dense MLP's down_proj input (a slice of 64)")):
        narrow.shard(4, 4)
    with pytest.raises(ValueError, match="quantization='int4'"):
        TINY8.with_quantization("int4")


# ---- the maths against float64 ---------------------------------------------------------------

def e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative e4m3fn value (float64, ascending) and whether its code's
    mantissa is even, decoded from the bits by hand (bias 7, subnormals below 2**-6, code 0x7f NaN)."""
    vals, even = [], []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        even.append(m % 2 == 0)
    return torch.tensor(vals, dtype=torch.float64), torch.tensor(even)


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float64 ``y`` (|y| <= 448) to the nearest e4m3 value, ties to the even mantissa."""
    grid, even = e4m3_grid()
    a = y.abs()
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(even[lo], lo, hi)))
    return torch.sign(y) * grid[pick]


def reference_exponent(amax: float) -> int:
    """The smallest e with ``amax / 2**e <= 448``, in [-127, 127]; 0 for a zero block (float64)."""
    if amax == 0:
        return 0
    e = math.ceil(math.log2(amax / 448))
    while amax / 2.0**e > 448:
        e += 1
    while amax / 2.0 ** (e - 1) <= 448:
        e -= 1
    return max(-127, min(127, e))


def sample_blocks() -> torch.Tensor:
    """fp32 rows of six 32-blocks at every scale the format meets; the last row holds the edge cases."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(6 * BLOCK, generator=g) * 2.0**k for k in range(-140, 121, 13)]
    edge = torch.zeros(6, BLOCK)
    edge[0, 5] = 448.0 * 2.0**-3  # amax exactly 448 * 2**k: e = k
    edge[1, 0] = float(torch.tensor(448.0 * 2.0**4).nextafter(torch.tensor(math.inf)))  # just above: e = k + 1
    edge[2] = 2.0 ** (torch.arange(BLOCK) % 18 - 8).double()  # powers of two 2**-8 .. 2**9: exact
    edge[3, :3] = torch.tensor([1e-45, -3e-42, 1e-40])  # fp32 subnormals: the smallest scale (clamped)
    edge[4, 7] = -3.0e38  # near fp32 max: a large scale, still below E8M0's 255
    rows.append(edge.flatten())  # block 5 stays zero
    return torch.stack(rows)


def test_quantize_matches_the_float64_reference():
    w = sample_blocks()
    q, s = quantize_mxfp8(w)
    assert q.dtype == FP8 and s.dtype == torch.uint8 and q.shape == w.shape and s.shape == (w.shape[0], 6)
    wb = w.double().unflatten(-1, (-1, BLOCK))
    e_ref = torch.tensor([[reference_exponent(float(b.abs().max())) for b in row] for row in wb])
    assert torch.equal(s.to(torch.int64) - 127, e_ref)
    assert int(s.max()) <= 254  # 255 is E8M0's NaN
    assert (e_ref == -127).any() and (e_ref > 100).any()  # both ends of the scale range were met
    scale = torch.tensor([[2.0**e for e in row] for row in e_ref.tolist()], dtype=torch.float64)[..., None]
    want = round_e4m3(wb / scale)
    assert torch.equal(q.double().unflatten(-1, (-1, BLOCK)), want)
    deq = dequantize_mxfp8(q, s, torch.float64).unflatten(-1, (-1, BLOCK))
    assert torch.equal(deq, want * scale)  # dequantisation is exact
    # round-trip error per element: half an e4m3 step at the element's size (2**-10 below 2**-6)
    y = (wb / scale).abs()
    bound = scale * torch.maximum(y * 2.0**-4, torch.full_like(y, 2.0**-10))
    assert ((deq - wb).abs() <= bound).all()
    # scales are minimal: the block's largest element lands in the top binade (unless clamped or zero)
    top = (wb / scale).abs().amax(-1)
    assert ((top > 224) | (e_ref == -127) | (top == 0)).all() and (top <= 448).all()


def test_edge_blocks():
    edge = sample_blocks()[-1].unflatten(-1, (-1, BLOCK))
    q, s = quantize_mxfp8(edge)
    assert s[:, 0].tolist() == [127 - 3, 127 + 5, 127 + 1, 0, 127 + 120, 127]
    # powers of two come back exactly; the zero block is zeros with the neutral scale 2**0
    assert torch.equal(dequantize_mxfp8(q[2], s[2], torch.float32), edge[2])
    assert (q[5].float() == 0).all() and int(s[5, 0]) == 127
    assert torch.equal(dequantize_mxfp8(q[0], s[0], torch.float32), edge[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_dtype_and_stacked_shapes(dtype):
    w = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(1))
    q, s = quantize_mxfp8(w)
    assert s.shape == (3, 40, 2)
    d = dequantize_mxfp8(q, s, dtype)
    assert d.dtype == dtype and d.shape == w.shape
    assert torch.equal(d, dequantize_mxfp8(q, s, torch.float64).to(dtype))
    assert (d.float() - w).abs().max() <= w.abs().max() * 2.0**-4


def test_quantize_refuses_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="2 non-finite values"):
        quantize_mxfp8(torch.tensor([float("nan"), float("inf")] + [0.0] * 30))


# ---- modules ---------------------------------------------------------------------------------

def test_quantized_model_holds_fp8_parameters():
    m = MiniMaxM3ForCausalLM(TINY8, dtype=torch.float32)
    p = dict(m.named_parameters())
    H, E, inter, sh = TINY8.hidden_size, TINY8.num_local_experts, TINY8.intermediate_size, TINY8.shared_width
    for name, out_f, in_f in [("model.layers.1.self_attn.qkv_proj", TINY8.qkv_size(1), H),
                              ("model.layers.0.self_attn.qkv_proj", TINY8.qkv_size(0), H),
                              ("model.layers.1.self_attn.o_proj", H, TINY8.q_size),
                              ("model.layers.0.mlp.gate_up_proj", 2 * TINY8.dense_intermediate_size, H),
                              ("model.layers.0.mlp.down_proj", H, TINY8.dense_intermediate_size),
                              ("model.layers.2.block_sparse_moe.shared_experts.gate_up_proj", 2 * sh, H),
                              ("model.layers.2.block_sparse_moe.shared_experts.down_proj", H, sh)]:
        assert p[name + ".weight"].dtype == FP8 and p[name + ".weight"].shape == (out_f, in_f), name
        assert p[name + ".weight_scale_inv"].dtype == torch.uint8, name
        assert p[name + ".weight_scale_inv"].shape == (out_f, in_f // 32), name
    ex = "model.layers.3.block_sparse_moe.experts."
    assert p[ex + "w13"].dtype == p[ex + "w2"].dtype == FP8
    assert p[ex + "w13"].shape == (E, 2 * inter, H) and p[ex + "w13_scale_inv"].shape == (E, 2 * inter, H // 32)
    assert p[ex + "w2"].shape == (E, H, inter) and p[ex + "w2_scale_inv"].shape == (E, H, inter // 32)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.3.block_sparse_moe.gate.weight",
                 "model.layers.3.block_sparse_moe.e_score_correction_bias", "model.layers.3.input_layernorm.weight"):
        assert p[name].is_floating_point() and p[name].dtype != FP8, name
    plain = dict(MiniMaxM3ForCausalLM(TINY8.with_quantization(None)).named_parameters())
    assert not any(t.dtype in (FP8, torch.uint8) for t in plain.values())
    assert set(p) == set(plain) | {n + "_scale_inv" for n, t in p.items() if t.dtype == FP8}


def test_init_random_quantizes_the_same_draw():
    q8, f32 = MiniMaxM3ForCausalLM(TINY8), MiniMaxM3ForCausalLM(TINY8.with_quantization(None))
    q8.init_random_(seed=4)
    f32.init_random_(seed=4)
    p8, p32 = dict(q8.named_parameters()), dict(f32.named_parameters())
    fp8 = [n for n, t in p8.items() if t.dtype == FP8]
    assert len(fp8) == 4 * 2 + 3 * 2 + 4 * 2  # qkv + o per layer; w13 + w2 of 3 MoE layers; 4 gate_up + down
    for n in fp8:
        q, s = quantize_mxfp8(p32[n])
        assert torch.equal(p8[n].view(torch.uint8), q.view(torch.uint8)), n
        assert torch.equal(p8[n + "_scale_inv"], s), n
    assert torch.equal(p8["lm_head.weight"], p32["lm_head.weight"])


def test_mxfp8_linear_is_f_linear_on_the_dequantized_weight():
    lin = MXFP8Linear(64, 24)
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    q, s = quantize_mxfp8(w)
    lin.weight.copy_(q)
    lin.weight_scale_inv.copy_(s)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(lin(x), F.linear(x, dequantize_mxfp8(q, s, torch.float32)), rtol=0, atol=0)
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    assert not lin.weight.requires_grad and not lin.weight_scale_inv.requires_grad
    with pytest.raises(ValueError, match="in_features=48"):
        MXFP8Linear(48, 8)


def _moe_pair(seed: int = 5) -> tuple[BlockSparseMoE, BlockSparseMoE]:
    """An MXFP8 MoE and an fp32 one holding its dequantised weights."""
    args = (64, 8, 8, 2, 32, 64, 2.0, 1.702, 7.0, torch.float32)
    q8, ref = BlockSparseMoE(*args, quantization=MXFP8Config()), BlockSparseMoE(*args)
    g = torch.Generator().manual_seed(seed)
    pq, pr = dict(q8.named_parameters()), dict(ref.named_parameters())
    with torch.no_grad():
        for n, t in pr.items():
            v = torch.randn(t.shape, generator=g) * (t.shape[-1] ** -0.5 if t.dim() > 1 else 0.1)
            if pq[n].dtype == FP8:
                q, s = quantize_mxfp8(v)
                pq[n + "_scale_inv"].copy_(s)
                pq[n].copy_(q)
                v = dequantize_mxfp8(q, s, torch.float32)
            else:
                pq[n].copy_(v)
            t.copy_(v)
    return q8, ref


@pytest.mark.parametrize("grouped", [True, False])
def test_torch_moe_on_fp8_experts_equals_dequantized(grouped):
    q8, ref = _moe_pair()
    assert q8.experts.w13.dtype == FP8 and torch.equal(q8.experts.compute_weights(torch.float32)[0], ref.experts.w13)
    assert ref.experts.compute_weights(torch.float32)[0] is ref.experts.w13  # bf16/fp32: the parameter itself
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    n = torch.tensor([7])
    torch.testing.assert_close(q8(x, n, grouped=grouped), ref(x, n, grouped=grouped), rtol=1e-6, atol=1e-6)


def test_quantized_model_runs_the_fused_moe_on_fp8_experts():
    """The triton op table keeps the fused MoE for MXFP8 experts: the kernels read fp8 weights and
    their scales and equal the fused MoE on the dequantised weights bit for bit (the dot inputs
    are the same), and the torch MoE on them closely."""
    q8_model = MiniMaxM3ForCausalLM(TINY8, device=DEV, producer="triton")  # interpreter or GPU
    assert isinstance(q8_model.ops.moe, FusedMoE)
    moe, ref = (m.to(DEV) for m in _moe_pair())
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)).to(DEV)
    n = torch.tensor([4], device=DEV)
    fused = FusedMoE(KernelTuner(time_candidates=False))
    ids, w = fused.route(moe, x, n)
    out = fused.experts(moe, x, ids, w)
    assert torch.equal(out, fused.experts(ref, x, ids, w))
    torch.testing.assert_close(out, moe(x, n), rtol=1e-4, atol=1e-5)
    q8_model.init_random_(0, balance_routing=False)
    q8_model.ops.moe.choose(q8_model, 5)  # validates the fp8 candidate against the dequantised reference
    choice = q8_model.ops.tuner.choices[("moe", 5)]
    assert choice.rejected == {}  # every fp8 candidate passed (the GPU times them; CPU keeps config0)
    assert choice.chosen == "config0" or DEV == "cuda"


def test_triton_mlp_goes_through_the_quantized_modules():
    mlp = DenseMLP(64, 64, 1.702, 7.0, torch.float32, quantization=MXFP8Config())
    g = torch.Generator().manual_seed(8)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        q, s = quantize_mxfp8(torch.randn(lin.weight.shape, generator=g) * 0.1)
        lin.weight.copy_(q)
        lin.weight_scale_inv.copy_(s)
    mlp.to(DEV)
    x = torch.randn(4, 64, generator=g).to(DEV)
    torch.testing.assert_close(mlp_triton(mlp, x), mlp(x), rtol=1e-5, atol=1e-5)


# ---- GPU: the real kernels on MXFP8 weights --------------------------------------------------

@pytest.mark.cuda
def test_cuda_mxfp8_replays_equal_padded_eager_and_track_bf16():
    """rank-of-8 shapes (4 layers), MXFP8 weights, the fused kernels (fp8 MoE): every graph replay
    equals the padded debug-eager run bit for bit; the logits stay close to a bf16 model holding
    the dequantised weights, and greedy decoding agrees with it."""
    from graphcap import CaptureConfig
    from models.minimax_m3 import build_from_preset
    from models.minimax_m3.build import build_dequantized_twin
    from steps import TokenChunk

    config = MiniMaxM3Config.rank_of_8().first_layers(4).with_quantization("mxfp8")
    capture = CaptureConfig(enabled=True, max_tokens=64, buckets=(1, 2, 4, 8, 32))
    graphed = build_from_preset(config, "cuda", torch.bfloat16, max_tokens=64, max_seqs=8, max_seq_len=160,
                                capture=capture)
    padded = graphed.with_capture(dataclasses.replace(capture, debug_eager=True))
    twin = build_dequantized_twin(graphed)
    graphed.capture()
    assert graphed.validate() == {}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (24,), generator=gen).tolist() for _ in range(4)]
    for i, p in enumerate(prompts):
        for r in (graphed, twin):
            r.add_request(i)
        ref = twin.step([TokenChunk(i, 0, p)]).logits
        out = graphed.step([TokenChunk(i, 0, p)]).logits
        assert ((out.float() - ref.float()).norm() / ref.float().norm()) < 5e-2
    agree = total = 0
    nxt = {i: None for i in range(4)}
    for _ in range(24):  # decode 4 requests, graphed, against padded eager and the bf16 twin
        chunks = [TokenChunk(i, graphed.num_written(i), [nxt[i] if nxt[i] is not None else prompts[i][-1]])
                  for i in range(4)]
        want = padded.run_chunks(chunks, commit=False).clone()
        got = graphed.run_chunks(chunks)
        assert torch.equal(got, want)
        bf = twin.run_chunks([TokenChunk(c.seq_id, twin.num_written(c.seq_id), c.token_ids) for c in chunks])
        a, b = got.argmax(-1).tolist(), bf.argmax(-1).tolist()
        agree += sum(x == y for x, y in zip(a, b))
        total += len(a)
        nxt = dict(enumerate(a))
    assert agree / total >= 0.9, f"greedy agreement with bf16 on the dequantised weights {agree}/{total}"


def test_fused_linear_times_each_candidate_over_several_layers_weights(monkeypatch):
    """One layer's projection weight fits in L2, so the tuner times a candidate over as many
    layers' weights of that shape as ``TIMED_WEIGHT_BYTES`` asks for (all there are where fewer),
    and reports the time per call; validation still runs on the first layer's weight."""
    import models.minimax_m3.ops as ops_mod
    from graphcap.startup.tuning import KernelTuner

    model = MiniMaxM3ForCausalLM(TINY8, device=DEV, producer="triton")
    model.init_random_(0, balance_routing=False)
    by_shape: dict[tuple[int, int], list[MXFP8Linear]] = {}
    for m in model.modules():
        if isinstance(m, MXFP8Linear):
            by_shape.setdefault((m.out_features, m.in_features), []).append(m)
    qkv = model.model.layers[1].self_attn.qkv_proj
    per = qkv.weight.numel() * qkv.weight.element_size() + qkv.weight_scale_inv.numel()
    monkeypatch.setattr(ops_mod, "TIMED_WEIGHT_BYTES", 2 * per - 1)  # two qkv weights
    assert len(by_shape[(qkv.out_features, qkv.in_features)]) > 2
    lengths: list[int] = []
    monkeypatch.setattr(KernelTuner, "_time", lambda self, run: lengths.append(len(run())) or 12.0)
    model.ops.tuner.time_candidates = True
    model.ops.linear.choose(model, 3)
    for (n, k), mods in by_shape.items():
        want = len(ops_mod.cold_rotation(mods))
        assert want == min(len(mods), -(-(2 * per - 1) // (mods[0].weight.numel() + mods[0].weight_scale_inv.numel())))
        c = model.ops.tuner.choices[(FusedLinear.OP, (n, k, 3))]
        assert c.rejected == {} and all(t == 12.0 / want for t in c.timings_us.values()), (n, k, c.timings_us)
    assert len(ops_mod.cold_rotation(by_shape[(qkv.out_features, qkv.in_features)])) == 2
    assert set(lengths) == {len(ops_mod.cold_rotation(m)) for m in by_shape.values()}


def test_fused_linear_validates_the_fp8_kernel_and_runs_it_where_chosen():
    """The fused op table's linear: the tuner validates the fp8 kernel (interpreter here) against
    the module's dequantise + F.linear; at a row count where the kernel won it runs it, elsewhere
    (and for bf16 modules) the module."""
    model = MiniMaxM3ForCausalLM(TINY8, device=DEV, producer="triton")
    model.init_random_(0, balance_routing=False)
    lin = model.ops.linear
    assert isinstance(lin, FusedLinear)
    model.ops.choose_kernels(model, 5)
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, MXFP8Linear)}
    choices = [model.ops.tuner.choices[(FusedLinear.OP, (n, k, 5))] for n, k in shapes]
    assert choices and all(c.rejected == {} for c in choices)  # the kernel passed validation
    # at one row the weight-row form is a candidate too (where a whole step divides K), validated alike
    from models.minimax_m3.kernels.fp8_linear import gemv_config_candidates

    model.ops.choose_kernels(model, 1)
    for n, k in shapes:
        c = model.ops.tuner.choices[(FusedLinear.OP, (n, k, 1))]
        offered = sum("GemvConfig" in name for name in c.timings_us)
        assert c.rejected == {} and offered == len(gemv_config_candidates(1, k)), (n, k, c.timings_us)
    attn = model.model.layers[1].self_attn
    x = torch.randn(5, TINY8.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEV)
    key = (attn.qkv_proj.out_features, attn.qkv_proj.in_features, 5)
    from models.minimax_m3.kernels.fp8_linear import default_linear_config

    lin._kernel_rows[key] = default_linear_config(5, *key[:2])  # as if the kernel had won (CPU does not time)
    torch.testing.assert_close(lin(attn.qkv_proj, x), attn.qkv_proj(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(attn.qkv_proj, x[:4]), attn.qkv_proj(x[:4]))  # 4 rows: not chosen, the module
    plain = torch.nn.Linear(8, 4).to(DEV)
    assert torch.equal(lin(plain, torch.ones(2, 8, device=DEV)), plain(torch.ones(2, 8, device=DEV)))
