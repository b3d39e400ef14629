"""Reading Hugging Face ``config.json`` files for MiniMax-M3 (the VL wrapper or a text config).

Every unsupported or inconsistent value raises ``ValueError`` naming the field; the result is
the keyword arguments of ``MiniMaxM3Config``, which validates the rest.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import Field
from typing import Any, Callable, Mapping, Sequence

from common.values import is_int

from .mxfp8 import MXFP8Config


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
_ABSENT = ("rope_scaling", "sliding_window")


def translate_hf(raw: Mapping[str, Any], config_fields: Sequence[Field], skip: frozenset[str]) -> dict[str, Any]:
    """HF config dict (VL wrapper or text) -> ``MiniMaxM3Config`` kwargs.

    ``config_fields`` are the config's dataclass fields; ``skip`` the ones HF does not carry.

    MTP fields (``num_mtp_modules``, ``num_nextn_predict_layers``) are ignored: MTP is an
    optional external draft module, not part of the backbone. Vision fields are ignored.
    """
    text = raw.get("text_config", raw)
    if not isinstance(text, Mapping):
        raise ValueError(f"text_config must be a dict, got {type(text).__name__}")
    sparse_cfg = text.get("sparse_attention_config") or {}
    if not isinstance(sparse_cfg, Mapping):
        raise ValueError("sparse_attention_config must be a dict")
    src = _TextConfig(text, sparse_cfg)
    _check_architectures(text.get("architectures"))
    _check_fixed_flags(src)
    # Plain fields first: the rotary width needs head_dim and the layer lists need
    # num_hidden_layers, both already type-checked, so a bad count is reported under its own name.
    out = _read_fields(src, config_fields, skip)
    out["rotary_dim"] = _read_rotary_dim(src, out["head_dim"])
    out.update(_read_layer_lists(src, out["num_hidden_layers"]))
    out["dtype"] = _read_dtype(raw, text)
    out["quantization"] = _read_quantization(raw, text)
    return out


class _TextConfig:
    """The text part of a ``config.json`` with its ``sparse_attention_config`` block.

    A key is looked up in the block first, then at the top level: some exports flatten the
    block into the text config, and both layouts name the fields the same way.
    """

    def __init__(self, text: Mapping[str, Any], sparse: Mapping[str, Any]) -> None:
        self.text = text
        self.sparse = sparse

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """The raw JSON value of ``key``; ``default`` when absent (absent and required raises)."""
        for src in (self.sparse, self.text):
            if key in src:
                return src[key]
        if default is _REQUIRED:
            raise ValueError(f"config field {key!r} is missing")
        return default


def _check_architectures(archs: Any) -> None:
    """Refuse a config whose ``architectures`` is malformed or names no MiniMax-M3 model.

    Absent, null or an empty list pass (text configs often omit it). A bare string is refused
    rather than searched, as iterating it would test single characters.
    """
    if archs is None:
        return
    if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
        raise ValueError(
            f"config.json field 'architectures' must be a list of strings, got {archs!r} ({_kind(archs)}); "
            f'write e.g. ["MiniMaxM3SparseForCausalLM"]'
        )
    if archs and not any("MiniMaxM3" in a for a in archs):
        raise ValueError(f"architectures={archs!r} is not a MiniMax-M3 text model")


def _check_fixed_flags(src: _TextConfig) -> None:
    """Refuse flags whose only supported value is M3's and features this implementation lacks."""
    for key, want in _FIXED.items():
        got = src.get(key, want)
        if got != want:
            raise ValueError(f"{key}={got!r} is unsupported; MiniMax-M3 needs {key}={want!r}")
    for key in _ABSENT:
        if src.text.get(key) is not None:
            raise ValueError(f"{key}={src.text[key]!r} is unsupported; this implementation has no {key}")
    for key in ("n_group", "topk_group"):
        if src.get(key, 1) not in (None, 0, 1):
            raise ValueError(f"{key}={src.get(key)!r}: group-limited routing is unsupported")
    if src.get("norm_topk_prob", True) is not True:
        raise ValueError("norm_topk_prob=False is unsupported; M3 renormalises the top-k weights")
    if src.get("swiglu_beta", 1.0) != 1.0:
        raise ValueError(f"swiglu_beta={src.get('swiglu_beta')!r} is unsupported; M3 adds a fixed 1 to up")


