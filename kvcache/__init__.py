"""Paged K/V and index-K caches: pages, block tables, block-table rows."""

from .paged import KVCacheConfig, PagedKVCache

__all__ = ["KVCacheConfig", "PagedKVCache"]
