"""MXFP8 checkpoints end to end on CPU: the writer's layout, a bit-exact load into fp8/uint8
parameters, every loader error naming key and file, TP2 slices of weights and scales, and the
model against the float64 reference fed the dequantised weights (prefill and chunked prefill)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest
import torch
from helpers.ranks import run_ranks
from m3_reference import reference_logits
from safetensors.torch import load_file
from test_m3_weights import edit_shard, read_all

from distributed import ParallelGroup
from graphcap import CaptureConfig
from models.minimax_m3 import build_from_checkpoint
from models.minimax_m3.checkpoint_writer import write_synthetic_checkpoint
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.model import MiniMaxM3ForCausalLM
from models.minimax_m3.mxfp8 import FP8
from models.minimax_m3.weights import checkpoint_layout, load_checkpoint
from steps import TokenChunk

P = "language_model."
TINY8 = MiniMaxM3Config.tiny(quantization="mxfp8")
RUNNER = dict(backend="torch", max_tokens=48, max_seqs=4, max_seq_len=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m3_tiny_mxfp8")
    write_synthetic_checkpoint(TINY8, folder, seed=3, shard_size_bytes=100_000)
    return str(folder)


def text_tensors(folder: str) -> dict[str, torch.Tensor]:
    return {k[len(P):]: v for k, v in read_all(folder).items() if k.startswith(P)}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of fp8 tensors (torch.equal on fp8 compares values; NaN codes would differ)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def poisoned(config: MiniMaxM3Config = TINY8) -> MiniMaxM3ForCausalLM:
    m = MiniMaxM3ForCausalLM(config, dtype=torch.float32)
    for p in m.parameters():
        p.data.view(torch.uint8).fill_(0x55) if p.dtype in (FP8, torch.uint8) else p.data.fill_(12345.0)
    return m


def untouched_param(p: torch.Tensor) -> bool:
    return bool((p.view(torch.uint8) == 0x55).all()) if p.dtype in (FP8, torch.uint8) else bool((p == 12345.0).all())


def untouched(m: MiniMaxM3ForCausalLM) -> bool:
    return all(untouched_param(p) for p in m.parameters())


def fails_untouched(folder: str, match: str, config: MiniMaxM3Config = TINY8) -> None:
    m = poisoned(config)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(m, folder)
    assert untouched(m)  # validation runs before any copy


def dequantized(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with every fp8 weight replaced by its float64 value (scales dropped),
    decoded here from the format's definition, not by ``mxfp8.dequantize_mxfp8``."""
    def value(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return q.double() * (2.0 ** (s.double() - 127)).repeat_interleave(32, dim=-1)

    return {k: value(v, w[k + "_scale_inv"]) if v.dtype == FP8 else v
            for k, v in w.items() if not k.endswith("_scale_inv")}


# ---- writer and a bit-exact load -------------------------------------------------------------

def test_writer_layout(ckpt):
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    assert cfg["quantization_config"]["quant_method"] == "mxfp8" and "quantization_config" not in cfg["text_config"]
    assert MiniMaxM3Config.from_hf(ckpt) == TINY8
    assert len(glob.glob(os.path.join(ckpt, "model-*-of-*.safetensors"))) > 2
    w = text_tensors(ckpt)
    a = "model.layers.1.self_attn."
    assert w[a + "q_proj.weight"].dtype == FP8 and w[a + "q_proj.weight_scale_inv"].dtype == torch.uint8
    assert w[a + "q_proj.weight_scale_inv"].shape == (TINY8.q_size, TINY8.hidden_size // 32)
    assert w[a + "o_proj.weight_scale_inv"].shape == (TINY8.hidden_size, TINY8.q_size // 32)
    e = "model.layers.2.block_sparse_moe."
    assert w[e + "experts.3.w2.weight"].dtype == FP8 and w[e + "experts.3.w2.weight_scale_inv"].shape == (64, 1)
    for k in ("lm_head.weight", "model.embed_tokens.weight", e + "gate.weight", e + "e_score_correction_bias",
              a + "q_norm.weight"):
        assert w[k].dtype == torch.float32 and k + "_scale_inv" not in w, k
    assert sum(k.endswith("_scale_inv") for k in w) == sum(v.dtype == FP8 for v in w.values()) > 100
    # the weights are quantised random draws, not zeros
    assert dequantized(w)[a + "q_proj.weight"].std() > 0.05


def test_round_trip_is_bit_exact(ckpt):
    m = poisoned()
    rep = load_checkpoint(m, ckpt)
    w = text_tensors(ckpt)
    assert rep.loaded == len(w) == len(checkpoint_layout(TINY8))
    sd = dict(m.named_parameters())
    assert not any(untouched_param(p) for p in sd.values())  # every parameter was written
    for i in (0, 1):  # dense and sparse attention
        a = f"model.layers.{i}.self_attn."
        names = ["q_proj", "k_proj", "v_proj"] + (["index_q_proj", "index_k_proj"] if i else [])
        for suffix in ("weight", "weight_scale_inv"):
            assert sd[a + "qkv_proj." + suffix].dtype == (FP8 if suffix == "weight" else torch.uint8)
            fused = torch.cat([w[f"{a}{n}.{suffix}"] for n in names])
            assert torch.equal(bits(sd[a + "qkv_proj." + suffix]), bits(fused))
            assert torch.equal(bits(sd[a + "o_proj." + suffix]), bits(w[a + "o_proj." + suffix]))
    e = "model.layers.3.block_sparse_moe."
    for j in range(TINY8.num_local_experts):
        for s in ("", "_scale_inv"):
            assert torch.equal(bits(sd[e + "experts.w13" + s][j]), bits(torch.cat(
                [w[f"{e}experts.{j}.w1.weight{s}"], w[f"{e}experts.{j}.w3.weight{s}"]])))
            assert torch.equal(bits(sd[e + "experts.w2" + s][j]), bits(w[f"{e}experts.{j}.w2.weight{s}"]))
    for mlp in (e + "shared_experts.", "model.layers.0.mlp."):
        for s in ("weight", "weight_scale_inv"):
            assert torch.equal(bits(sd[mlp + "gate_up_proj." + s]),
                               bits(torch.cat([w[mlp + "gate_proj." + s], w[mlp + "up_proj." + s]])))
            assert torch.equal(bits(sd[mlp + "down_proj." + s]), bits(w[mlp + "down_proj." + s]))
    for k in ("lm_head.weight", "model.embed_tokens.weight", e + "gate.weight", e + "e_score_correction_bias"):
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], w[k])


def test_text_layout_bf16(tmp_path):
    plain_bf16 = dataclasses.replace(TINY8.with_quantization(None), dtype="bfloat16")
    write_synthetic_checkpoint(plain_bf16, tmp_path, seed=2, text_only=True, quantization="mxfp8")
    cfg = json.load(open(tmp_path / "config.json"))
    assert "text_config" not in cfg and cfg["quantization_config"]["weight_block_size"] == [1, 32]
    w = read_all(str(tmp_path))
    assert w["lm_head.weight"].dtype == torch.bfloat16 and w["model.layers.1.self_attn.q_proj.weight"].dtype == FP8
    m = MiniMaxM3ForCausalLM(MiniMaxM3Config.from_hf(tmp_path), dtype=torch.bfloat16)
    load_checkpoint(m, tmp_path)
    o = "model.layers.2.self_attn.o_proj.weight"
    assert torch.equal(bits(m.model.layers[2].self_attn.o_proj.weight), bits(w[o]))
    assert torch.equal(m.lm_head.weight, w["lm_head.weight"])


# ---- loader errors: key and file named ------------------------------------------------------

def shard_of(folder: str, key: str) -> str:
    return json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"][key]


def test_missing_scale_names_key_and_the_weights_file(ckpt_copy):
    key = P + "model.layers.2.self_attn.index_k_proj.weight"
    name = shard_of(ckpt_copy, key)
    edit_shard(ckpt_copy, key, lambda t: t.pop(key + "_scale_inv"))
    fails_untouched(ckpt_copy, rf"'{key}_scale_inv' is missing: MXFP8 needs the uint8 scales of '{key}' \(in {name}\)")


def test_wrong_scale_shape_names_key_and_file(ckpt_copy):
    key = P + "model.layers.1.self_attn.o_proj.weight_scale_inv"
    name = shard_of(ckpt_copy, key)
    edit_shard(ckpt_copy, key, lambda t: t.update({key: torch.zeros(64, 8, dtype=torch.uint8)}))
    fails_untouched(ckpt_copy, rf"'{key}' has shape \(64, 8\), expected \(64, 4\) \(one E8M0 byte per 32 input "
                               rf"columns\) \(in {name}\)")


@pytest.mark.parametrize("key,dtype,message", [
    ("model.layers.3.block_sparse_moe.experts.6.w1.weight_scale_inv", torch.float32,
     r"has dtype F32, expected U8 \(MXFP8 scales are E8M0 bytes\)"),
    ("model.layers.0.mlp.down_proj.weight", torch.bfloat16,
     r"has dtype BF16, expected F8_E4M3 \(an MXFP8 checkpoint stores every projection"),
    ("model.layers.1.block_sparse_moe.shared_experts.up_proj.weight", torch.float32,
     r"has dtype F32, expected F8_E4M3"),
])
def test_wrong_dtype_names_key_and_file(ckpt_copy, key, dtype, message):
    key = P + key
    name = shard_of(ckpt_copy, key)
    edit_shard(ckpt_copy, key, lambda t: t.update({key: t[key].to(torch.float32).to(dtype)}))
    fails_untouched(ckpt_copy, rf"'{key}' {message}.*\(in {name}\)")


def test_fp8_weight_in_an_unquantized_checkpoint(tmp_path):
    c = TINY8.with_quantization(None)
    write_synthetic_checkpoint(c, tmp_path, seed=1, shard_size_bytes=1 << 30)
    key = P + "model.layers.1.self_attn.q_proj.weight"
    edit_shard(str(tmp_path), key, lambda t: t.update({key: t[key].to(FP8), key + "_scale_inv": torch.zeros(
        t[key].shape[0], 2, dtype=torch.uint8)}))
    msg = str(pytest.raises(ValueError, load_checkpoint, poisoned(c), tmp_path).value)
    assert f"'{key}' has dtype F8_E4M3, expected F32 (fp8 weights need an MXFP8 quantization_config" in msg
    assert f"unexpected key '{key}_scale_inv' in model-00001-of-00001.safetensors (an MXFP8 scale, but config.json " \
           "has no quantization_config" in msg


def test_mxfp8_and_unquantized_refuse_each_other(ckpt, tmp_path):
    fails_untouched(ckpt, r"the checkpoint is MXFP8 .* but the model was built unquantized "
                          r"\(config.quantization=None\); build it from the checkpoint's config",
                    TINY8.with_quantization(None))
    write_synthetic_checkpoint(TINY8.with_quantization(None), tmp_path, seed=1)
    fails_untouched(str(tmp_path), r"the checkpoint holds unquantized float32 weights \(config.json has no "
                                   r"quantization_config\) but the model is MXFP8.*with_quantization\(None\)")


def test_damaged_fp8_and_scale_bytes_name_key_and_file(ckpt_copy):
    wkey = P + "model.layers.2.self_attn.o_proj.weight"
    skey = P + "model.layers.3.block_sparse_moe.experts.1.w2.weight_scale_inv"

    def nan_weight(t):
        t[wkey].view(torch.uint8)[0, :3] = 0x7F  # e4m3's NaN code
    edit_shard(ckpt_copy, wkey, nan_weight)
    with pytest.raises(ValueError, match=rf"'{wkey}' in .*{shard_of(ckpt_copy, wkey)} holds 3 non-finite values"):
        load_checkpoint(poisoned(), ckpt_copy)
    edit_shard(ckpt_copy, wkey, lambda t: t[wkey].view(torch.uint8)[0, :3].fill_(0))

    def nan_scale(t):
        t[skey][0, 0] = 255  # E8M0's NaN
    edit_shard(ckpt_copy, skey, nan_scale)
    with pytest.raises(ValueError, match=rf"'{skey}' in .*{shard_of(ckpt_copy, skey)} holds 1 NaN scale bytes"):
        load_checkpoint(poisoned(), ckpt_copy)


def test_ignored_projection_is_refused_as_mixed_precision(ckpt_copy):
    path = os.path.join(ckpt_copy, "config.json")
    cfg = json.load(open(path))
    cfg["quantization_config"]["ignored_layers"].append("model.layers.2.self_attn.o_proj")
    json.dump(cfg, open(path, "w"))
    fails_untouched(ckpt_copy, r"o_proj.weight': quantization_config.ignored_layers lists "
                               r"'model.layers.2.self_attn.o_proj'.*mixed-precision checkpoints are unsupported")


def test_single_file_checkpoint(tmp_path):
    write_synthetic_checkpoint(TINY8, tmp_path, seed=2, shard_size_bytes=1 << 40)
    os.replace(glob.glob(str(tmp_path / "model-*.safetensors"))[0], tmp_path / "model.safetensors")
    os.remove(tmp_path / "model.safetensors.index.json")
    w = load_file(str(tmp_path / "model.safetensors"))
    m = poisoned()
    assert load_checkpoint(m, tmp_path).loaded == len(w) - 1  # the vision tensor is ignored
    assert torch.equal(bits(m.model.layers[3].block_sparse_moe.experts.w2[5]),
                       bits(w[P + "model.layers.3.block_sparse_moe.experts.5.w2.weight"]))


# ---- accuracy against the float64 reference -------------------------------------------------

def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY8.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def ref_weights(ckpt):
    return dequantized(text_tensors(ckpt))


@pytest.mark.parametrize("length", [9, 30])  # 30: past 12 tokens, the sparse layers drop blocks
def test_prefill_matches_the_float64_reference(ckpt, ref_weights, length):
    ids = prompt(length, seed=length)
    r = build_from_checkpoint(ckpt, dtype=torch.float32, **RUNNER)
    assert r.model.model.layers[1].block_sparse_moe.experts.w13.dtype == FP8
    r.add_request("s")
    got = r.step([TokenChunk("s", 0, ids)], all_logits=True).logits
    assert rel_err(got, reference_logits(TINY8, ref_weights, ids)) < 1e-4


def test_chunked_prefill_matches_the_float64_reference(ckpt, ref_weights):
    ids = prompt(29, seed=1)
    r = build_from_checkpoint(ckpt, dtype=torch.float32, **RUNNER)
    r.add_request("s")
    rows, start = [], 0
    for n in (7, 12, 3, 7):  # boundaries inside and at page edges (page = 4)
        rows.append(r.step([TokenChunk("s", start, ids[start:start + n])], all_logits=True).logits)
        start += n
    assert rel_err(torch.cat(rows), reference_logits(TINY8, ref_weights, ids)) < 1e-4


def test_padded_debug_eager_path_equals_eager(ckpt):
    """The bucketed (padded) path graphcap captures on a GPU, run eagerly: padded rows through
    the fp8 linears and experts change nothing."""
    padded = CaptureConfig(enabled=True, debug_eager=True, max_tokens=48, buckets=(4, 16, 48))
    out = []
    for capture in (None, padded):
        r = build_from_checkpoint(ckpt, dtype=torch.float32, **RUNNER, capture=capture)
        r.add_request("a")
        ids = prompt(15, 7)
        first = r.step([TokenChunk("a", 0, ids[:13])], all_logits=True).logits
        out.append(torch.cat([first, r.step([TokenChunk("a", 13, ids[13:])], all_logits=True).logits]))
    assert sum(b.padded_tokens for b in r.manager.stats.buckets.values()) > 0  # it really padded
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)


