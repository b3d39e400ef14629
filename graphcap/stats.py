"""Counters the manager keeps: per graph and per manager. Measured, never asserted."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.deprecation import warn_renamed

from .buckets import GraphKey


@dataclass
class GraphStats:
    """One graph of the manager (captured, skipped or dropped).

    ``status`` is ``captured``, ``dropped`` (failed validation, a frozen host value, or an
    audit mismatch while serving), ``skipped`` (a decode graph whose splices are not
    graph-safe) or ``eager`` (debug-eager mode: the padded path runs eagerly).
    """

    key: GraphKey
    status: str = "pending"
    reason: str = ""
    hits: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    capture_ms: float = 0.0
    memory_mib: float = 0.0
    segments: int = 0
    splices: int = 0
    audits: int = 0

    @property
    def padding_waste(self) -> float:
        """Fraction of replayed rows that were padding."""
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0


@dataclass(frozen=True)
class AuditFinding:
    """One audited step whose replay differed from the padded eager run (``graphcap.verify.audit``).

    Attributes:
        key: the graph (dropped from then on).
        step: the manager's step counter at the audit.
        num_tokens, num_seqs: the step's real sizes.
        max_abs_diff: the largest absolute difference between the two outputs.
        splices: the splice points the eager run passed through, in order (deduplicated).
    """

    key: GraphKey
    step: int
    num_tokens: int
    num_seqs: int
    max_abs_diff: float
    splices: tuple[str, ...]

    def describe(self) -> str:
        return (f"graph {self.key} at step {self.step} ({self.num_tokens} tokens, {self.num_seqs} requests): replay "
                f"differs from padded eager by up to {self.max_abs_diff:.3g}; splices {', '.join(self.splices) or '-'}")


@dataclass
class CaptureStats:
    """Manager-wide counters."""

    buckets: dict[GraphKey, GraphStats] = field(default_factory=dict)
    eager_steps: int = 0  # steps the mode runs eagerly (mode none; non-decode steps in mode decode)
    fallbacks: int = 0  # steps above the capture ceiling, run eagerly
    dropped_fallbacks: int = 0  # steps whose graph was dropped or skipped, run eagerly
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
    # Audits while serving (CaptureConfig.audit_every).
    audits: int = 0
    audit_s: float = 0.0  # host time of the audits' eager runs and comparisons (they sync)
    audit_findings: list[AuditFinding] = field(default_factory=list)

    def count_eager(self, by_mode: bool, above_ceiling: bool) -> None:
        """Count a step that ran eagerly: its mode runs such steps eagerly, it is above the
        graphs' ceiling, or else its graph was skipped or dropped."""
        if by_mode:
            self.eager_steps += 1
        elif above_ceiling:
            self.fallbacks += 1
        else:
            self.dropped_fallbacks += 1

    def graph(self, key: GraphKey) -> GraphStats:
        """The stats of graph ``key`` (created on first use)."""
        key = GraphKey(*key)
        if key not in self.buckets:
            self.buckets[key] = GraphStats(key)
        return self.buckets[key]

    def bucket(self, bucket: int, full: bool) -> GraphStats:
        """Deprecated spelling of ``graph(GraphKey(bucket, full))``."""
        warn_renamed("CaptureStats.bucket(bucket, full)", "CaptureStats.graph(GraphKey(rows, decode))")
        return self.graph(GraphKey(bucket, full))

    @property
    def audit_mismatches(self) -> int:
        return len(self.audit_findings)
