"""The toy transformer's config and layer parameters, shared by its bare form (``bare``: own
cache and attention, a ``CaptureManager`` directly) and its runner form (``model``: the paged
cache, an attention backend and ``models.runner.ModelRunner``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ToyConfig:
    """Shapes of the toy and the capacity of its bare form.

    Attributes:
        num_layers, hidden, num_heads, vocab: the transformer (``head_dim = hidden / num_heads``).
        max_seqs, max_len, max_tokens: the bare form's cache rows, positions per row and step
            capacity (the runner form takes its capacity from the runner instead).
        page_size: positions per KV page in the runner form.
    """

    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    vocab: int = 128
    max_seqs: int = 8
    max_len: int = 64
    max_tokens: int = 64
    page_size: int = 16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


class ToyLayer(nn.Module):
    """RMSNorm -> fused QKV -> attention -> o_proj, then RMSNorm -> GELU MLP (``4 * hidden``)."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_norm = nn.RMSNorm(cfg.hidden)
        self.qkv_proj = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.post_norm = nn.RMSNorm(cfg.hidden)
        self.up_proj = nn.Linear(cfg.hidden, 4 * cfg.hidden, bias=False)
        self.down_proj = nn.Linear(4 * cfg.hidden, cfg.hidden, bias=False)


class ToyWeights(nn.Module):
    """The toy's parameters (embedding, layers, final norm, lm_head) on ``device`` in ``dtype``;
    both forms of the toy are this plus their own cache and attention."""

    def __init__(self, cfg: ToyConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(ToyLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.to(device=device, dtype=dtype)


__all__ = ["ToyConfig", "ToyLayer", "ToyWeights"]
