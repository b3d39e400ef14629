"""Streaming, strict safetensors loader with the real MiniMax-M3 key names.

A checkpoint folder holds ``config.json`` and either ``model.safetensors.index.json`` (sharded)
or one ``model.safetensors``. Keys carry the prefix ``language_model.`` when ``config.json``
is the VL wrapper (it has ``text_config``), and no prefix for a plain text config.

Loading is two passes over the shard headers and data:
1. headers only (names, shapes, dtypes): every missing, unexpected, mis-shaped or mis-typed
   key is found before a parameter is touched, so a failed load leaves the model unchanged;
2. one tensor at a time, copied (and cast) into its slice of the fused parameters in place,
   so parameter addresses never move (captured graphs stay valid).

MXFP8 checkpoints (``quantization_config.quant_method: mxfp8``) hold every attention, MLP and
expert projection as fp8 e4m3 (``F8_E4M3``) with its E8M0 scales (``U8``) in
``<name>.weight_scale_inv``, and load into an MXFP8 model unchanged (fp8 stays fp8): scales fuse
and shard exactly as their weights' rows, and a TP slice of input columns reads scale columns
``/ 32``. The loader refuses an MXFP8 checkpoint into an unquantized model and the reverse.

Ignored on purpose: vision tensors (``vision_tower.*``, ``multi_modal_projector.*``,
``patch_merge_mlp.*``) and MTP draft layers (``model.mtp.*``), which are not part of the
text backbone.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open

from distributed.sharding import head_slice, split_slice

from .config import MiniMaxM3Config
from .model import MiniMaxM3ForCausalLM
from .mxfp8 import BLOCK, SCALE_SUFFIX, invalid_count

VL_PREFIX = "language_model."
IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")
MTP_PREFIX = "model.mtp."
_ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_MXFP8_DTYPE = {"weight": "F8_E4M3", "scale": "U8"}


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes.

    Attributes:
        param: model parameter name, or None when another rank holds the tensor (a routed
            expert of another EP rank: its header is checked, its data never read).
        index: indexing into that parameter (``()`` = whole; rows of a fused projection; an
            expert of a stacked tensor).
        shape: the checkpoint tensor's expected (full, unsharded) shape.
        fp32: stored in fp32 whatever the checkpoint dtype (router gate and bias).
        source: indexing into the checkpoint tensor: the part this rank reads (``()`` = all).
        mxfp8: ``"weight"`` (fp8 e4m3 values), ``"scale"`` (their uint8 E8M0 scales) or ``""``
            (not quantized: the checkpoint dtype, or fp32).
    """

    param: str | None
    index: tuple
    shape: tuple[int, ...]
    fp32: bool = False
    source: tuple = ()
    mxfp8: str = ""