# ---- TP2: each rank's slices of weights and scales -------------------------------------------

def _tp_rank(group: ParallelGroup, ckpt: str) -> dict:
    full = build_from_checkpoint(ckpt, **RUNNER)
    tp = build_from_checkpoint(ckpt, **RUNNER, group=group)
    fp, p = dict(full.model.named_parameters()), dict(tp.model.named_parameters())
    fc, c, r, w = full.model.config, tp.model.config, group.rank, group.world_size
    checks: dict[str, bool] = {}

    def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        checks[name] = a.dtype == b.dtype and torch.equal(bits(a), bits(b))

    ql, kvl, D = fc.q_size // w, c.kv_size, fc.head_dim
    kv0 = r * fc.num_key_value_heads // w * D
    for i in (0, 1):
        a = f"model.layers.{i}.self_attn."
        for s, div in (("weight", 1), ("weight_scale_inv", 32)):
            q, qf = p[a + "qkv_proj." + s], fp[a + "qkv_proj." + s]
            same(f"L{i} q rows {s}", q[:ql], qf[r * ql:(r + 1) * ql])
            same(f"L{i} k rows {s}", q[ql:ql + kvl], qf[fc.q_size + kv0:fc.q_size + kv0 + kvl])
            same(f"L{i} o_proj columns {s}", p[a + "o_proj." + s],
                 fp[a + "o_proj." + s][:, r * ql // div:(r + 1) * ql // div])
    for mlp, inter in (("model.layers.0.mlp.", fc.dense_intermediate_size),
                       ("model.layers.1.block_sparse_moe.shared_experts.", fc.shared_width)):
        il = inter // w
        for s, div in (("weight", 1), ("weight_scale_inv", 32)):
            gu, guf = p[mlp + "gate_up_proj." + s], fp[mlp + "gate_up_proj." + s]
            same(f"{mlp} gate rows {s}", gu[:il], guf[r * il:(r + 1) * il])
            same(f"{mlp} up rows {s}", gu[il:], guf[inter + r * il:inter + (r + 1) * il])
            same(f"{mlp} down columns {s}", p[mlp + "down_proj." + s],
                 fp[mlp + "down_proj." + s][:, r * il // div:(r + 1) * il // div])
    m, el = "model.layers.1.block_sparse_moe.experts.", fc.num_local_experts // w
    for s in ("w13", "w13_scale_inv", "w2", "w2_scale_inv"):
        same(f"experts {s}", p[m + s], fp[m + s][r * el:(r + 1) * el])
    scale_cols = p["model.layers.1.self_attn.o_proj.weight_scale_inv"].shape[1]
    ids = prompt(21, 5)
    out = []
    for runner in (full, tp):
        runner.add_request("a")
        first = runner.step([TokenChunk("a", 0, ids[:17])], all_logits=True).logits
        out.append(torch.cat([first, runner.step([TokenChunk("a", 17, ids[17:])], all_logits=True).logits]))
    return dict(checks=checks, scale_cols=scale_cols, rel_err=rel_err(out[1], out[0].double()))


def test_tp2_slices_scales_with_their_weights(ckpt):
    for rank, r in enumerate(run_ranks(_tp_rank, 2, ckpt)):
        bad = [k for k, ok in r["checks"].items() if not ok]
        assert not bad and len(r["checks"]) == 28, (rank, bad)
        assert r["scale_cols"] == TINY8.q_size // 2 // 32  # o_proj's half of the input columns, in 32-blocks
        assert r["rel_err"] < 1e-5, (rank, r["rel_err"])
