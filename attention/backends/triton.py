"""TritonAttention: the attention backend built on this package's Triton kernels.

- ``sparse``: index top-k into the shared ``topk_buf``, then block-sparse GQA. Uniform decode
  steps take the graph-safe decode path (every row of ``q`` runs; positions, sequences, slots
  and block tables come from the metadata's persistent device buffers; grids depend on shapes
  only), so decode graphs capture through it. Other steps take the prefill path, sized
  from host metadata (never inside a decode graph: the manager only makes decode graphs of
  uniform decode steps). The indexer runs over request-aligned token tiles planned per step (a
  prefill chunk's tokens share every index-K tile they load: 158 -> 22 us per layer for 30
  decodes + a 1024-token chunk at rank-of-8 on an H200). The attention runs block-major by
  default (``prefill_attention="blocks"``, :mod:`attention.kernels.sparse_blocks`): one program
  per tile of the queries that selected a key block, each block's K and V read once a tile; the
  indexer's merge buckets the (token, block) pairs for it as it writes the selections.
  On the H200 (3 decodes + a 1024-token chunk; 30 decodes at 3K) it beat one token per
  program (``"per_token"``) at every context and selection measured: 141 vs 164 us at 64K,
  157 vs 182 at 128K, 130 vs 156 at 3K on the random model's selections. Token tiles over the
  union of their blocks (``"tiles"``) are faster still where runs of neighbouring tokens
  share their selections (63 us at 64K) and 2x slower where they do not. Each choice is one
  build for every prefill step.
- ``dense``: a FALLBACK Triton kernel (one token per program, split over key blocks): correct
  and graph-safe for decode, slow for long prefills. Prefer flashinfer for the dense layers
  (``LayerSplit(dense=FlashinferAttention, sparse=TritonAttention)``, the ``flashinfer`` kind).
"""

from __future__ import annotations

import torch

from attention.base import AttentionBackend
from attention.dims import AttentionDims
from attention.kernels import indexer, sparse
from attention.kernels.indexer import index_topk_decode, index_topk_prefill_tiled
from attention.kernels.sparse import dense_attention_triton, sparse_attention_decode, sparse_attention_prefill
from attention.kernels.sparse_blocks import BlockPlan, BlockPlanner, bucket_space, sparse_attention_prefill_blocks
from attention.kernels.tiles import StepTiles, TilePlanner
from graphcap import Padding, Step
from kvcache.paged import PagedKVCache


class TritonAttention(AttentionBackend):
    """Triton kernels for index top-k and sparse attention (dense: Triton fallback).

    Args:
        cache, dims: as :class:`AttentionBackend`.
        prefill_attention: ``"blocks"`` (default), ``"per_token"`` or ``"tiles"``: how prefill
            steps' sparse attention runs (see the module docstring).

    Attributes:
        topk_buf: ``int32 [num_kv_heads, max_tokens, topk]`` selections, shared by all sparse layers.
    """

    PREFILL_ATTENTION = ("blocks", "per_token", "tiles")

    def __init__(self, cache: PagedKVCache, dims: AttentionDims, prefill_attention: str = "blocks") -> None:
        super().__init__(cache, dims)
        if prefill_attention not in self.PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention must be one of {self.PREFILL_ATTENTION}, got {prefill_attention!r}")
        device = cache.block_tables.device
        self.topk_buf = torch.full((dims.num_kv_heads, dims.max_tokens, dims.topk), -1, dtype=torch.int32,
                                   device=device)
        self._index_tiles = TilePlanner(dims.max_tokens, device)
        self._index_block_t = indexer.tile_block_t(dims.num_kv_heads)
        self._tiles: StepTiles | None = None
        self._attn_tiles: TilePlanner | None = None
        if prefill_attention == "tiles":
            self._attn_tiles = TilePlanner(dims.max_tokens, device)
            self._attn_block_t = sparse.default_block_t(dims.num_qo_heads // dims.num_kv_heads)
        self._attn_rows: torch.Tensor | None = None
        self._blocks: BlockPlanner | None = None
        self._block_plan: BlockPlan | None = None
        if prefill_attention == "blocks":
            # a step's requests each hold a block-table row, with at most a row's width of blocks
            self._blocks = BlockPlanner(cache.block_tables.shape[0], cache.block_tables.numel(), device)

    def plan(self, step: Step, padding: Padding) -> None:
        meta = self.check_plan(step, padding)
        cap = meta.buffers.positions.shape[0]
        if padding.rows > cap:
            raise ValueError(f"step runs {padding.rows} rows but the metadata holds {cap}; "
                             f"raise the runner's max_tokens")
        self._tiles = self._block_plan = None
        if not step.uniform_decode:  # the prefill path: request-aligned tiles, O(tiles) host work
            self._tiles = self._index_tiles.plan(meta.qo_indptr_host, self._index_block_t)
            if self._attn_tiles is not None:
                self._attn_rows = self._attn_tiles.plan(meta.qo_indptr_host, self._attn_block_t).rows
            if self._blocks is not None:
                self._block_plan = self._blocks.plan(meta)

    def sparse_graph_safe(self, padding: Padding) -> bool:
        return padding.rows <= self.dims.max_tokens

    def dense_graph_safe(self, padding: Padding) -> bool:
        return padding.rows <= self.dims.max_tokens

    def _sparse(self, layer: int, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor) -> None:
        meta, d = self.meta, self.dims
        ik = self.cache.index_k_cache[self.cache.sparse_index(layer)]
        kc, vc = self.cache.k_cache[layer], self.cache.v_cache[layer]
        if self.uniform_decode:
            topk = self.topk_buf[:, : q.shape[0]]  # every row of the (padded) batch; pad rows get -1
            index_topk_decode(iq, ik, meta, d.topk, topk)
            sparse_attention_decode(q, kc, vc, topk, meta, out, d.scale)
        else:
            if self._tiles is None:
                raise RuntimeError("TritonAttention ran a prefill step it did not plan; plan every step first")
            topk = self.topk_buf[:, : meta.num_tokens]
            if self._block_plan is not None:  # the indexer's merge buckets the pairs (one launch fewer)
                space = bucket_space(q, d.num_kv_heads, d.topk, self._block_plan)
                buckets = index_topk_prefill_tiled(iq, ik, meta, d.topk, topk, self._tiles, buckets=space)
                sparse_attention_prefill_blocks(q, kc, vc, topk, meta, out, d.scale, self._block_plan, buckets)
                return
            index_topk_prefill_tiled(iq, ik, meta, d.topk, topk, self._tiles)
            if self._attn_tiles is None:
                sparse_attention_prefill(q, kc, vc, topk, meta, out, d.scale, block_t=1)
            else:  # every tile in one launch (one-token tiles too): faster than two on the H200
                sparse_attention_prefill(q, kc, vc, topk, meta, out, d.scale, block_t=self._attn_block_t,
                                         tiles=self._attn_rows)

    def _dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """FALLBACK dense causal GQA of layer ``layer`` (see the module docstring)."""
        dense_attention_triton(q, self.cache.k_cache[layer], self.cache.v_cache[layer], self.meta, out,
                               self.dims.scale, graph_safe=self.uniform_decode)

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        # The tile buffers are read by prefill splices only, which never run inside a graph.
        return {"topk_buf": self.topk_buf}


__all__ = ["TritonAttention"]
