"""CaptureConfig: the one object a user flips to turn CUDA graphs on."""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

# GRAPHCAP_* variables that are not CaptureConfig fields (read elsewhere), so from_env does
# not warn about them.
OTHER_ENV_VARS = frozenset({"GRAPHCAP_CACHE_DIR"})

# What a config captures (``CaptureConfig.mode``), from nothing to everything.
MODES = ("none", "decode", "piecewise", "full_and_piecewise")


def is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is an ``int`` to Python, never a size to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_tuple(name: str, value: object) -> tuple[int, ...]:
    """Any iterable of ints (tuple, list, range, generator) as a tuple.

    Raises:
        ValueError: a string, a non-iterable, or an element that is not an int, naming ``name``.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be an iterable of ints, got {value!r}")
    out = tuple(value)
    bad = [x for x in out if not is_int(x)]
    if bad:
        raise ValueError(f"{name} must hold ints, got {bad[0]!r} in {out!r}")
    return out


@dataclass(frozen=True)
class CaptureConfig:
    """How graphcap captures and replays a forward.

    ``mode`` says which steps replay graphs; ``enabled=True`` is the one-flag shorthand for the
    default mode, ``full_and_piecewise``. An explicit ``mode`` decides on its own (``enabled`` is
    then ignored; ``graph_mode`` is the resolved value every part of graphcap reads):

    - ``none``: every step eager (the same code path, unpadded);
    - ``decode``: whole graphs for uniform decode steps only; every other step eager (the
      baseline serving stacks had before producer graphs);
    - ``piecewise``: segmented graphs (producers captured, attention eager between segments)
      for every bucket, decode steps included;
    - ``full_and_piecewise``: whole graphs for uniform decode steps whose splices are
      graph-safe, segmented graphs for the other steps.

    Attributes:
        enabled: shorthand: True means ``mode="full_and_piecewise"`` when ``mode`` is not given.
        mode: one of ``MODES`` (see above); ``None`` takes it from ``enabled``.
        max_tokens: the capture ceiling; steps with more tokens run eagerly and are counted.
        buckets: segmented-graph buckets (token counts; any iterable of ints, stored as a sorted
            unique tuple, last <= max_tokens). ``None`` derives them (``graphcap.buckets``): the
            default geometric buckets above the largest whole decode graph, since uniform decode
            steps of that size replay whole graphs and the rare small mixed step pads up.
        decode_buckets: whole-decode-graph buckets (one token per request, so each <= the
            request capacity). ``None``: the explicit ``buckets`` up to the request capacity,
            or the default geometric buckets up to it.
        validate: compare graph replay with eager per bucket after capture; failing buckets are
            dropped (run eagerly) and reported.
        debug_eager: run every step eagerly through the same padded segment/splice path (no
            graphs); this is what CPU machines exercise.
        detect_frozen: with ``validate``, also capture every bucket a second time on other dummy
            data and compare the two captures' kernel nodes (``graphcap.frozen``); a parameter
            that differs is a host value frozen into the graph and drops the bucket.
        warmup_steps: eager runs per graph before capture (allocator and lazy-init warm-up; JIT
            builds and kernel tuning run before them, in the ``before_capture`` hook).
        recapture_on_invalidation: when registered storage moves, recapture into a fresh pool;
            False raises instead.
        guard_producers: check producer code for host syncs and CPU-tensor reads during warm-up,
            capture and debug-eager runs (``graphcap.guard``). Turn it off only for producers the
            guard would disable: ``torch.compile``d code runs eagerly, op by op, under any
            dispatch mode. Step-metadata reads from producer code are refused either way.
    """

    enabled: bool = False
    mode: str | None = None
    max_tokens: int = 512
    buckets: tuple[int, ...] | None = None
    decode_buckets: tuple[int, ...] | None = None
    validate: bool = False
    detect_frozen: bool = False
    debug_eager: bool = False
    warmup_steps: int = 1
    recapture_on_invalidation: bool = True
    guard_producers: bool = True

    def __post_init__(self) -> None:
        for f in ("enabled", "validate", "detect_frozen", "debug_eager",
                  "recapture_on_invalidation", "guard_producers"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"CaptureConfig.{f} must be a bool, got {getattr(self, f)!r}")
        if self.mode is not None and self.mode not in MODES:
            close = difflib.get_close_matches(str(self.mode), MODES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"CaptureConfig.mode must be one of {', '.join(MODES)} or None, got {self.mode!r}{hint}")
        if self.enabled and self.mode == "none":
            raise ValueError("CaptureConfig(enabled=True, mode='none') contradicts itself: drop enabled=True to run "
                             "eagerly, or pick a capturing mode")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"CaptureConfig.max_tokens must be a positive int, got {self.max_tokens!r}")
        if not is_int(self.warmup_steps) or self.warmup_steps < 1:
            raise ValueError(
                f"CaptureConfig.warmup_steps must be an int >= 1 (every graph runs eagerly before its "
                f"capture), got {self.warmup_steps!r}"
            )
        for name in ("buckets", "decode_buckets"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, self._check_buckets(name, getattr(self, name)))

    @property
    def graph_mode(self) -> str:
        """The resolved mode: ``mode`` if given, else ``full_and_piecewise`` when ``enabled``,
        else ``none``."""
        if self.mode is not None:
            return self.mode
        return "full_and_piecewise" if self.enabled else "none"

    @property
    def captures(self) -> bool:
        """Whether any step goes through graphs (or, in debug-eager, their padded path)."""
        return self.graph_mode != "none"

    @property
    def whole_decode_graphs(self) -> bool:
        """Whether uniform decode steps get whole graphs."""
        return self.graph_mode in ("decode", "full_and_piecewise")

    @property
    def segmented_graphs(self) -> bool:
        """Whether steps other than whole-graph decodes get segmented graphs."""
        return self.graph_mode in ("piecewise", "full_and_piecewise")

    def _check_buckets(self, name: str, value: object) -> tuple[int, ...]:
        b = int_tuple(f"CaptureConfig.{name}", value)
        if not b:
            raise ValueError(f"CaptureConfig.{name} must not be empty (use None for the default rule)")
        if any(x < 1 for x in b):
            raise ValueError(f"CaptureConfig.{name} must hold positive ints, got {b!r}")
        if list(b) != sorted(set(b)):
            raise ValueError(f"CaptureConfig.{name} must be strictly increasing, got {b!r}")
        if b[-1] > self.max_tokens:
            raise ValueError(
                f"CaptureConfig.{name} has {b[-1]} above max_tokens={self.max_tokens}; "
                f"raise max_tokens or drop that bucket"
            )
        return b

    @classmethod
    def from_env(cls, base: "CaptureConfig | None" = None) -> "CaptureConfig":
        """Override fields from ``GRAPHCAP_<FIELD>`` variables (e.g. ``GRAPHCAP_ENABLED=1``,
        ``GRAPHCAP_BUCKETS=1,2,4,8``). Read when called, never at import.

        Raises:
            ValueError: a value that does not parse, naming the variable.
        Warns:
            UserWarning: a ``GRAPHCAP_*`` variable that is no field, naming the closest one.
        """
        base = base or cls()
        names = {f"GRAPHCAP_{f.name.upper()}": f.name for f in fields(cls)}
        for var in sorted(os.environ):
            if var.startswith("GRAPHCAP_") and var not in names and var not in OTHER_ENV_VARS:
                close = difflib.get_close_matches(var, [*names, *OTHER_ENV_VARS], n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                warnings.warn(f"{var} is not a graphcap setting and is ignored{hint}", stacklevel=2)
        updates: dict[str, object] = {}
        for var, name in names.items():
            raw = os.environ.get(var)
            if raw is None:
                continue
            current = getattr(base, name)
            try:
                if name in ("buckets", "decode_buckets"):
                    updates[name] = tuple(int(x) for x in raw.split(",") if x.strip()) or None
                elif name == "mode":
                    updates[name] = raw.strip() or None
                elif isinstance(current, bool):
                    if raw.strip().lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                        raise ValueError(raw)
                    updates[name] = raw.strip().lower() in ("1", "true", "yes", "on")
                else:
                    updates[name] = int(raw)
            except ValueError:
                if name in ("buckets", "decode_buckets"):
                    what = "not a comma-separated list of ints"
                elif name == "mode":
                    updates[name] = raw.strip() or None
                elif isinstance(current, bool):
                    what = "not a boolean (use 1/0, true/false, yes/no, on/off)"
                else:
                    what = "not an int"
                raise ValueError(f"{var}={raw!r} is {what}") from None
        try:
            return replace(base, **updates)
        except ValueError as e:
            raise ValueError(f"{e} (set through GRAPHCAP_* environment variables)") from None
