"""Attention for graphcap models: step metadata, reference maths, Triton kernels, backends."""

from .base import AttentionBackend, TorchAttention, make_backend
from .metadata import AttentionMetadata, MetadataBuilder, RequestChunk

__all__ = ["AttentionBackend", "AttentionMetadata", "MetadataBuilder", "RequestChunk", "TorchAttention", "make_backend"]
