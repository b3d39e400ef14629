"""Reading Hugging Face ``config.json`` files for MiniMax-M3 (the VL wrapper or a text config).

Every unsupported or inconsistent value raises ``ValueError`` naming the field; the result is
the keyword arguments of ``MiniMaxM3Config``, which validates the rest.
"""

from __future__ import annotations

import json
import os
from dataclasses import Field
from typing import Any, Mapping, Sequence


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()
_REQUIRED_KEYS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "intermediate_size", "dense_intermediate_size", "num_local_experts",
    "num_experts_per_tok", "moe_layer_freq", "sparse_num_index_heads", "sparse_index_dim",
    "sparse_block_size", "sparse_topk_blocks", "rope_theta",
})


def read_config_json(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A parsed ``config.json``: from a folder, the file, or an already parsed dict."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no config.json at {path!r}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or replace the checkpoint's config.json") from None


# Flags whose only supported value is M3's; absent means M3's value.
_FIXED = {
    "hidden_act": "swigluoai",
    "use_gemma_norm": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_head",
    "attention_output_gate": False,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "sparse_score_type": "max",
}
# Present-and-set means a feature this implementation does not have.
_ABSENT = ("rope_scaling", "quantization_config", "sliding_window")


def translate_hf(raw: Mapping[str, Any], config_fields: Sequence[Field], skip: frozenset[str]) -> dict[str, Any]:
    """HF config dict (VL wrapper or text) -> ``MiniMaxM3Config`` kwargs.

    ``config_fields`` are the config's dataclass fields; ``skip`` the ones HF does not carry.

    MTP fields (``num_mtp_modules``, ``num_nextn_predict_layers``) are ignored: MTP is an
    optional external draft module, not part of the backbone. Vision fields are ignored.
    """
    text = raw.get("text_config", raw)
    if not isinstance(text, Mapping):
        raise ValueError(f"text_config must be a dict, got {type(text).__name__}")
    archs = text.get("architectures")
    if archs and not any("MiniMaxM3" in a for a in archs):
        raise ValueError(f"architectures={archs!r} is not a MiniMax-M3 text model")
    sparse_cfg = text.get("sparse_attention_config") or {}
    if not isinstance(sparse_cfg, Mapping):
        raise ValueError("sparse_attention_config must be a dict")

    def get(key: str, default: Any = _REQUIRED) -> Any:
        for src in (sparse_cfg, text):
            if key in src:
                return src[key]
        if default is _REQUIRED:
            raise ValueError(f"config field {key!r} is missing")
        return default

    for key, want in _FIXED.items():
        got = get(key, want)
        if got != want:
            raise ValueError(f"{key}={got!r} is unsupported; MiniMax-M3 needs {key}={want!r}")
    for key in _ABSENT:
        if text.get(key) is not None:
            raise ValueError(f"{key}={text[key]!r} is unsupported; this implementation has no {key}")
    for key in ("n_group", "topk_group"):
        if get(key, 1) not in (None, 0, 1):
            raise ValueError(f"{key}={get(key)!r}: group-limited routing is unsupported")
    if get("norm_topk_prob", True) is not True:
        raise ValueError("norm_topk_prob=False is unsupported; M3 renormalises the top-k weights")
    if get("swiglu_beta", 1.0) != 1.0:
        raise ValueError(f"swiglu_beta={get('swiglu_beta')!r} is unsupported; M3 adds a fixed 1 to up")

    out: dict[str, Any] = {}
    for f in config_fields:
        if f.name in skip or f.name in ("rotary_dim", "dtype", "sparse_attention_freq"):
            continue
        default = _REQUIRED if f.name in _REQUIRED_KEYS else f.default
        out[f.name] = get(f.name, default)

    head_dim = out["head_dim"]
    rotary = get("rotary_dim", None)
    factor = get("partial_rotary_factor", None)
    if rotary is None and factor is None:
        raise ValueError("config needs rotary_dim or partial_rotary_factor")
    if factor is not None and rotary is not None and rotary != int(round(head_dim * factor)):
        raise ValueError(
            f"rotary_dim={rotary} disagrees with partial_rotary_factor={factor} * head_dim={head_dim}"
        )
    out["rotary_dim"] = rotary if rotary is not None else int(round(head_dim * factor))

    n = out["num_hidden_layers"]
    if get("use_sparse_attention", True):
        out["sparse_attention_freq"] = get("sparse_attention_freq")
    else:
        out["sparse_attention_freq"] = [0] * n
    for key in ("moe_layer_freq", "sparse_attention_freq"):
        v = out[key]
        if not isinstance(v, (list, tuple)) or len(v) != n:
            raise ValueError(f"{key} must be a list of {n} entries (one per layer), got {v!r}")
        out[key] = tuple(int(x) for x in v)
    disable_iv = get("sparse_disable_index_value", None)
    if disable_iv is not None:
        if not isinstance(disable_iv, (list, tuple)) or len(disable_iv) != n:
            raise ValueError(f"sparse_disable_index_value must be a list of {n} entries, got {disable_iv!r}")
        bad = [i for i, (s, d) in enumerate(zip(out["sparse_attention_freq"], disable_iv)) if s and not d]
        if bad:
            raise ValueError(
                f"sparse_disable_index_value is 0 on sparse layers {bad}: index value/output projections "
                f"are unsupported"
            )
    dtype = text.get("torch_dtype", text.get("dtype", raw.get("torch_dtype", "bfloat16")))
    out["dtype"] = str(dtype).removeprefix("torch.")
    for key in ("rope_theta", "rms_norm_eps", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit"):
        out[key] = float(out[key])
    return out
