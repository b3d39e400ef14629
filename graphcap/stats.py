"""Counters the manager keeps: per bucket and per manager. Measured, never asserted."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BucketStats:
    """One captured (or skipped) bucket.

    ``status`` is ``captured``, ``dropped`` (failed validation), ``skipped`` (e.g. a whole
    decode graph whose splices are not graph-safe) or ``eager`` (debug-eager mode).
    """

    bucket: int
    full: bool
    status: str = "pending"
    reason: str = ""
    hits: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    capture_ms: float = 0.0
    memory_mib: float = 0.0
    segments: int = 0
    splices: int = 0

    @property
    def padding_waste(self) -> float:
        """Fraction of replayed rows that were padding."""
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0


@dataclass
class CaptureStats:
    """Manager-wide counters."""

    buckets: dict[tuple[int, bool], BucketStats] = field(default_factory=dict)
    eager_steps: int = 0  # steps the mode runs eagerly (mode none; non-decode steps in mode decode)
    fallbacks: int = 0  # steps above the capture ceiling, run eagerly
    dropped_fallbacks: int = 0  # steps whose bucket was dropped or skipped, run eagerly
    invalidations: int = 0
    recaptures: int = 0
    capture_ms: float = 0.0  # sum of the graphs' capture times
    memory_mib: float = 0.0  # sum of the graphs' memory (device memory each capture took)
    pool_mib: float = 0.0  # the graph pool's size after the last capture
    # Start-up phases of the last capture, in seconds (see CaptureManager.capture).
    jit_s: float = 0.0
    warmup_s: float = 0.0
    capture_s: float = 0.0
    validate_s: float = 0.0
    frozen_s: float = 0.0

    def bucket(self, bucket: int, full: bool) -> BucketStats:
        key = (bucket, full)
        if key not in self.buckets:
            self.buckets[key] = BucketStats(bucket, full)
        return self.buckets[key]
