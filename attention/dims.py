"""AttentionDims: the shapes every attention backend of a model shares, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from common.values import is_int
from kvcache.paged import PagedKVCache


@dataclass(frozen=True)
class AttentionDims:
    """Attention shapes (flashinfer's vocabulary).

    Attributes:
        num_qo_heads: query heads (a multiple of ``num_kv_heads``).
        num_kv_heads, head_dim: K/V heads and width; must match the cache's.
        topk: sparse blocks per (kv group, query token), forced local block included.
        block_size: sparse block size; must equal the cache page size.
        scale: softmax scale (``head_dim ** -0.5`` by default, see ``for_cache``).
        max_tokens: token capacity of one step (rows of the shared top-k buffer).
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    topk: int
    block_size: int
    scale: float
    max_tokens: int

    def __post_init__(self) -> None:
        for name in ("num_qo_heads", "num_kv_heads", "head_dim", "topk", "block_size", "max_tokens"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"AttentionDims.{name} must be a positive int, got {v!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads={self.num_qo_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if not self.scale > 0:
            raise ValueError(f"AttentionDims.scale must be > 0, got {self.scale!r}")

    @property
    def group_size(self) -> int:
        """q heads per kv head."""
        return self.num_qo_heads // self.num_kv_heads

    @classmethod
    def for_cache(cls, cache: PagedKVCache, num_qo_heads: int, topk: int, max_tokens: int,
                  scale: float | None = None) -> "AttentionDims":
        """Dims whose kv heads, head dim and block size are the cache's."""
        c = cache.config
        return cls(num_qo_heads, c.num_kv_heads, c.head_dim, topk, c.page_size,
                   c.head_dim ** -0.5 if scale is None else float(scale), max_tokens)

    def check_cache(self, cache: PagedKVCache) -> None:
        """Raise unless ``cache`` holds these kv heads, head dim and page size."""
        c = cache.config
        if (self.num_kv_heads, self.head_dim, self.block_size) != (c.num_kv_heads, c.head_dim, c.page_size):
            raise ValueError(
                f"attention num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, block_size={self.block_size} "
                f"must match the cache's {c.num_kv_heads}, {c.head_dim}, page_size={c.page_size}"
            )
