"""Synthetic MiniMax-M3 checkpoints in the real on-disk format, for tests and examples.

The folder gets a VL-layout ``config.json`` (``text_config`` inside), safetensors shards with
``language_model.``-prefixed text keys (router gate and bias fp32, the rest in
``config.dtype``), one small ``vision_tower`` tensor (which loaders must ignore), and
``model.safetensors.index.json``. Tensors are generated one at a time and shards are flushed
as they fill, so memory stays at about one shard.

For an MXFP8 config (``config.quantization``) every projection and expert weight is the same
random draw quantised (fp8 e4m3 ``weight`` + uint8 ``weight_scale_inv``, in one shard) and
``config.json`` carries the ``quantization_config`` (top level of the VL layout, as released).
"""

from __future__ import annotations

import json
import math
import os
import zlib

import torch
from safetensors.torch import save_file

from .config import MiniMaxM3Config
from .mxfp8 import FP8, SCALE_SUFFIX, quantize_mxfp8
from .weights import VL_PREFIX, checkpoint_layout


def synthetic_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The deterministic random value of ``key``: norm offsets ``N(0, 0.1^2)`` (near zero, as
    Gemma offsets are), routing bias ``N(0, 0.1^2)``, embeddings ``N(0, 1)``, projections
    ``N(0, 1/fan_in)``. Depends only on (key, shape, seed), not on shard order."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    if len(shape) == 1:
        std = 0.1
    elif "embed_tokens" in key:
        std = 1.0
    else:
        std = shape[-1] ** -0.5
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def write_synthetic_checkpoint(
    config: MiniMaxM3Config,
    folder: str | os.PathLike,
    seed: int = 0,
    shard_size_bytes: int = 5 << 30,
    text_only: bool = False,
    quantization: str | None = None,
) -> dict[str, str]:
    """Write a random checkpoint for ``config`` into ``folder`` (created if needed).

    Args:
        config: an unsharded config; its ``quantization`` picks the format (MXFP8 or not).
        quantization: ``"mxfp8"``: write ``config.with_quantization("mxfp8")`` (shorthand).
        seed: all values follow from it (see ``synthetic_tensor``).
        shard_size_bytes: a shard is closed once it reaches this size.
        text_only: write a plain text ``config.json`` and unprefixed keys, no vision tensor.
    Returns:
        The weight map (full key -> shard file name), as written to the index.
    """
    if quantization is not None:
        config = config.with_quantization(quantization)
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    prefix = "" if text_only else VL_PREFIX
    dtype = config.torch_dtype
    stored = {"weight": FP8, "scale": torch.uint8}
    items = [(prefix + k, t.shape, stored.get(t.mxfp8, torch.float32 if t.fp32 else dtype))
             for k, t in checkpoint_layout(config).items()]
    if not text_only:
        items.append(("vision_tower.patch_embed.proj.weight", (8, 3, 2, 2), dtype))

    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            save_file(pending, os.path.join(folder, f"_shard{len(shards)}.tmp"), metadata={"format": "pt"})
            shards.append(list(pending))
            pending, size = {}, 0

    for key, shape, dt in items:
        if dt == torch.uint8:
            continue  # MXFP8 scales: written with their weight, in the same shard
        tensors = {key: synthetic_tensor(key, shape, dt, seed)} if dt != FP8 else \
            dict(zip((key, key + SCALE_SUFFIX), quantize_mxfp8(synthetic_tensor(key, shape, torch.float32, seed))))
        for k, t in tensors.items():
            pending[k] = t
            size += t.numel() * t.element_size()
        if size >= shard_size_bytes:
            flush()
    flush()

    weight_map: dict[str, str] = {}
    n = len(shards)
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(folder, f"_shard{i}.tmp"), os.path.join(folder, name))
        weight_map.update({k: name for k in keys})
    total = sum(math.prod(s) * dt.itemsize for _, s, dt in items)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)

    text = config.to_hf_text()
    cfg = text if text_only else {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "torch_dtype": config.dtype,
        "image_token_id": 200025,
        "video_token_id": 200026,
        "text_config": text,
        "vision_config": {"model_type": "minimax_m3_vision", "hidden_size": 8},
    }
    if not text_only and "quantization_config" in text:
        cfg["quantization_config"] = text.pop("quantization_config")  # the VL release has it at the top level
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return weight_map
