"""Synthetic checkpoints for tests: written once per module, read back as the reference's weights."""

from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file

from models.minimax_m3 import MiniMaxM3Config
from models.minimax_m3.checkpoint_writer import write_synthetic_checkpoint


def write_tiny_checkpoint(tmp_path_factory, name: str, config: MiniMaxM3Config) -> str:
    """A random checkpoint of ``config`` (seed 7, several shards) in a fresh folder; its path."""
    folder = tmp_path_factory.mktemp(name)
    write_synthetic_checkpoint(config, folder, seed=7, shard_size_bytes=400_000)
    return str(folder)


def language_model_weights(folder: str) -> dict[str, torch.Tensor]:
    """The checkpoint's ``language_model.*`` tensors, keyed without the prefix (the model's names)."""
    w: dict[str, torch.Tensor] = {}
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        w.update(load_file(f))
    return {k[len("language_model."):]: v for k, v in w.items() if k.startswith("language_model.")}
