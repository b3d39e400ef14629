"""Attention for graphcap models: step metadata, the backend interface, reference maths,
Triton kernels and one backend per file (``attention/backends/``)."""

from .base import AttentionBackend
from .dims import AttentionDims
from .metadata import AttentionMetadata, MetadataBuilder
from .registry import BACKENDS, make_backend

__all__ = ["BACKENDS", "AttentionBackend", "AttentionDims", "AttentionMetadata", "MetadataBuilder", "make_backend"]
