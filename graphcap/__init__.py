"""graphcap: CUDA graphs for sparse long-context models.

Request-independent producers are captured as CUDA graph segments per token-count bucket;
request-dependent ops (declared with ``@splice``) run eagerly between them with this step's
metadata, or inside a whole decode graph when they declare themselves graph-safe.
"""

from .buckets import bucket_for, bucket_list, default_buckets, padding
from .config import CaptureConfig
from .guard import CaptureViolation
from .manager import CaptureManager
from .splice import Step, current_step, splice
from .static import InputSpec, StaticInputs

__all__ = [
    "CaptureConfig",
    "CaptureManager",
    "CaptureViolation",
    "InputSpec",
    "StaticInputs",
    "Step",
    "bucket_for",
    "bucket_list",
    "current_step",
    "default_buckets",
    "padding",
    "splice",
]
