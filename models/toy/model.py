"""The toy transformer on the paged KV cache, an attention backend and the generic runner.

The same layers as the bare toy (``models.toy.bare``), but the cache is the project's
``PagedKVCache`` (dense layers only: no index-K) and attention is the backend's ``dense``
splice, so the model runs through ``models.runner.ModelRunner`` exactly as MiniMax-M3 does:
requests, chunked steps, capture, validation, audits::

    runner = build_toy_runner(ToyConfig(), capture=CaptureConfig(enabled=True, debug_eager=True))
    runner.add_request("a")
    out = runner.step([TokenChunk("a", 0, [1, 2, 3])])
"""

from __future__ import annotations

from typing import Mapping

import torch

from attention.base import AttentionBackend
from attention.dims import AttentionDims
from attention.registry import make_backend
from distributed import ParallelGroup
from graphcap import CaptureConfig
from graphcap.splice_buffers import SpliceBuffers
from kvcache.paged import KVCacheConfig, PagedKVCache
from models.runner import ModelRunner, OpTable, capture_reserve

from .config import ToyConfig, ToyWeights


class ToyOps(OpTable):
    """Plain torch throughout: no kernel choices, nothing to compile ahead."""

    name = "torch"
    tuner = None


class ToyModel(ToyWeights):
    """The toy as a ``models.runner.RunnerModel`` (see the module docstring)."""

    def __init__(self, cfg: ToyConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, device, dtype)
        self.config = cfg
        self.requires_grad_(False)
        self.ops = ToyOps()
        self.group = ParallelGroup.single(device)
        self.cache: PagedKVCache | None = None
        self.backend: AttentionBackend | None = None
        self.splice_buffers: SpliceBuffers | None = None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab

    def kv_cache_config(self, num_pages: int, max_seqs: int, max_pages_per_seq: int, device: torch.device | str,
                        capture_rows: int, capture_pages: int) -> KVCacheConfig:
        """The paged cache this model reads: every layer dense (no index-K)."""
        c = self.config
        return KVCacheConfig(num_layers=c.num_layers, sparse_layers=(), num_kv_heads=c.num_heads, head_dim=c.head_dim,
                             index_dim=1, page_size=c.page_size, num_pages=num_pages, max_seqs=max_seqs,
                             max_pages_per_seq=max_pages_per_seq, dtype=self.lm_head.weight.dtype, device=device,
                             capture_rows=capture_rows, capture_pages=capture_pages)

    def attach(self, cache: PagedKVCache, backend: AttentionBackend) -> None:
        """Use ``cache`` and ``backend``; allocates the splice buffers (q and the attention
        output cross the splice) for the backend's step capacity."""
        c = self.config
        if (cache.config.num_layers, cache.config.num_kv_heads, cache.config.head_dim) != (
                c.num_layers, c.num_heads, c.head_dim):
            raise ValueError("the cache does not match the toy's layers and heads; build it with kv_cache_config")
        self.cache, self.backend = cache, backend
        buf = SpliceBuffers(backend.dims.max_tokens, cache.block_tables.device)
        buf.add("q", (c.num_heads, c.head_dim), self.lm_head.weight.dtype)
        buf.add("attn_out", (c.num_heads, c.head_dim), self.lm_head.weight.dtype)
        self.splice_buffers = buf

    def hidden_states(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``input_ids``, ``positions``, ``slot_mapping`` ``[T]`` -> final-normed ``[T, hidden]``."""
        c, cache, buf = self.config, self.cache, self.splice_buffers
        if cache is None or buf is None:
            raise RuntimeError("attach(cache, backend) before running the forward")
        x = self.embed(inputs["input_ids"])
        t = x.shape[0]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv_proj(layer.input_norm(x)).view(t, 3, c.num_heads, c.head_dim).unbind(1)
            cache.write(i, inputs["slot_mapping"], k, v)
            qb = buf.view("q", t)
            qb.copy_(q)
            out = buf.view("attn_out", t).zero_()  # rows attention leaves untouched (padding) stay 0
            self.backend.dense(i, qb, out)
            x = x + layer.o_proj(out.reshape(t, c.hidden))
            x = x + layer.down_proj(torch.nn.functional.gelu(layer.up_proj(layer.post_norm(x))))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def build_toy_runner(cfg: ToyConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                     backend: str = "torch", max_tokens: int = 64, max_seqs: int = 4, max_seq_len: int = 64,
                     capture: CaptureConfig | None = None, seed: int = 0) -> ModelRunner:
    """A runner over a toy with random weights (``torch.manual_seed(seed)``), a paged cache of
    ``max_seqs`` full sequences plus the capture reserve, and the attention ``backend``."""
    torch.manual_seed(seed)
    model = ToyModel(cfg, device, dtype)
    pages_per_seq = -(-max_seq_len // cfg.page_size)
    rows, pages = capture_reserve(max_tokens, max_seqs, cfg.page_size, pages_per_seq * cfg.page_size)
    cache = PagedKVCache(model.kv_cache_config(pages_per_seq * max_seqs, max_seqs, pages_per_seq, device, rows, pages))
    dims = AttentionDims.for_cache(cache, cfg.num_heads, 1, max_tokens)
    return ModelRunner(model, cache, make_backend(backend, cache, dims), max_tokens, max_seqs, capture)


__all__ = ["ToyModel", "ToyOps", "build_toy_runner"]
