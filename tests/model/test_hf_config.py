"""hf_config.translate_hf refuses mistyped and out-of-range config.json fields with a ValueError
that names the field and what it got, instead of a bare TypeError, a message about another
field, or a silently truncated value.

Every input is the tiny preset's own HF dict (``to_hf_text``) with one field changed, so each
test fails only for the reason it names.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import fields
from typing import Any

import pytest

from models.minimax_m3.config import MiniMaxM3Config

TINY = MiniMaxM3Config.tiny()


def tiny_hf(**changes: Any) -> dict:
    """The tiny preset's text config with ``changes`` applied where the key lives (the
    ``sparse_attention_config`` block for the keys it holds, else the top level)."""
    t = copy.deepcopy(TINY.to_hf_text())
    sparse = t["sparse_attention_config"]
    for key, value in changes.items():
        (sparse if key in sparse else t)[key] = value
    return t


def refuses(match: str, **changes: Any) -> None:
    """``from_hf`` on the changed tiny config raises ValueError matching the literal ``match``."""
    with pytest.raises(ValueError, match=re.escape(match)):
        MiniMaxM3Config.from_hf(tiny_hf(**changes))


# ----- 1. field types --------------------------------------------------------------------
@pytest.mark.parametrize("key,value,message", [
    ("rms_norm_eps", None, "config.json field 'rms_norm_eps' must be a number, got None (null)"),
    ("routed_scaling_factor", [2.0], "config.json field 'routed_scaling_factor' must be a number, got [2.0] (a list)"),
    ("rope_theta", "abc", "config.json field 'rope_theta' must be a number, got 'abc' (a str)"),
    ("swiglu_alpha", True, "config.json field 'swiglu_alpha' must be a number, got True (a bool)"),
    ("head_dim", "16", "config.json field 'head_dim' must be an integer, got '16' (a str)"),
    ("moe_layer_freq", ["a", 1, 1, 1],
     "config.json field 'moe_layer_freq' must hold 0 or 1 for each layer, got 'a' at layer 0"),
])
def test_mistyped_field_is_named(key, value, message):
    refuses(message, **{key: value})


INT_FIELDS = [f.name for f in fields(MiniMaxM3Config) if f.type == "int" and f.name not in ("tp_size", "ep_size")]


def test_int_fields_cover_the_sizes():
    # Guards the parametrisation below: if the annotation test stopped matching, the
    # type-check test would run on nothing and pass.
    assert {"hidden_size", "num_hidden_layers", "head_dim", "vocab_size", "rotary_dim", "sparse_block_size",
            "sparse_topk_blocks", "sparse_index_dim", "num_local_experts", "dense_intermediate_size"} <= set(INT_FIELDS)


@pytest.mark.parametrize("key", INT_FIELDS)
@pytest.mark.parametrize("value", ["16", 16.0, True], ids=["str", "float", "bool"])
def test_every_int_field_is_type_checked(key, value):
    refuses(f"config.json field {key!r} must be an integer, got {value!r} (a {type(value).__name__})", **{key: value})


@pytest.mark.parametrize("key,value,message", [
    ("tie_word_embeddings", 0, "config.json field 'tie_word_embeddings' must be true or false, got 0 (an int)"),
    ("use_sparse_attention", "false",
     "config.json field 'use_sparse_attention' must be true or false, got 'false' (a str)"),
    ("torch_dtype", None, "config.json field 'torch_dtype' must be a dtype name such as \"bfloat16\", got None (null)"),
])
def test_bool_and_dtype_fields_are_type_checked(key, value, message):
    refuses(message, **{key: value})


# ----- 2. the error names the field that is wrong ---------------------------------------
def test_string_layer_count_is_named_not_the_lists():
    refuses("config.json field 'num_hidden_layers' must be an integer, got '4' (a str)", num_hidden_layers="4")


def test_zero_layer_count_is_named_not_the_lists():
    refuses("config.json field 'num_hidden_layers' must be >= 1, got 0", num_hidden_layers=0)


def test_architectures_string_is_refused_not_iterated():
    refuses("config.json field 'architectures' must be a list of strings, got 'MiniMaxM3SparseForCausalLM' (a str)",
            architectures="MiniMaxM3SparseForCausalLM")
    refuses("config.json field 'architectures' must be a list of strings, got ['MiniMaxM3', 3] (a list)",
            architectures=["MiniMaxM3", 3])


# ----- 3. bad values are refused ---------------------------------------------------------
@pytest.mark.parametrize("key,value,message", [
    ("rope_theta", -5.0, "config.json field 'rope_theta' must be > 0 (the RoPE base), got -5.0"),
    ("rope_theta", 0.0, "config.json field 'rope_theta' must be > 0 (the RoPE base), got 0.0"),
    ("rope_theta", float("nan"), "config.json field 'rope_theta' must be a finite number, got nan"),
    ("rope_theta", float("inf"), "config.json field 'rope_theta' must be a finite number, got inf"),
    ("rms_norm_eps", 0, "config.json field 'rms_norm_eps' must be > 0 (the RMSNorm epsilon), got 0"),
    ("routed_scaling_factor", -2.0, "config.json field 'routed_scaling_factor' must be > 0"),
    ("swiglu_limit", 0.0, "config.json field 'swiglu_limit' must be > 0 (the SwiGLU clamp bound), got 0.0"),
    ("swiglu_alpha", float("-inf"), "config.json field 'swiglu_alpha' must be a finite number, got -inf"),
    ("moe_layer_freq", [0.9, 1.2, 1, 1],
     "config.json field 'moe_layer_freq' must hold 0 or 1 for each layer, got 0.9 at layer 0, 1.2 at layer 1"),
    ("sparse_attention_freq", [0, 2, 1, 1],
     "config.json field 'sparse_attention_freq' must hold 0 or 1 for each layer, got 2 at layer 1"),
    ("sparse_disable_index_value", [0, 1, 1.0, 1],
     "config.json field 'sparse_disable_index_value' must hold 0 or 1 for each layer, got 1.0 at layer 2"),
    ("partial_rotary_factor", 2.0, "config.json field 'partial_rotary_factor' must be in (0, 1]"),
])
def test_bad_value_is_refused(key, value, message):
    changes = {key: value}
    if key == "partial_rotary_factor":
        changes["rotary_dim"] = None  # the factor alone decides the width
    refuses(message, **changes)


def test_nan_from_json_text_is_refused():
    # json.load turns a bare NaN into float('nan'); the refusal must come from the reader, not
    # from a later "checkpoint nan, model nan" config comparison.
    raw = json.loads(json.dumps(tiny_hf()).replace('"rope_theta": 10000.0', '"rope_theta": NaN'))
    assert raw["rope_theta"] != raw["rope_theta"]
    with pytest.raises(ValueError, match=re.escape("config.json field 'rope_theta' must be a finite number")):
        MiniMaxM3Config.from_hf(raw)


def test_inexact_rotary_factor_is_refused():
    # 0.3 * head_dim 32 = 9.6 dims: rounding would rotate a width the checkpoint never had.
    refuses("partial_rotary_factor=0.3 * head_dim=32 = 9.6 is not a whole number of dims",
            partial_rotary_factor=0.3, rotary_dim=None)


@pytest.mark.parametrize("key,value", [
    ("rope_theta", 0.0), ("rope_theta", float("nan")), ("rms_norm_eps", -1e-6),
    ("routed_scaling_factor", 0), ("swiglu_limit", "7"), ("swiglu_alpha", float("nan")),
])
def test_direct_construction_refuses_bad_floats(key, value):
    with pytest.raises(ValueError, match=rf"^{key} must be a finite number"):
        dataclasses.replace(TINY, **{key: value})


# ----- valid configs still load ----------------------------------------------------------
def test_tiny_round_trips_through_json():
    assert MiniMaxM3Config.from_hf(json.loads(json.dumps(TINY.to_hf_text()))) == TINY


def test_bool_layer_flags_read_as_ints():
    # Documented choice: JSON true/false in a per-layer flag list means 1/0.
    c = MiniMaxM3Config.from_hf(tiny_hf(moe_layer_freq=[False, True, True, True]))
    assert c.moe_layer_freq == (0, 1, 1, 1) and all(type(x) is int for x in c.moe_layer_freq)
    assert c == TINY


def test_integer_rope_theta_reads_as_float():
    c = MiniMaxM3Config.from_hf(tiny_hf(rope_theta=10000))
    assert c.rope_theta == 10000.0 and isinstance(c.rope_theta, float)
