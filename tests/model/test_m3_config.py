"""MiniMaxM3Config: the real HF config parses to spec §1, bad configs raise naming the field,
presets and the TP/EP division."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.model import MiniMaxM3ForCausalLM

FREQ = [0, 0, 0] + [1] * 57


def real_text_config() -> dict:
    """``text_config`` of MiniMaxAI/MiniMax-M3 as spec §1 lists it."""
    return {
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "model_type": "minimax_m3",
        "hidden_size": 6144,
        "num_hidden_layers": 60,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 200064,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-6,
        "use_gemma_norm": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "attention_output_gate": False,
        "rope_theta": 5000000,
        "rotary_dim": 64,
        "partial_rotary_factor": 0.5,
        "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "dense_intermediate_size": 12288,
        "intermediate_size": 3072,
        "shared_intermediate_size": 3072,
        "n_shared_experts": 1,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": 2.0,
        "moe_layer_freq": list(FREQ),
        "tie_word_embeddings": False,
        "num_mtp_modules": 7,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16",
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_attention_freq": list(FREQ),
            "sparse_num_index_heads": 4,
            "sparse_index_dim": 128,
            "sparse_block_size": 128,
            "sparse_topk_blocks": 16,
            "sparse_score_type": "max",
            "sparse_init_block": 0,
            "sparse_local_block": 1,
            "sparse_disable_index_value": list(FREQ),
        },
    }


def real_vl_config() -> dict:
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "image_token_id": 200025,
        "video_token_id": 200026,
        "text_config": real_text_config(),
        "vision_config": {"hidden_size": 1280, "depth": 32},
    }


EXPECTED = dict(
    hidden_size=6144, num_hidden_layers=60, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
    vocab_size=200064, max_position_embeddings=1048576, rms_norm_eps=1e-6, rope_theta=5e6, rotary_dim=64,
    dense_intermediate_size=12288, intermediate_size=3072, shared_intermediate_size=3072, n_shared_experts=1,
    num_local_experts=128, num_experts_per_tok=4, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0,
    moe_layer_freq=tuple(FREQ), sparse_attention_freq=tuple(FREQ), sparse_num_index_heads=4, sparse_index_dim=128,
    sparse_block_size=128, sparse_topk_blocks=16, sparse_init_block=0, sparse_local_block=1,
    tie_word_embeddings=False, dtype="bfloat16", tp_size=1, ep_size=1,
)


@pytest.mark.parametrize("layout", ["vl", "text", "vl_file", "text_folder"])
def test_real_config_parses(layout, tmp_path):
    raw = real_vl_config() if layout.startswith("vl") else real_text_config()
    if layout == "vl_file":
        (tmp_path / "x.json").write_text(json.dumps(raw))
        src = tmp_path / "x.json"
    elif layout == "text_folder":
        (tmp_path / "config.json").write_text(json.dumps(raw))
        src = tmp_path
    else:
        src = raw
    c = MiniMaxM3Config.from_hf(src)
    for k, v in EXPECTED.items():
        assert getattr(c, k) == v, k
    assert c == MiniMaxM3Config.real()
    assert c.sparse_layers == tuple(range(3, 60)) and c.moe_layers == tuple(range(3, 60))
    assert c.qkv_size(0) == 8192 + 2 * 512 and c.qkv_size(3) == 8192 + 2 * 512 + 512 + 128
    assert c.sparse_ordinal(3) == 0 and c.sparse_ordinal(59) == 56
    assert c.page_size == 128 and c.torch_dtype == torch.bfloat16


def test_flat_sparse_fields_and_factor_only():
    t = real_text_config()
    sparse = t.pop("sparse_attention_config")
    t.update(sparse)
    del t["rotary_dim"]
    c = MiniMaxM3Config.from_hf(t)
    assert c == MiniMaxM3Config.real()


def test_sparse_attention_off_means_all_dense():
    t = real_text_config()
    t["sparse_attention_config"]["use_sparse_attention"] = False
    c = MiniMaxM3Config.from_hf(t)
    assert c.sparse_layers == () and c.moe_layers == tuple(range(3, 60))


def _set(path: str, value):
    def mutate(t: dict) -> None:
        d = t
        keys = path.split("/")
        for k in keys[:-1]:
            d = d[k]
        if value is _DELETE:
            del d[keys[-1]]
        else:
            d[keys[-1]] = value
    return mutate


_DELETE = object()
S = "sparse_attention_config/"
BAD = [
    (S + "sparse_num_index_heads", 2, "sparse_num_index_heads"),
    (S + "sparse_score_type", "softmax", "sparse_score_type"),
    (S + "sparse_init_block", 1, "sparse_init_block"),
    (S + "sparse_local_block", 0, "sparse_local_block"),
    (S + "sparse_attention_freq", [1] * 59, "sparse_attention_freq"),
    (S + "sparse_disable_index_value", [0] * 60, "sparse_disable_index_value"),
    (S + "sparse_topk_blocks", _DELETE, "sparse_topk_blocks"),
    ("hidden_act", "silu", "hidden_act"),
    ("use_gemma_norm", False, "use_gemma_norm"),
    ("use_qk_norm", False, "use_qk_norm"),
    ("qk_norm_type", "per_layer", "qk_norm_type"),
    ("attention_output_gate", True, "attention_output_gate"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
    ("sliding_window", 4096, "sliding_window"),
    ("quantization_config", {"quant_method": "gptq"}, "quantization_config"),  # MXFP8: test_mxfp8.py
    ("moe_layer_freq", [0, 0, 0] + [1] * 56, "moe_layer_freq"),
    ("moe_layer_freq", 1, "moe_layer_freq"),
    ("num_attention_heads", 62, "num_attention_heads"),
    ("rotary_dim", 48, "rotary_dim"),
    ("scoring_func", "softmax", "scoring_func"),
    ("use_routing_bias", False, "use_routing_bias"),
    ("n_group", 8, "n_group"),
    ("num_experts_per_tok", 200, "num_experts_per_tok"),
    ("hidden_size", _DELETE, "hidden_size"),
    ("architectures", ["LlamaForCausalLM"], "architectures"),
    ("torch_dtype", "float8_e4m3fn", "dtype"),
    ("swiglu_beta", 2.0, "swiglu_beta"),
]


@pytest.mark.parametrize("path,value,field", BAD, ids=[f"{b[0].split('/')[-1]}={b[1]!r}"[:40] for b in BAD])
@pytest.mark.parametrize("layout", ["vl", "text"])
def test_bad_field_raises_naming_it(path, value, field, layout):
    vl = real_vl_config()
    _set(path, value)(vl["text_config"])
    raw = vl if layout == "vl" else vl["text_config"]
    with pytest.raises(ValueError, match=field):
        MiniMaxM3Config.from_hf(raw)


def test_rotary_dim_above_head_dim_raises():
    t = real_text_config()
    del t["partial_rotary_factor"]
    t["rotary_dim"] = 256
    with pytest.raises(ValueError, match="rotary_dim"):
        MiniMaxM3Config.from_hf(t)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        MiniMaxM3Config(num_key_value_heads=3, sparse_num_index_heads=3)
    with pytest.raises(ValueError, match="ep_size"):
        MiniMaxM3Config(ep_size=3)


def test_page_size_must_equal_sparse_block():
    c = MiniMaxM3Config.tiny()
    with pytest.raises(ValueError, match="page_size"):
        c.kv_cache_config(num_pages=4, max_seqs=1, max_pages_per_seq=4, page_size=8)
    kv = c.kv_cache_config(num_pages=4, max_seqs=1, max_pages_per_seq=4, page_size=4)
    assert (kv.page_size, kv.num_kv_heads, kv.head_dim, kv.index_dim) == (4, 2, 32, 64)
    assert kv.sparse_layers == (1, 2, 3) and kv.num_layers == 4 and kv.dtype == torch.float32


@pytest.mark.parametrize("preset", ["tiny", "real", "slice"])
def test_hf_round_trip(preset):
    c = MiniMaxM3Config.preset(preset)
    assert MiniMaxM3Config.from_hf(copy.deepcopy(c.to_hf_text())) == c


def test_tiny_preset_is_sparse_only_past_topk_blocks():
    c = MiniMaxM3Config.tiny()
    assert c.sparse_attention_freq == (0, 1, 1, 1) and c.moe_layer_freq == (0, 1, 1, 1)
    # positions < topk * block see all their blocks: sparse == dense up to 12 tokens
    assert c.sparse_topk_blocks * c.sparse_block_size == 12
    assert c.num_attention_heads % c.num_key_value_heads == 0 and c.rotary_dim < c.head_dim


def test_slice_preset():
    c = MiniMaxM3Config.slice(7)
    assert c.num_hidden_layers == 7 and c.sparse_layers == (3, 4, 5, 6) and c.hidden_size == 6144
    with pytest.raises(ValueError, match="num_layers"):
        MiniMaxM3Config.slice(61)


def test_rank_of_8_division():
    c = MiniMaxM3Config.rank_of_8()
    assert (c.tp_size, c.ep_size, c.num_hidden_layers, c.hidden_size) == (8, 8, 60, 6144)
    assert (c.num_attention_heads, c.num_key_value_heads, c.sparse_num_index_heads) == (8, 1, 1)
    assert (c.num_local_experts, c.num_experts_per_rank, c.num_experts_per_tok) == (128, 16, 4)
    assert (c.dense_intermediate_size, c.shared_intermediate_size, c.intermediate_size) == (1536, 384, 3072)
    assert c.vocab_size == 25008 and c.head_dim == 128 and c.sparse_index_dim == 128
    # TP4: one kv head per rank, no replication
    c4 = MiniMaxM3Config.real().shard(4, 8)
    assert (c4.num_attention_heads, c4.num_key_value_heads) == (16, 1)
    with pytest.raises(ValueError, match="vocab_size|num_attention_heads"):
        MiniMaxM3Config.real().shard(3, 1)
    with pytest.raises(ValueError, match="unsharded"):
        c.shard(2, 2)
    with pytest.raises(ValueError, match="whole model"):
        c.to_hf_text()


def test_rank_of_8_parameter_shapes():
    c = MiniMaxM3Config.rank_of_8()
    m = MiniMaxM3ForCausalLM(c, device="meta")
    p = dict(m.named_parameters())
    assert p["model.layers.3.self_attn.qkv_proj.weight"].shape == (8 * 128 + 2 * 128 + 128 + 128, 6144)
    assert p["model.layers.0.self_attn.qkv_proj.weight"].shape == (8 * 128 + 2 * 128, 6144)
    assert p["model.layers.3.self_attn.o_proj.weight"].shape == (6144, 1024)
    assert p["model.layers.3.block_sparse_moe.gate.weight"].shape == (128, 6144)
    assert p["model.layers.3.block_sparse_moe.gate.weight"].dtype == torch.float32
    assert p["model.layers.3.block_sparse_moe.experts.w13"].shape == (16, 6144, 6144)
    assert p["model.layers.3.block_sparse_moe.experts.w2"].shape == (16, 6144, 3072)
    assert p["model.layers.3.block_sparse_moe.shared_experts.gate_up_proj.weight"].shape == (768, 6144)
    assert p["model.layers.0.mlp.gate_up_proj.weight"].shape == (3072, 6144)
    assert p["lm_head.weight"].shape == (25008, 6144)
    assert len(m.model.layers) == 60


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset"):
        MiniMaxM3Config.preset("huge")
    assert MiniMaxM3Config.preset("rank-of-8") == MiniMaxM3Config.rank_of_8()
