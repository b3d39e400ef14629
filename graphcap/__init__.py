"""graphcap: CUDA graphs for sparse long-context models.

Request-independent producers are captured as piecewise graphs per token-count bucket;
request-dependent ops (declared with ``@splice``) run eagerly between the pieces with this
step's metadata, or inside a decode graph (the whole forward of a uniform decode step) when
they are graph-safe for its size. Capture core at the top level; ``graphcap.verify`` (checks
that graphs match eager), ``graphcap.startup`` (kernel choices, compile-ahead, JIT caches),
``graphcap.report`` (tables).
"""

from common.deprecation import module_aliases

from .buckets import (
    DECODE,
    PIECEWISE,
    GraphKey,
    Padding,
    bucket_for,
    decode_graph_buckets,
    default_buckets,
    padded_rows,
    piecewise_graph_buckets,
)
from .config import CaptureConfig
from .guard import CaptureViolation
from .manager import CaptureManager
from .source import CaptureSource, Prebuild, Purpose
from .splice import Step, current_padding, current_step, splice, step_context
from .splice_buffers import SpliceBuffers
from .static import InputSpec, StaticInputs

__all__ = [
    "DECODE",
    "PIECEWISE",
    "CaptureConfig",
    "CaptureManager",
    "CaptureSource",
    "CaptureViolation",
    "GraphKey",
    "InputSpec",
    "Padding",
    "Prebuild",
    "Purpose",
    "SpliceBuffers",
    "StaticInputs",
    "Step",
    "bucket_for",
    "current_padding",
    "current_step",
    "decode_graph_buckets",
    "default_buckets",
    "padded_rows",
    "piecewise_graph_buckets",
    "splice",
    "step_context",
]

# Spellings of the previous release, served with a warning.
__getattr__ = module_aliases(__name__, {
    "whole_graph_buckets": ("graphcap.decode_graph_buckets", lambda: decode_graph_buckets),
    "bucket_list": ("graphcap.piecewise_graph_buckets", lambda: piecewise_graph_buckets),
    "padding": ("graphcap.padded_rows", lambda: padded_rows),
})
