"""Attention backends: the splice points the model calls, and how to pick one.

A backend owns nothing per step but the metadata ``plan`` hands it; every op writes into a
caller-owned ``out`` and returns ``None`` (the splice contract). The index top-k result lives
in one persistent buffer ``[num_kv_heads, max_tokens, topk]`` shared by all sparse layers, so
its address is fixed while graphs live.

Adding a backend: write ``class XAttention(AttentionBackend)`` in its own module and add
``"x": "attention.module_name:XAttention"`` to ``BACKENDS`` below (resolved lazily, so a
backend whose dependencies are missing only fails when asked for).
"""

from __future__ import annotations

import importlib

import torch

from graphcap.splice import splice

from attention.reference.dense import dense_attention_ref
from attention.reference.indexer import index_topk_ref
from kvcache.paged import PagedKVCache
from attention.metadata import AttentionMetadata
from attention.reference.sparse import sparse_attention_ref

# kind -> "module:Class". The registration point for other backends.
BACKENDS: dict[str, str] = {
    "torch": "attention.base:TorchAttention",
    "triton": "attention.backends.triton:TritonAttention",
    "flashinfer": "attention.backends.flashinfer:FlashinferAttention",
}
# What "auto" tries, in order, before falling back to "torch".
AUTO_ORDER: tuple[str, ...] = ("flashinfer", "triton")


class AttentionBackend:
    """Base: dims, the cache, the planned metadata and the shared top-k buffer.

    Args:
        cache: the paged cache the ops read.
        num_qo_heads: query heads (a multiple of ``num_kv_heads``).
        num_kv_heads: K/V heads; default the cache's.
        head_dim: default the cache's.
        topk: sparse blocks per (group, query).
        block_size: sparse block size; default (and must equal) the cache page size.
        scale: softmax scale; default ``head_dim ** -0.5``.
        max_tokens: token capacity of one step (rows of the top-k buffer).
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
    ) -> None:
        c = cache.config
        self.cache = cache
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = c.num_kv_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = c.head_dim if head_dim is None else head_dim
        self.topk = topk
        self.block_size = c.page_size if block_size is None else block_size
        self.scale = self.head_dim**-0.5 if scale is None else float(scale)
        self.max_tokens = max_tokens
        if self.num_kv_heads != c.num_kv_heads or self.head_dim != c.head_dim:
            raise ValueError(
                f"backend num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim} must match the cache's "
                f"{c.num_kv_heads}, {c.head_dim}"
            )
        if num_qo_heads < 1 or num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a positive multiple of num_kv_heads={self.num_kv_heads}")
        if self.block_size != c.page_size:
            raise ValueError(f"block_size={self.block_size} must equal the cache page_size={c.page_size}")
        if topk < 1 or max_tokens < 1:
            raise ValueError(f"topk and max_tokens must be >= 1, got topk={topk}, max_tokens={max_tokens}")
        self.topk_buf = torch.full((self.num_kv_heads, max_tokens, topk), -1, dtype=torch.int32,
                                   device=cache.block_tables.device)
        self._meta: AttentionMetadata | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        """Host work for this step (store metadata; subclasses also fill their buffers)."""
        if meta.num_tokens > self.max_tokens:
            raise ValueError(f"step has {meta.num_tokens} tokens but the backend holds max_tokens={self.max_tokens}")
        if meta.block_tables is not self.cache.block_tables:
            raise ValueError("metadata was built for a different cache than this backend's")
        self._meta = meta

    @property
    def meta(self) -> AttentionMetadata:
        if self._meta is None:
            raise RuntimeError("attention op called before plan(meta); plan every step before the forward")
        return self._meta

    def dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """Causal GQA. q, out: ``[T, num_qo_heads, head_dim]``; rows past num_tokens untouched."""
        raise NotImplementedError

    def sparse(self, layer: int, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor) -> None:
        """Index top-k into ``topk_buf``, then block-sparse GQA.

        q, out: ``[T, num_qo_heads, head_dim]``; iq: ``[T, num_kv_heads, index_dim]``.
        """
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """The plain-torch reference backend (host loops: not graph-safe for decode)."""

    @splice("attention.dense")
    def dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        dense_attention_ref(q, self.cache.k_cache[layer], self.cache.v_cache[layer], self.meta, out, self.scale)

    @splice("attention.sparse")
    def sparse(self, layer: int, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor) -> None:
        meta = self.meta
        s = self.cache.sparse_index(layer)
        topk = self.topk_buf[:, : meta.num_tokens]
        index_topk_ref(iq, self.cache.index_k_cache[s], meta, self.topk, self.block_size, topk)
        sparse_attention_ref(q, self.cache.k_cache[layer], self.cache.v_cache[layer], topk, meta, out,
                             self.scale, self.block_size)


def make_backend(kind: str, cache: PagedKVCache, **dims: object) -> AttentionBackend:
    """Build the backend ``kind`` (a key of ``BACKENDS``, or ``"auto"``) for ``cache``.

    ``dims`` are ``AttentionBackend``'s keyword arguments (num_qo_heads, topk, max_tokens...).
    ``"auto"`` picks the first of ``AUTO_ORDER`` that is registered and imports on a CUDA
    cache, else ``"torch"``.

    Raises:
        ValueError: unknown kind.
        RuntimeError: the backend's module could not be imported.
    """
    if kind == "auto":
        if cache.block_tables.device.type == "cuda":
            for k in AUTO_ORDER:
                if k in BACKENDS:
                    try:
                        return _resolve(k)(cache, **dims)
                    except (ImportError, RuntimeError):
                        continue
        kind = "torch"
    if kind not in BACKENDS:
        raise ValueError(f"unknown attention backend {kind!r}; choose one of {sorted(BACKENDS) + ['auto']}")
    return _resolve(kind)(cache, **dims)


def _resolve(kind: str) -> type[AttentionBackend]:
    module, _, name = BACKENDS[kind].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"attention backend {kind!r} ({BACKENDS[kind]}) is unavailable: {e}") from e
