"""Attention for graphcap models: paged caches, step metadata, reference maths, backends."""

from .backend import AttentionBackend, TorchAttention, make_backend
from .kv_cache import KVCacheConfig, PagedKVCache
from .metadata import AttentionMetadata, MetadataBuilder, RequestChunk

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCacheConfig",
    "MetadataBuilder",
    "PagedKVCache",
    "RequestChunk",
    "TorchAttention",
    "make_backend",
]