# Config fields with their own reader below (derived, looked up under another key, or per layer).
_READ_ELSEWHERE = frozenset({"rotary_dim", "dtype", "moe_layer_freq", "sparse_attention_freq", "quantization"})


def _read_fields(src: _TextConfig, config_fields: Sequence[Field], skip: frozenset[str]) -> dict[str, Any]:
    """Every scalar config field, read by its annotated type (int, float or bool).

    Dispatching on the dataclass annotation means a field added to ``MiniMaxM3Config`` is
    type-checked here without a second list to keep in step; an annotation with no reader
    fails loudly so the new field gets a deliberate JSON rule.
    """
    out: dict[str, Any] = {}
    for f in config_fields:
        if f.name in skip or f.name in _READ_ELSEWHERE:
            continue
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
        reader = _READERS.get(type_name)
        if reader is None:
            raise TypeError(
                f"MiniMaxM3Config.{f.name} has type {type_name!r}, which hf_config has no JSON reader for; "
                f"add one to _READERS or read the field in its own helper"
            )
        default = _REQUIRED if f.name in _REQUIRED_KEYS else f.default
        out[f.name] = reader(f.name, src.get(f.name, default))
    return out


def _read_rotary_dim(src: _TextConfig, head_dim: int) -> int:
    """``rotary_dim`` from itself or ``partial_rotary_factor * head_dim``; both given must agree."""
    rotary = src.get("rotary_dim", None)
    factor = src.get("partial_rotary_factor", None)
    if rotary is None and factor is None:
        raise ValueError("config needs rotary_dim or partial_rotary_factor")
    if rotary is not None:
        rotary = _read_int("rotary_dim", rotary)
    if factor is None:
        return rotary
    factor = _read_float("partial_rotary_factor", factor)
    if not 0 < factor <= 1:
        raise ValueError(
            f"config.json field 'partial_rotary_factor' must be in (0, 1] (the fraction of head_dim "
            f"that rotates), got {factor!r}"
        )
    dims = head_dim * factor
    if rotary is not None:
        if rotary != int(round(dims)):
            raise ValueError(
                f"rotary_dim={rotary} disagrees with partial_rotary_factor={factor} * head_dim={head_dim}"
            )
        return rotary
    # Alone, the factor must give a whole number of dims: rounding 38.4 to 38 would silently
    # rotate a width the checkpoint was not trained with. The tolerance absorbs 1/3-style floats.
    if abs(dims - round(dims)) > 1e-6:
        raise ValueError(
            f"partial_rotary_factor={factor} * head_dim={head_dim} = {dims:g} is not a whole number of "
            f"dims; give rotary_dim instead, or a factor that yields an integer"
        )
    return int(round(dims))


def _read_layer_lists(src: _TextConfig, n: int) -> dict[str, tuple[int, ...]]:
    """``moe_layer_freq`` and ``sparse_attention_freq`` (all 0 when sparse attention is off).

    ``n`` is ``num_hidden_layers``, already known to be an int; a count below 1 is refused
    here, before any list, so it is not misreported as a list of the wrong length.
    """
    if n < 1:
        raise ValueError(f"config.json field 'num_hidden_layers' must be >= 1, got {n}")
    out = {"moe_layer_freq": _read_flags("moe_layer_freq", src.get("moe_layer_freq"), n)}
    if _read_bool("use_sparse_attention", src.get("use_sparse_attention", True)):
        out["sparse_attention_freq"] = _read_flags("sparse_attention_freq", src.get("sparse_attention_freq"), n)
    else:
        out["sparse_attention_freq"] = (0,) * n
    disable_iv = src.get("sparse_disable_index_value", None)
    if disable_iv is not None:
        disable_iv = _read_flags("sparse_disable_index_value", disable_iv, n)
        bad = [i for i, (s, d) in enumerate(zip(out["sparse_attention_freq"], disable_iv)) if s and not d]
        if bad:
            raise ValueError(
                f"sparse_disable_index_value is 0 on sparse layers {bad}: index value/output projections "
                f"are unsupported"
            )
    return out


