"""graphcap: CUDA graphs for sparse long-context models.

Request-independent producers are captured as CUDA graph segments per token-count bucket;
request-dependent ops (declared with ``@splice``) run eagerly between them with this step's
metadata, or inside a whole decode graph when they are graph-safe for its bucket.
"""

from .buckets import Padding, bucket_for, bucket_list, default_buckets, padding, whole_graph_buckets
from .config import CaptureConfig
from .guard import CaptureViolation
from .manager import CaptureManager
from .splice import Step, current_padding, current_step, splice, step_context
from .static import InputSpec, StaticInputs

__all__ = [
    "CaptureConfig",
    "CaptureManager",
    "CaptureViolation",
    "InputSpec",
    "Padding",
    "StaticInputs",
    "Step",
    "bucket_for",
    "bucket_list",
    "current_padding",
    "current_step",
    "default_buckets",
    "padding",
    "splice",
    "step_context",
    "whole_graph_buckets",
]
