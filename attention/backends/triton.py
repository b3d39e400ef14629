"""TritonAttention: the attention backend built on this package's Triton kernels.

- ``sparse``: index top-k into the shared ``topk_buf``, then block-sparse GQA. Uniform decode
  steps, and any call made while a CUDA graph is being captured, take the graph-safe path
  (every row of ``q`` runs; positions, sequences, slots and block tables come from the
  metadata's persistent device buffers; grids depend on shapes only), so whole decode graphs
  may capture through it. Other steps take the prefill path, sized from host metadata.
- ``dense``: a FALLBACK Triton kernel (one token per program, split over key blocks): correct
  and graph-safe for decode, slow for long prefills. Prefer a dedicated dense backend
  (flashinfer) for the dense layers when one is available.

Registered in ``attention.backend.BACKENDS`` as ``"triton"`` (``attention.triton_backend:TritonAttention``).
"""

from __future__ import annotations

import torch

from graphcap.splice import splice

from attention.base import AttentionBackend
from attention.kernels.indexer import index_topk_decode, index_topk_prefill
from attention.kernels.sparse import dense_attention_triton, sparse_attention_decode, sparse_attention_prefill


class TritonAttention(AttentionBackend):
    """Triton kernels for index top-k and sparse attention (dense: Triton fallback).

    Same constructor as :class:`attention.backend.AttentionBackend`.
    """

    def _graph_safe(self) -> bool:
        """Take the graph-safe path: uniform decode steps, and anything run under capture (a
        prefill path there would freeze this step's host metadata into the graph; the
        graph-safe path is correct for any batch, only slower for long prefills)."""
        return self.meta.uniform_decode or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def _decode_rows(self, q: torch.Tensor) -> int:
        """Rows the graph-safe path launches: all of ``q`` (a decode bucket incl. padding)."""
        T = q.shape[0]
        cap = self.meta.buffers.positions.shape[0]
        if T > min(self.max_tokens, cap):
            raise ValueError(
                f"decode batch of {T} rows exceeds the backend's max_tokens={self.max_tokens} or the metadata "
                f"capacity {cap}; raise max_tokens / MetadataBuilder.max_tokens"
            )
        return T

    @splice("attention.sparse", graph_safe_decode=True)
    def sparse(self, layer: int, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor) -> None:
        """Index top-k + block-sparse GQA of sparse layer ``layer``.

        q, out: ``[T, num_qo_heads, head_dim]``; iq: ``[T, num_kv_heads, index_dim]``.
        """
        meta = self.meta
        ik = self.cache.index_k_cache[self.cache.sparse_index(layer)]
        kc, vc = self.cache.k_cache[layer], self.cache.v_cache[layer]
        if self._graph_safe():
            T = self._decode_rows(q)
            topk = self.topk_buf[:, :T]
            index_topk_decode(iq, ik, meta, self.topk, topk)
            sparse_attention_decode(q, kc, vc, topk, meta, out, self.scale)
        else:
            topk = self.topk_buf[:, : meta.num_tokens]
            # Token tiles share loaded tiles only within one sequence; in a batch of several
            # requests a tile would walk unrelated pages serially, so run one token per program.
            bt = None if meta.num_seqs == 1 else 1
            index_topk_prefill(iq, ik, meta, self.topk, topk, block_t=bt)
            sparse_attention_prefill(q, kc, vc, topk, meta, out, self.scale, block_t=bt)

    @splice("attention.dense", graph_safe_decode=True)
    def dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """FALLBACK dense causal GQA of layer ``layer`` (see the module docstring)."""
        meta = self.meta
        decode = self._graph_safe()
        if decode:
            self._decode_rows(q)
        dense_attention_triton(q, self.cache.k_cache[layer], self.cache.v_cache[layer], meta, out, self.scale,
                               graph_safe=decode)


__all__ = ["TritonAttention"]