def _read_dtype(raw: Mapping[str, Any], text: Mapping[str, Any]) -> str:
    """The checkpoint dtype name (``torch.`` prefix dropped); bfloat16 when no config names one."""
    for src, key in ((text, "torch_dtype"), (text, "dtype"), (raw, "torch_dtype")):
        if key in src:
            value = src[key]
            if not isinstance(value, str):
                raise ValueError(
                    f'config.json field {key!r} must be a dtype name such as "bfloat16", got {value!r} '
                    f"({_kind(value)})"
                )
            return value.removeprefix("torch.")
    return "bfloat16"


def _read_quantization(raw: Mapping[str, Any], text: Mapping[str, Any]) -> MXFP8Config | None:
    """``quantization_config`` (top level, where HF writes it, or inside ``text_config``) -> the
    MXFP8 config, or None (unquantized) when absent or null."""
    top, inner = raw.get("quantization_config"), text.get("quantization_config") if text is not raw else None
    if top is not None and inner is not None and top != inner:
        raise ValueError("config.json has different quantization_config blocks at the top level and in text_config; "
                         "keep one")
    q = top if top is not None else inner
    return None if q is None else MXFP8Config.from_hf(q)


# ----- JSON field readers ---------------------------------------------------------------
# Strict on purpose: json.load gives exactly int/float/bool/str/list/dict/None, so anything
# else in a field is a mistake in the file (a quoted number, a list around a scalar), and
# float()/int() would either crash without the field's name or quietly truncate (0.9 -> 0).

# Floats the maths divides by, takes the log of, or clamps with: 0 or below is never meant.
_POSITIVE_FLOATS = {
    "rope_theta": "the RoPE base",
    "rms_norm_eps": "the RMSNorm epsilon",
    "routed_scaling_factor": "it scales the routed experts' weights",
    "swiglu_limit": "the SwiGLU clamp bound",
}


def _kind(value: Any) -> str:
    """What JSON gave, for messages: ``a str``, ``an int``, ``a list``, ``null``..."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _read_int(key: str, value: Any) -> int:
    """A JSON integer. Bools (``True`` is an int to Python), floats (even ``16.0``) and quoted
    numbers are refused: a size written any other way is a typo, not a size."""
    if not is_int(value):
        raise ValueError(
            f"config.json field {key!r} must be an integer, got {value!r} ({_kind(value)}); "
            f"write a JSON integer (no quotes, no decimal point)"
        )
    return value


def _read_float(key: str, value: Any) -> float:
    """A finite JSON number (int or float, not bool), and > 0 for ``_POSITIVE_FLOATS``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"config.json field {key!r} must be a number, got {value!r} ({_kind(value)}); "
            f"write a JSON number (no quotes)"
        )
    try:
        x = float(value)
    except OverflowError:  # an integer literal too large for a double
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"config.json field {key!r} must be a finite number, got {value!r}")
    if key in _POSITIVE_FLOATS and not x > 0:
        raise ValueError(f"config.json field {key!r} must be > 0 ({_POSITIVE_FLOATS[key]}), got {value!r}")
    return x


def _read_bool(key: str, value: Any) -> bool:
    """A JSON ``true``/``false``; 0/1 or ``"false"`` are refused (``"false"`` is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"config.json field {key!r} must be true or false, got {value!r} ({_kind(value)})")
    return value


def _read_flags(key: str, value: Any, n: int) -> tuple[int, ...]:
    """A per-layer flag list: exactly ``n`` entries, each 0 or 1, returned as ints.

    JSON ``true``/``false`` entries are accepted as 1/0: a flag list has no other meaning a
    bool could carry, so nothing is guessed. Floats (0.9, 1.0) and other ints are refused
    rather than truncated, since ``int(0.9) == 0`` would silently flip a layer's kind.
    """
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{key} must be a list of {n} entries (one per layer), got {value!r}")
    bad = [f"{x!r} at layer {i}" for i, x in enumerate(value) if not (isinstance(x, int) and x in (0, 1))]
    if bad:
        raise ValueError(f"config.json field {key!r} must hold 0 or 1 for each layer, got {', '.join(bad)}")
    return tuple(int(x) for x in value)


# Readers by the dataclass annotation (a string under ``from __future__ import annotations``).
_READERS: dict[str, Callable[[str, Any], Any]] = {"int": _read_int, "float": _read_float, "bool": _read_bool}
