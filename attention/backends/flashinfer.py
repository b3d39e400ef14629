"""The flashinfer backend: flashinfer dense paged attention, Triton sparse attention.

Dense layers (MiniMax-M3 layers 0..2) run ``FlashinferDenseAttention``; sparse layers are
delegated to the Triton backend (``attention.triton_backend.TritonAttention``), falling back
to the plain-torch reference with a warning when that backend cannot be imported.

Selection (``backend.make_backend``): ``"auto"`` tries ``AUTO_ORDER = ("flashinfer",
"triton")`` on a CUDA cache; this class raises ``ImportError`` without flashinfer and
``RuntimeError`` off CUDA, so auto falls through to Triton, and to torch on CPU.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from graphcap.splice import splice

from attention.base import AttentionBackend, TorchAttention
from attention.backends.flashinfer_dense import FlashinferDenseAttention, import_flashinfer
from kvcache.paged import PagedKVCache
from attention.metadata import AttentionMetadata


def _sparse_backend(cache: PagedKVCache, dims: dict) -> AttentionBackend:
    """The Triton sparse backend, or the torch reference when Triton's is missing."""
    try:
        from .triton_backend import TritonAttention
    except ImportError as e:
        warnings.warn(
            f"attention.triton_backend is unavailable ({e}); the flashinfer backend's sparse layers fall back "
            f"to the torch reference, which is slow and not graph-safe for decode",
            stacklevel=3,
        )
        return TorchAttention(cache, **dims)
    return TritonAttention(cache, **dims)


class FlashinferAttention(AttentionBackend):
    """flashinfer dense attention plus the Triton sparse path.

    Takes ``AttentionBackend``'s arguments, plus (keyword-only) ``decode_batch_sizes``,
    ``prefill_backend`` and ``workspace_bytes`` of ``FlashinferDenseAttention``. For whole
    decode graphs, ``decode_batch_sizes`` must hold the capture buckets of decode steps (the
    default is graphcap's default buckets up to ``max_tokens``).

    Raises:
        ImportError: flashinfer is not installed (before anything is allocated).
        RuntimeError: the cache is not on CUDA.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        num_qo_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        topk: int = 16,
        block_size: int | None = None,
        scale: float | None = None,
        max_tokens: int = 512,
        *,
        decode_batch_sizes: Sequence[int] | None = None,
        prefill_backend: str = "fa2",
        workspace_bytes: int = 128 << 20,
    ) -> None:
        import_flashinfer()  # fail first, so "auto" moves on without allocating anything
        if cache.block_tables.device.type != "cuda":
            raise RuntimeError(f"the flashinfer backend needs a CUDA cache, got {cache.block_tables.device}; use 'torch' on CPU")
        dims = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, topk=topk,
                    block_size=block_size, scale=scale, max_tokens=max_tokens)
        super().__init__(cache, **dims)
        self.dense_impl = FlashinferDenseAttention(
            cache, num_qo_heads, scale=self.scale, max_tokens=max_tokens, decode_batch_sizes=decode_batch_sizes,
            prefill_backend=prefill_backend, workspace_bytes=workspace_bytes,
        )
        self.sparse_impl = _sparse_backend(cache, dims)
        self.topk_buf = self.sparse_impl.topk_buf  # the buffer the sparse path really fills

    def plan(self, meta: AttentionMetadata) -> None:
        """Host work for this step: the flashinfer plan (dense) and the sparse backend's plan."""
        super().plan(meta)
        self.dense_impl.plan(meta)
        self.sparse_impl.plan(meta)

    def warmup(self) -> None:
        """JIT-compile flashinfer and make its decode wrappers; call before any capture."""
        self.dense_impl.warmup()

    @splice("attention.dense", graph_safe_decode=True)
    def dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """Causal GQA. q, out: ``[T, num_qo_heads, head_dim]``.

        Graph-safe for uniform decode: a decode bucket planned with ``meta.pad_to(bucket)``
        runs a CUDA-graph-mode flashinfer wrapper whose plan lives in fixed device buffers.
        """
        self.dense_impl.run(layer, q, out)

    def sparse(self, layer: int, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor) -> None:
        """Index top-k + block-sparse GQA, by the sparse backend.

        Not decorated here: the delegate's own ``sparse`` is the splice point, so its declared
        graph-safety is the one graphcap sees.
        """
        self.sparse_impl.sparse(layer, q, iq, out)


# The name backend.py's (commented) registry entry uses.
FlashInferAttention = FlashinferAttention
