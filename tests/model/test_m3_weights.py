"""Loader round trip through the synthetic checkpoint, and every loader error path."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.minimax_m3.checkpoint_writer import write_synthetic_checkpoint
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.model import MiniMaxM3ForCausalLM
from models.minimax_m3.weights import checkpoint_layout, load_checkpoint

P = "language_model."
POISON = 12345.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m3_tiny")
    write_synthetic_checkpoint(MiniMaxM3Config.tiny(), folder, seed=3, shard_size_bytes=150_000)
    return str(folder)


def read_all(folder: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


def poisoned_model(config: MiniMaxM3Config, dtype=torch.float32) -> MiniMaxM3ForCausalLM:
    m = MiniMaxM3ForCausalLM(config, dtype=dtype)
    for p in m.parameters():
        p.data.fill_(POISON)
    return m


def edit_shard(folder: str, key: str, fn) -> None:
    """Rewrite the shard holding ``key`` with ``fn(tensors)`` applied; keep the index in sync."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path))
    name = index["weight_map"][key]
    tensors = load_file(os.path.join(folder, name))
    fn(tensors)
    save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k != key or key in tensors}
    for k in tensors:
        index["weight_map"].setdefault(k, name)
    json.dump(index, open(index_path, "w"))


def test_checkpoint_is_sharded_in_vl_layout(ckpt):
    shards = glob.glob(os.path.join(ckpt, "model-*-of-*.safetensors"))
    assert len(shards) > 2
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    assert "text_config" in cfg and cfg["model_type"] == "minimax_m3_vl"
    w = read_all(ckpt)
    assert w[P + "model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32
    assert w[P + "model.layers.1.block_sparse_moe.e_score_correction_bias"].dtype == torch.float32
    assert P + "model.layers.1.block_sparse_moe.experts.7.w3.weight" in w
    assert P + "model.layers.1.self_attn.index_k_proj.weight" in w
    assert P + "model.layers.0.self_attn.index_q_proj.weight" not in w  # dense layer: no index branch
    assert P + "model.layers.0.mlp.gate_proj.weight" in w
    assert any(k.startswith("vision_tower.") for k in w)
    norm = w[P + "model.layers.2.input_layernorm.weight"]
    assert norm.abs().max() < 1.0 and norm.abs().max() > 0  # Gemma offsets near zero


def test_round_trip_exact(ckpt):
    c = MiniMaxM3Config.tiny()
    m = poisoned_model(c)
    rep = load_checkpoint(m, ckpt)
    w = {k[len(P):]: v for k, v in read_all(ckpt).items() if k.startswith(P)}
    assert rep.loaded == len(w) == len(checkpoint_layout(c)) and rep.ignored_vision == 1
    for p in m.parameters():
        assert not (p == POISON).any()  # every element of every parameter was written
    sd = m.state_dict()
    a = "model.layers.2.self_attn."
    fused = torch.cat([w[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")])
    assert torch.equal(sd[a + "qkv_proj.weight"], fused)
    a0 = "model.layers.0.self_attn."
    assert torch.equal(sd[a0 + "qkv_proj.weight"],
                       torch.cat([w[a0 + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")]))
    e = "model.layers.3.block_sparse_moe."
    for i in range(c.num_local_experts):
        assert torch.equal(sd[e + "experts.w13"][i],
                           torch.cat([w[f"{e}experts.{i}.w1.weight"], w[f"{e}experts.{i}.w3.weight"]]))
        assert torch.equal(sd[e + "experts.w2"][i], w[f"{e}experts.{i}.w2.weight"])
    assert torch.equal(sd[e + "shared_experts.gate_up_proj.weight"],
                       torch.cat([w[e + "shared_experts.gate_proj.weight"], w[e + "shared_experts.up_proj.weight"]]))
    assert torch.equal(sd[e + "gate.weight"], w[e + "gate.weight"])
    assert torch.equal(sd[e + "e_score_correction_bias"], w[e + "e_score_correction_bias"])
    assert torch.equal(sd["model.layers.0.mlp.gate_up_proj.weight"],
                       torch.cat([w["model.layers.0.mlp.gate_proj.weight"], w["model.layers.0.mlp.up_proj.weight"]]))
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", a + "index_k_norm.weight",
              a + "o_proj.weight"):
        assert torch.equal(sd[k], w[k])


def test_load_keeps_parameter_addresses(ckpt):
    m = poisoned_model(MiniMaxM3Config.tiny())
    before = {n: p.data_ptr() for n, p in m.named_parameters()}
    load_checkpoint(m, ckpt)
    assert before == {n: p.data_ptr() for n, p in m.named_parameters()}


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_bf16_checkpoint(tmp_path, model_dtype):
    c = dataclasses.replace(MiniMaxM3Config.tiny(), dtype="bfloat16")
    write_synthetic_checkpoint(c, tmp_path, seed=1, shard_size_bytes=1 << 20)
    w = read_all(str(tmp_path))
    assert w[P + "lm_head.weight"].dtype == torch.bfloat16
    m = poisoned_model(c, model_dtype)
    load_checkpoint(m, tmp_path)
    assert torch.equal(m.lm_head.weight, w[P + "lm_head.weight"].to(model_dtype))
    g = m.model.layers[1].block_sparse_moe.gate.weight
    assert g.dtype == torch.float32 and torch.equal(g, w[P + "model.layers.1.block_sparse_moe.gate.weight"])


def test_text_layout_and_single_file(tmp_path):
    c = MiniMaxM3Config.tiny()
    write_synthetic_checkpoint(c, tmp_path, seed=2, shard_size_bytes=1 << 40, text_only=True)
    assert "text_config" not in json.load(open(tmp_path / "config.json"))
    shards = glob.glob(str(tmp_path / "model-*.safetensors"))
    assert len(shards) == 1
    os.replace(shards[0], tmp_path / "model.safetensors")
    os.remove(tmp_path / "model.safetensors.index.json")
    m = poisoned_model(c)
    rep = load_checkpoint(m, tmp_path)
    w = load_file(str(tmp_path / "model.safetensors"))
    assert rep.loaded == len(w) and torch.equal(m.model.embed_tokens.weight, w["model.embed_tokens.weight"])


def test_vision_and_mtp_ignored(ckpt_copy):
    key = P + "model.layers.0.input_layernorm.weight"
    edit_shard(ckpt_copy, key, lambda t: t.update({
        P + "model.mtp.layers.0.enorm.weight": torch.zeros(64),
        "multi_modal_projector.linear_1.weight": torch.zeros(4, 4),
        "patch_merge_mlp.fc.weight": torch.zeros(4, 4),
    }))
    rep = load_checkpoint(poisoned_model(MiniMaxM3Config.tiny()), ckpt_copy)
    assert (rep.ignored_mtp, rep.ignored_vision) == (1, 3)


def _assert_fails_untouched(folder: str, match: str, config: MiniMaxM3Config | None = None):
    m = poisoned_model(config or MiniMaxM3Config.tiny())
    with pytest.raises(ValueError, match=match):
        load_checkpoint(m, folder)
    for p in m.parameters():
        assert (p == POISON).all()  # validation runs before any copy


def test_missing_key(ckpt_copy):
    key = P + "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    edit_shard(ckpt_copy, key, lambda t: t.pop(key))
    _assert_fails_untouched(ckpt_copy, r"missing key.*experts\.5\.w3\.weight")


def test_unexpected_key(ckpt_copy):
    key = P + "model.layers.1.self_attn.q_proj.weight"
    extra = P + "model.layers.1.self_attn.index_v_proj.weight"
    edit_shard(ckpt_copy, key, lambda t: t.update({extra: torch.zeros(4, 64)}))
    _assert_fails_untouched(ckpt_copy, r"unexpected key .*index_v_proj")


def test_text_key_without_prefix_is_unexpected(ckpt_copy):
    key = P + "model.norm.weight"
    edit_shard(ckpt_copy, key, lambda t: t.update({"model.norm.weight": t.pop(key)}))
    _assert_fails_untouched(ckpt_copy, r"unexpected key 'model\.norm\.weight'.*prefix")


def test_wrong_shape(ckpt_copy):
    key = P + "model.layers.3.self_attn.index_q_proj.weight"
    edit_shard(ckpt_copy, key, lambda t: t.update({key: torch.zeros(64, 64)}))
    _assert_fails_untouched(ckpt_copy, r"index_q_proj\.weight' has shape \(64, 64\), expected \(128, 64\)")


def test_wrong_dtype(ckpt_copy):
    key = P + "model.layers.1.block_sparse_moe.gate.weight"
    edit_shard(ckpt_copy, key, lambda t: t.update({key: t[key].bfloat16()}))
    _assert_fails_untouched(ckpt_copy, r"gate\.weight' has dtype BF16, expected F32")
    key2 = P + "model.layers.1.self_attn.o_proj.weight"
    edit_shard(ckpt_copy, key, lambda t: t.update({key: t[key].float()}))
    edit_shard(ckpt_copy, key2, lambda t: t.update({key2: t[key2].half()}))
    _assert_fails_untouched(ckpt_copy, r"o_proj\.weight' has dtype F16, expected F32")


def test_duplicate_key_across_shards(ckpt_copy):
    index = json.load(open(os.path.join(ckpt_copy, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    key = next(k for k, v in index["weight_map"].items() if v == files[0])
    dup = load_file(os.path.join(ckpt_copy, files[0]))[key]
    path = os.path.join(ckpt_copy, files[1])
    t = load_file(path)
    t[key] = dup
    save_file(t, path)
    _assert_fails_untouched(ckpt_copy, r"appears in both")


def test_config_mismatch(ckpt):
    other = dataclasses.replace(MiniMaxM3Config.tiny(), sparse_topk_blocks=2)
    _assert_fails_untouched(ckpt, r"sparse_topk_blocks", other)


def test_missing_shard_and_folder(ckpt_copy, tmp_path):
    os.remove(glob.glob(os.path.join(ckpt_copy, "model-00002-*.safetensors"))[0])
    _assert_fails_untouched(ckpt_copy, r"shard .* missing")
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(poisoned_model(MiniMaxM3Config.tiny()), tmp_path)


def test_truncated_layers(ckpt):
    c = MiniMaxM3Config.tiny().first_layers(2)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_checkpoint(poisoned_model(c), ckpt)
    m = poisoned_model(c)
    rep = load_checkpoint(m, ckpt, truncate_layers=True)
    assert rep.ignored_layers > 0
    w = read_all(ckpt)
    assert torch.equal(m.model.layers[1].self_attn.o_proj.weight, w[P + "model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(m.lm_head.weight, w[P + "lm_head.weight"])


def test_sharded_config_has_no_checkpoint_layout():
    with pytest.raises(ValueError, match="sharded"):
        checkpoint_layout(MiniMaxM3Config.tiny().shard(2, 2))


# ---- damaged files: errors name the file or the key -----------------------------------------


def test_corrupted_payload_with_intact_header_is_refused_naming_the_key(ckpt_copy):
    key = P + "model.layers.2.self_attn.o_proj.weight"
    index = json.load(open(os.path.join(ckpt_copy, "model.safetensors.index.json")))
    path = os.path.join(ckpt_copy, index["weight_map"][key])
    data = bytearray(open(path, "rb").read())
    header = 8 + int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:header])[key]
    start = header + meta["data_offsets"][0]
    data[start : start + 8] = b"\xff" * 8  # two fp32 NaNs in the payload; the header still parses
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"o_proj\.weight' in .* holds 2 non-finite values"):
        load_checkpoint(poisoned_model(MiniMaxM3Config.tiny()), ckpt_copy)


def test_truncated_shard_names_the_file(ckpt_copy):
    path = sorted(glob.glob(os.path.join(ckpt_copy, "model-*.safetensors")))[1]
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"shard '{path}' could not be read .*truncated"):
        load_checkpoint(poisoned_model(MiniMaxM3Config.tiny()), ckpt_copy)


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "config.json"])
def test_invalid_json_names_the_file(ckpt_copy, name):
    with open(os.path.join(ckpt_copy, name), "w") as f:
        f.write('{"weight_map": {')
    with pytest.raises(ValueError, match=rf"{name} is not valid JSON"):
        load_checkpoint(poisoned_model(MiniMaxM3Config.tiny()), ckpt_copy)


def test_many_mismatched_keys_are_capped(ckpt_copy):
    key = P + "model.norm.weight"
    extra = {P + f"model.layers.0.bogus_{i}.weight": torch.zeros(2) for i in range(40)}
    edit_shard(ckpt_copy, key, lambda t: t.update(extra))
    m = poisoned_model(MiniMaxM3Config.tiny())
    with pytest.raises(ValueError) as e:
        load_checkpoint(m, ckpt_copy)
    msg = str(e.value)
    assert "40 problem(s)" in msg and "... and 32 more unexpected keys" in msg
    assert len(msg.splitlines()) <= 12, msg
