"""CaptureConfig: the one object a user flips to turn CUDA graphs on."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class CaptureConfig:
    """How graphcap captures and replays a forward.

    Attributes:
        enabled: capture and replay graphs; False runs every step eagerly (same code path).
        max_tokens: the capture ceiling; steps with more tokens run eagerly and are counted.
        buckets: explicit token-count buckets (sorted, unique, last <= max_tokens); ``None``
            uses the default rule of ``graphcap.buckets.default_buckets``.
        full_graph_decode: capture uniform decode steps as one whole graph when every splice
            point they pass through declares itself graph-safe for decode.
        full_graph_max_tokens: largest bucket captured as a whole decode graph (``None``: all
            buckets). A model whose decode steps carry one token per request sets it to its
            request capacity.
        validate: compare graph replay with eager per bucket after capture; failing buckets are
            dropped (run eagerly) and reported.
        debug_eager: run every step eagerly through the same segment/splice path (no graphs);
            this is what CPU machines exercise.
        warmup_steps: eager runs per bucket before capture (Triton autotune, JIT, allocator).
        recapture_on_invalidation: when registered storage moves, recapture into a fresh pool;
            False raises instead.
    """

    enabled: bool = False
    max_tokens: int = 512
    buckets: tuple[int, ...] | None = None
    full_graph_decode: bool = True
    full_graph_max_tokens: int | None = None
    validate: bool = False
    debug_eager: bool = False
    warmup_steps: int = 2
    recapture_on_invalidation: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"CaptureConfig.max_tokens must be a positive int, got {self.max_tokens!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ValueError(
                f"CaptureConfig.warmup_steps must be >= 1 (Triton autotune and JIT must run before "
                f"capture), got {self.warmup_steps!r}"
            )
        if self.full_graph_max_tokens is not None and (
            not isinstance(self.full_graph_max_tokens, int) or self.full_graph_max_tokens < 1
        ):
            raise ValueError(
                f"CaptureConfig.full_graph_max_tokens must be a positive int or None, got {self.full_graph_max_tokens!r}"
            )
        if self.buckets is not None:
            if isinstance(self.buckets, list):
                object.__setattr__(self, "buckets", tuple(self.buckets))
            b = self.buckets
            if not b:
                raise ValueError("CaptureConfig.buckets must not be empty (use None for the default rule)")
            if any(not isinstance(x, int) or x < 1 for x in b):
                raise ValueError(f"CaptureConfig.buckets must hold positive ints, got {b!r}")
            if list(b) != sorted(set(b)):
                raise ValueError(f"CaptureConfig.buckets must be strictly increasing, got {b!r}")
            if b[-1] > self.max_tokens:
                raise ValueError(
                    f"CaptureConfig.buckets has {b[-1]} above max_tokens={self.max_tokens}; "
                    f"raise max_tokens or drop that bucket"
                )
        for f in ("enabled", "full_graph_decode", "validate", "debug_eager", "recapture_on_invalidation"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"CaptureConfig.{f} must be a bool, got {getattr(self, f)!r}")

    @classmethod
    def from_env(cls, base: "CaptureConfig | None" = None) -> "CaptureConfig":
        """Override fields from ``GRAPHCAP_<FIELD>`` variables (e.g. ``GRAPHCAP_ENABLED=1``,
        ``GRAPHCAP_BUCKETS=1,2,4,8``). Read when called, never at import."""
        base = base or cls()
        updates: dict[str, object] = {}
        for f in fields(cls):
            raw = os.environ.get(f"GRAPHCAP_{f.name.upper()}")
            if raw is None:
                continue
            current = getattr(base, f.name)
            if f.name == "buckets":
                updates[f.name] = tuple(int(x) for x in raw.split(",") if x.strip()) or None
            elif f.name == "full_graph_max_tokens":
                updates[f.name] = int(raw) if raw.strip() else None
            elif isinstance(current, bool):
                if raw.lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(f"GRAPHCAP_{f.name.upper()}={raw!r} is not a boolean")
                updates[f.name] = raw.lower() in ("1", "true", "yes", "on")
            else:
                try:
                    updates[f.name] = int(raw)
                except ValueError:
                    raise ValueError(f"GRAPHCAP_{f.name.upper()}={raw!r} is not an int") from None
        return replace(base, **updates)
