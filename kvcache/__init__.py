"""Paged K/V and index-K caches: pages, block tables, sequence slots."""

from .paged import KVCacheConfig, PagedKVCache

__all__ = ["KVCacheConfig", "PagedKVCache"]