def checkpoint_layout(c: MiniMaxM3Config, rank: int = 0, world: int = 1) -> dict[str, Target]:
    """Every text tensor of a checkpoint for the whole model ``c`` (keys without
    ``language_model.``), mapped into rank ``rank`` of ``c.shard(world, world)``.

    The sharding rules (``distributed.sharding``), TP and EP over the same ``world`` ranks:
    q / kv / index-q heads by ``head_slice`` (kv and index heads replicated above ``world =
    kv heads``), the index-key head whole; ``o_proj`` and ``down_proj`` by input columns;
    dense MLP and shared expert gate/up by output rows; embed_tokens and lm_head by vocab rows;
    routed experts ``[rank * E/W, (rank+1) * E/W)`` (the rest are not read); norms, router
    and routing bias whole.
    """
    if c.tp_size != 1 or c.ep_size != 1:
        raise ValueError("checkpoints hold whole models; pass the unsharded config and the rank")
    sh = c.shard(world, world) if world > 1 else c
    H, every = c.hidden_size, slice(None)

    def heads(n: int, d: int) -> slice:
        return head_slice(n, d, rank, world)

    vocab = split_slice(c.vocab_size, rank, world)
    out: dict[str, Target] = {
        "model.embed_tokens.weight": Target("model.embed_tokens.weight", (), (c.vocab_size, H), source=(vocab,)),
        "model.norm.weight": Target("model.norm.weight", (), (H,)),
        "lm_head.weight": Target("lm_head.weight", (), (c.vocab_size, H), source=(vocab,)),
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{n}.weight"] = Target(f"{p}{n}.weight", (), (H,))
        a = p + "self_attn."
        # (name, full rows, rows this rank reads): fused into qkv_proj in this order.
        projs = [("q_proj", c.q_size, heads(c.num_attention_heads, c.head_dim)),
                 ("k_proj", c.kv_size, heads(c.num_key_value_heads, c.head_dim)),
                 ("v_proj", c.kv_size, heads(c.num_key_value_heads, c.head_dim))]
        norms = [("q_norm", c.head_dim), ("k_norm", c.head_dim)]
        if c.is_sparse(i):
            projs += [("index_q_proj", c.index_q_size, heads(c.sparse_num_index_heads, c.sparse_index_dim)),
                      ("index_k_proj", c.sparse_index_dim, every)]
            norms += [("index_q_norm", c.sparse_index_dim), ("index_k_norm", c.sparse_index_dim)]
        row = 0
        for name, width, rows in projs:
            local = len(range(width)[rows])
            out[f"{a}{name}.weight"] = Target(f"{a}qkv_proj.weight", (slice(row, row + local),), (width, H),
                                              source=() if local == width else (rows,))
            row += local
        assert row == sh.qkv_size(i)
        for name, width in norms:
            out[f"{a}{name}.weight"] = Target(f"{a}{name}.weight", (), (width,))
        q_cols = heads(c.num_attention_heads, c.head_dim)
        out[f"{a}o_proj.weight"] = Target(f"{a}o_proj.weight", (), (H, c.q_size),
                                          source=() if world == 1 else (every, q_cols))
        if c.is_moe(i):
            m = p + "block_sparse_moe."
            E, inter, held = c.num_local_experts, c.intermediate_size, split_slice(c.num_local_experts, rank, world)
            out[f"{m}gate.weight"] = Target(f"{m}gate.weight", (), (E, H), fp32=True)
            out[f"{m}e_score_correction_bias"] = Target(f"{m}e_score_correction_bias", (), (E,), fp32=True)
            for e in range(E):
                x, local = f"{m}experts.{e}.", e - held.start
                mine = held.start <= e < held.stop
                w13, w2 = (f"{m}experts.w13", f"{m}experts.w2") if mine else (None, None)
                out[f"{x}w1.weight"] = Target(w13, (local, slice(0, inter)), (inter, H))
                out[f"{x}w3.weight"] = Target(w13, (local, slice(inter, 2 * inter)), (inter, H))
                out[f"{x}w2.weight"] = Target(w2, (local,), (H, inter))
            out.update(_mlp_layout(f"{m}shared_experts.", H, c.shared_width, rank, world))
        else:
            out.update(_mlp_layout(f"{p}mlp.", H, c.dense_intermediate_size, rank, world))
    return out if c.quantization is None else _mxfp8_layout(out)


def _mxfp8_layout(layout: dict[str, Target]) -> dict[str, Target]:
    """The MXFP8 layout: every projection (``*_proj``) and expert weight marked fp8 and followed
    by its ``weight_scale_inv`` ``[rows, in / 32]``, which goes where the weight's rows go (same
    fused rows, same expert) and reads input columns ``/ 32`` (the config keeps TP column
    slices whole blocks: ``mxfp8.check_block_alignment``)."""
    out: dict[str, Target] = {}
    for key, t in layout.items():
        if not (key.endswith("_proj.weight") or ".experts." in key):
            out[key] = t  # embeddings, lm_head, norms, router gate and bias: unquantized
            continue
        out[key] = replace(t, mxfp8="weight")
        src = t.source
        if len(src) == 2:  # a TP slice of input columns
            cols = src[1]
            assert cols.start % BLOCK == 0 and cols.stop % BLOCK == 0, (key, cols)
            src = (src[0], slice(cols.start // BLOCK, cols.stop // BLOCK))
        out[key + SCALE_SUFFIX] = Target(None if t.param is None else t.param + SCALE_SUFFIX, t.index,
                                         (t.shape[0], t.shape[1] // BLOCK), source=src, mxfp8="scale")
    return out


def _mlp_layout(prefix: str, hidden: int, inter: int, rank: int, world: int) -> dict[str, Target]:
    """Column-parallel gate/up (output rows), row-parallel down (input columns)."""
    fused, part = f"{prefix}gate_up_proj.weight", split_slice(inter, rank, world)
    n = inter // world
    src_rows, src_cols = ((), ()) if world == 1 else ((part,), (slice(None), part))
    return {
        f"{prefix}gate_proj.weight": Target(fused, (slice(0, n),), (inter, hidden), source=src_rows),
        f"{prefix}up_proj.weight": Target(fused, (slice(n, 2 * n),), (inter, hidden), source=src_rows),
        f"{prefix}down_proj.weight": Target(f"{prefix}down_proj.weight", (), (hidden, inter), source=src_cols),
    }


@dataclass(frozen=True)
class LoadReport:
    """What a load did: tensors copied, keys skipped on purpose, bytes read."""

    loaded: int
    ignored_vision: int
    ignored_mtp: int
    ignored_layers: int
    bytes_read: int


def checkpoint_prefix(folder: str | os.PathLike) -> str:
    """``language_model.`` for a VL ``config.json`` (has ``text_config``), else ``""``."""
    path = os.path.join(os.fspath(folder), "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} has no config.json; a checkpoint folder needs one")
    return VL_PREFIX if "text_config" in read_json(path) else ""


def shard_files(folder: str | os.PathLike) -> list[str]:
    """Shard paths in index order (or the single ``model.safetensors``)."""
    folder = os.fspath(folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        names = list(dict.fromkeys(weight_map.values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        raise ValueError(f"{folder!r} has neither model.safetensors.index.json nor model.safetensors")
    paths = [os.path.join(folder, n) for n in names]
    for p in paths:
        if not os.path.isfile(p):
            raise ValueError(f"shard {p!r} listed in the index is missing")
    return paths


MAX_LISTED = 8  # errors of one kind listed in full before the rest are counted


def read_json(path: str) -> dict:
    """A JSON file, with the file named in the error when it does not parse."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint is damaged or incomplete") from None


@contextlib.contextmanager
def open_shard(path: str) -> Iterator[Any]:
    """``safe_open`` with the shard named in any error (truncated file, bad header)."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            yield f
    except (OSError, SafetensorError) as e:
        raise ValueError(f"shard {path!r} could not be read ({type(e).__name__}: {e}); the file is damaged or "
                         f"truncated: download it again") from e


def _headers(paths: list[str]) -> Iterator[tuple[str, str, list[int], str]]:
    for path in paths:
        with open_shard(path) as f:
            for key in f.keys():
                s = f.get_slice(key)
                yield path, key, list(s.get_shape()), s.get_dtype()


def _capped(errors: dict[str, list[str]]) -> list[str]:
    """At most ``MAX_LISTED`` errors of each kind, then a count of the rest."""
    out = []
    for kind, items in errors.items():
        out += items[:MAX_LISTED]
        if len(items) > MAX_LISTED:
            out.append(f"... and {len(items) - MAX_LISTED} more {kind} keys")
    return out


def load_checkpoint(model: MiniMaxM3ForCausalLM, folder: str | os.PathLike, *,
                    truncate_layers: bool = False) -> LoadReport:
    """Load a checkpoint into ``model`` in place (strict; see the module docstring).

    A sharded model (config ``full.shard(W, W)``) reads only its own slices of each tensor
    (rank ``model.group.rank``; rank 0 for a one-rank model without a group, as ``rank_of_8``)
    while streaming, with every header still checked against the full shapes.

    Args:
        model: built with the checkpoint's config, or one rank of it (its parameter dtype may
            differ: tensors are cast on copy).
        folder: checkpoint folder.
        truncate_layers: allow a model with fewer layers than the checkpoint (e.g. a real-width
            slice of the full model); layers beyond the model's are skipped.

    Raises:
        ValueError: config mismatch (MXFP8 against unquantized included), or missing /
            unexpected / mis-shaped / mis-typed keys and MXFP8 scales (each named with its file,
            expected vs found); nothing is copied in that case.
    """
    c = model.config
    world = c.tp_size
    if c.ep_size != world:
        raise ValueError(f"the model is sharded tp_size={c.tp_size}, ep_size={c.ep_size}; loading needs one degree "
                         f"for both (TP and EP over the same ranks)")
    rank = model.group.rank if model.group.distributed else 0
    ck = MiniMaxM3Config.from_hf(folder)
    _check_config(c, ck, truncate_layers)
    prefix = checkpoint_prefix(folder)
    layout = checkpoint_layout(ck.first_layers(c.num_hidden_layers) if truncate_layers else ck, rank, world)
    want_dtype = _ST_DTYPE[ck.dtype]
    paths = shard_files(folder)

    plan: dict[str, list[tuple[str, Target]]] = {p: [] for p in paths}
    seen: dict[str, str] = {}
    errors: dict[str, list[str]] = {}

    def error(kind: str, msg: str) -> None:
        errors.setdefault(kind, []).append(msg)

    ign_v = ign_m = ign_l = 0
    for path, full_key, shape, dtype in _headers(paths):
        if full_key in seen:
            error("duplicate", f"{full_key!r} appears in both {seen[full_key]} and {path}")
            continue
        seen[full_key] = path
        if full_key.startswith(IGNORED_PREFIXES):
            ign_v += 1
            continue
        if not full_key.startswith(prefix):
            error("unexpected", f"unexpected key {full_key!r} "
                                f"(text keys need the prefix {prefix!r} for this config.json)")
            continue
        key = full_key[len(prefix):]
        if key.startswith(MTP_PREFIX):
            ign_m += 1
            continue
        t = layout.get(key)
        name = os.path.basename(path)
        if t is None:
            if truncate_layers and _layer_of(key) is not None and _layer_of(key) >= c.num_hidden_layers:  # type: ignore[operator]
                ign_l += 1
                continue
            error("unexpected", f"unexpected key {full_key!r} in {name}{_unexpected_hint(key, ck)}")
            continue
        if tuple(shape) != t.shape:
            error("mis-shaped", f"{full_key!r} has shape {tuple(shape)}, expected {t.shape}"
                                f"{' (one E8M0 byte per 32 input columns)' if t.mxfp8 == 'scale' else ''} (in {name})")
        exp = _MXFP8_DTYPE[t.mxfp8] if t.mxfp8 else "F32" if t.fp32 else want_dtype
        if dtype != exp:
            error("mis-typed", f"{full_key!r} has dtype {dtype}, expected {exp}{_dtype_hint(t, dtype)} (in {name})")
        entry = ck.quantization.covering_entry(key[:-len(".weight")]) if t.mxfp8 == "weight" else None  # type: ignore[union-attr]
        if entry is not None:
            error("mixed-precision", f"{full_key!r}: quantization_config.ignored_layers lists {entry!r}, keeping a "
                                     f"projection this model holds in MXFP8 unquantized; mixed-precision checkpoints "
                                     f"are unsupported (only lm_head, embed_tokens, the router gates and the vision "
                                     f"stack may be ignored)")
        plan[path].append((full_key, t))
    found = {k[len(prefix):] for k in seen if k.startswith(prefix)}
    missing = []
    for k in layout:
        if k in found:
            continue
        weight = prefix + k.removesuffix(SCALE_SUFFIX)
        if layout[k].mxfp8 == "scale" and weight in seen:  # the weight is there, its scales are not
            error("missing-scale", f"{prefix + k!r} is missing: MXFP8 needs the uint8 scales of {weight!r} (in "
                                   f"{os.path.basename(seen[weight])}) beside it, one byte per 32 input columns")
        else:
            missing.append(prefix + k)
    if missing:
        error("missing", f"{len(missing)} missing key(s): " + ", ".join(repr(k) for k in missing[:MAX_LISTED])
              + (" ..." if len(missing) > MAX_LISTED else ""))
    if errors:
        n = sum(len(v) for v in errors.values())
        raise ValueError(f"checkpoint {os.fspath(folder)!r} does not fit the model ({n} problem(s)):\n  "
                         + "\n  ".join(_capped(errors)))

    params = dict(model.named_parameters())
    nbytes = loaded = 0
    with torch.no_grad():
        for path, items in plan.items():
            if not items:
                continue
            with open_shard(path) as f:
                for full_key, t in items:
                    if t.param is None:
                        continue  # another rank's expert
                    src = f.get_slice(full_key)[t.source] if t.source else f.get_tensor(full_key)
                    bad = invalid_count(src, t.mxfp8 == "scale")
                    if bad:
                        what = "NaN scale bytes (255)" if t.mxfp8 == "scale" else "non-finite values (NaN/inf)"
                        raise ValueError(f"checkpoint {os.fspath(folder)!r}: {full_key!r} in {path} holds {bad} "
                                         f"{what}; the shard's data is damaged: download it again")
                    params[t.param][t.index].copy_(src)
                    nbytes += src.numel() * src.element_size()
                    loaded += 1
    return LoadReport(loaded, ign_v, ign_m, ign_l, nbytes)


def _layer_of(key: str) -> int | None:
    parts = key.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _unexpected_hint(key: str, ck: MiniMaxM3Config) -> str:
    if not key.endswith(SCALE_SUFFIX):
        return ""
    return (" (an MXFP8 scale, but config.json has no quantization_config: add the MXFP8 one or drop the scales)"
            if ck.quantization is None else " (a scale of a tensor this model keeps unquantized)")


def _dtype_hint(t: Target, dtype: str) -> str:
    if t.mxfp8 == "weight":
        return (" (an MXFP8 checkpoint stores every projection and expert as fp8 e4m3 with uint8 weight_scale_inv "
                "scales beside it; re-export this tensor quantized)")
    if t.mxfp8 == "scale":
        return " (MXFP8 scales are E8M0 bytes)"
    return " (fp8 weights need an MXFP8 quantization_config in config.json)" if dtype == "F8_E4M3" else ""


def _check_config(model_cfg: MiniMaxM3Config, ck: MiniMaxM3Config, truncate: bool) -> None:
    if ck.quantization is not None and model_cfg.quantization is None:
        raise ValueError("the checkpoint is MXFP8 (config.json quantization_config: fp8 weights with E8M0 scales) but "
                         "the model was built unquantized (config.quantization=None); build it from the checkpoint's "
                         "config (MiniMaxM3Config.from_hf(folder)) or with config.with_quantization('mxfp8')")
    if ck.quantization is None and model_cfg.quantization is not None:
        raise ValueError(f"the checkpoint holds unquantized {ck.dtype} weights (config.json has no "
                         f"quantization_config) but the model is MXFP8 (config.quantization is set); build it with "
                         f"config.with_quantization(None), or load an MXFP8 checkpoint")
    n = model_cfg.num_hidden_layers
    if truncate and n < ck.num_hidden_layers:
        ck = ck.first_layers(n)
    if model_cfg.tp_size > 1:
        ck = ck.shard(model_cfg.tp_size, model_cfg.ep_size)
    # quantization: both MXFP8 (checked above); their ignored_layers may be spelt differently.
    diff = [f.name for f in fields(ck)
            if f.name not in ("dtype", "quantization") and getattr(ck, f.name) != getattr(model_cfg, f.name)]
    if diff:
        raise ValueError(
            "the checkpoint's config.json differs from the model's config in: "
            + ", ".join(f"{d} (checkpoint {getattr(ck, d)!r}, model {getattr(model_cfg, d)!r})" for d in diff)
        )
