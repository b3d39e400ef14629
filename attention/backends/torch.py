"""TorchAttention: the plain-torch reference backend (host loops over requests).

Exact and slow; the CPU path and the reference other backends are tested against. Its ops
loop over the step's requests on the host, so it is never graph-safe for decode graphs.
Caches of every ``kvcache.paged.CACHE_DTYPES`` dtype work, fp8 e4m3 included: the references
gather in the storage dtype and upcast to the compute dtype.
"""

from __future__ import annotations

import torch

from attention.base import AttentionBackend
from attention.dims import AttentionDims
from attention.reference.dense import dense_attention_ref
from attention.reference.indexer import index_topk_ref
from attention.reference.sparse import sparse_attention_ref
from graphcap import Padding, Step
from kvcache.paged import PagedKVCache


class TorchAttention(AttentionBackend):
    """Reference dense attention, index top-k and sparse attention.

    Attributes:
        topk_buf: ``int32 [num_kv_heads, max_tokens, topk]`` selections, shared by all sparse layers.
    """

    def __init__(self, cache: PagedKVCache, dims: AttentionDims) -> None:
        super().__init__(cache, dims)
        self.topk_buf = torch.full((dims.num_kv_heads, dims.max_tokens, dims.topk), -1, dtype=torch.int32,
                                   device=cache.block_tables.device)

    def plan(self, step: Step, padding: Padding) -> None:
        self.check_plan(step, padding)

    def _dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        dense_attention_ref(q, self.cache.k_cache[layer], self.cache.v_cache[layer], self.meta, out, self.dims.scale)

    def _sparse(self, layer: int, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor) -> None:
        meta, d = self.meta, self.dims
        topk = self.topk_buf[:, : meta.num_tokens]
        index_topk_ref(iq, self.cache.index_k_cache[self.cache.sparse_index(layer)], meta, d.topk, d.block_size, topk)
        sparse_attention_ref(q, self.cache.k_cache[layer], self.cache.v_cache[layer], topk, meta, out, d.scale,
                             d.block_size)

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        return {"topk_buf": self.topk_buf}
