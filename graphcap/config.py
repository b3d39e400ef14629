"""CaptureConfig: the one object a user flips to turn CUDA graphs on."""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass, fields, replace
from typing import Mapping

from common.values import int_tuple, is_int

# GRAPHCAP_* variables that are not CaptureConfig fields (read elsewhere: the cache directory,
# the Triton kernels' programmatic dependent launch, attention.kernels.pdl), so from_env does not
# warn about them.
OTHER_ENV_VARS = frozenset({"GRAPHCAP_CACHE_DIR", "GRAPHCAP_PDL"})

# What a config captures (``CaptureConfig.mode``), from nothing to everything.
MODES = ("none", "decode", "piecewise", "full_and_piecewise")


@dataclass(frozen=True)
class CaptureConfig:
    """How graphcap captures and replays a forward.

    ``mode`` says which steps replay graphs; ``enabled=True`` is the one-flag shorthand for the
    default mode, ``full_and_piecewise``. An explicit ``mode`` decides on its own (``enabled`` is
    then ignored; ``graph_mode`` is the resolved value every part of graphcap reads):

    - ``none``: every step eager (the same code path, unpadded);
    - ``decode``: decode graphs for uniform decode steps only; every other step eager (the
      baseline serving stacks had before producer graphs);
    - ``piecewise``: piecewise graphs (producers captured, attention eager between the
      pieces) for every bucket, decode steps included;
    - ``full_and_piecewise``: decode graphs (vLLM's "full" graphs: the whole forward) for
      uniform decode steps whose splices are graph-safe, piecewise graphs for the other steps.

    Attributes:
        enabled: shorthand: True means ``mode="full_and_piecewise"`` when ``mode`` is not given.
        mode: one of ``MODES`` (see above); ``None`` takes it from ``enabled``.
        max_tokens: the capture ceiling; steps with more tokens run eagerly and are counted.
        buckets: piecewise-graph buckets (token counts; any iterable of ints, stored as a sorted
            unique tuple, last <= max_tokens). ``None`` derives them (``graphcap.buckets``): the
            default geometric buckets above the largest decode graph, since uniform decode
            steps of that size replay decode graphs and the rare small mixed step pads up.
        decode_buckets: decode-graph buckets (one token per request, so each <= the request
            capacity). ``None``: the explicit ``buckets`` up to the request capacity, or the
            default geometric buckets up to it.
        validate: compare graph replay with eager per bucket after capture; failing buckets are
            dropped (run eagerly) and reported.
        debug_eager: run every step eagerly through the same padded segment/splice path (no
            graphs); this is what CPU machines exercise.
        detect_frozen: with ``validate``, also capture every bucket a second time on other dummy
            data and compare the two captures' kernel nodes (``graphcap.verify.frozen``); a parameter
            that differs is a host value frozen into the graph and drops the bucket.
        warmup_steps: eager runs per graph before capture (allocator and lazy-init warm-up; JIT
            builds and kernel tuning run before them, in the capture source's ``prebuild``).
        recapture_on_invalidation: when registered storage moves, recapture into a fresh pool;
            False raises instead.
        guard_producers: check producer code for host syncs and CPU-tensor reads during warm-up,
            capture and debug-eager runs (``graphcap.guard``). Turn it off only for producers the
            guard would disable: ``torch.compile``d code runs eagerly, op by op, under any
            dispatch mode. Step-metadata reads from producer code are refused either way.
        audit_every: while serving, one graph step in ``audit_every`` (0: never) runs again
            through the padded eager path of the same padding decision before its output is
            returned; outputs must agree bit for bit (``graphcap.verify.audit``). A mismatch drops
            the graph (its steps run eagerly from then on), is counted and reported, and the
            step returns the eager result.
        audit_seed: which step of each window of ``audit_every`` is audited comes from a
            generator seeded with this, so a run's audits are reproducible.
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
    audit_every: int = 0
    audit_seed: int = 0

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
        for name in ("audit_every", "audit_seed"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"CaptureConfig.{name} must be an int >= 0 (audit_every=0: no audits), "
                                 f"got {getattr(self, name)!r}")
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
    def decode_graphs(self) -> bool:
        """Whether uniform decode steps get decode graphs."""
        return self.graph_mode in ("decode", "full_and_piecewise")

    @property
    def piecewise_graphs(self) -> bool:
        """Whether steps other than decode-graph decodes get piecewise graphs."""
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
    def from_env(cls, base: "CaptureConfig | None" = None,
                 environ: Mapping[str, str] | None = None) -> "CaptureConfig":
        """Override fields from ``GRAPHCAP_<FIELD>`` variables (e.g. ``GRAPHCAP_ENABLED=1``,
        ``GRAPHCAP_BUCKETS=1,2,4,8``, ``GRAPHCAP_AUDIT_EVERY=1000``). Read when called, never at
        import; ``environ`` defaults to ``os.environ``.

        Raises:
            ValueError: a value that does not parse, or one that parses but is out of range,
                naming the variable.
        Warns:
            UserWarning: a ``GRAPHCAP_*`` variable that is no field (any case: variable names
                are upper case), naming the closest one.
        """
        env = os.environ if environ is None else environ
        base = base or cls()
        names = {f"GRAPHCAP_{f.name.upper()}": f.name for f in fields(cls)}
        known = [*names, *OTHER_ENV_VARS]
        for var in sorted(env):
            if var.upper().startswith("GRAPHCAP_") and var not in names and var not in OTHER_ENV_VARS:
                if var.upper() in known:
                    hint = f"; variable names are upper case: {var.upper()}"
                else:
                    close = difflib.get_close_matches(var.upper(), known, n=1)
                    hint = f"; did you mean {close[0]}?" if close else ""
                warnings.warn(f"{var} is not a graphcap setting and is ignored{hint}", stacklevel=2)
        given = {var: name for var, name in names.items() if var in env}
        updates = {name: _parse_env(var, env[var], getattr(base, name)) for var, name in given.items()}
        try:
            return replace(base, **updates)
        except ValueError as e:
            # Name the variable whose value alone is refused; else every variable set (the
            # values disagree with each other, e.g. buckets above max_tokens).
            culprits = [var for var, name in given.items() if not _accepted(base, name, updates[name])]
            shown = ", ".join(f"{var}={env[var]!r}" for var in (culprits or given))
            raise ValueError(f"{e} (set through the environment: {shown})") from None


def _parse_env(var: str, raw: str, current: object) -> object:
    """The value of ``GRAPHCAP_*`` variable ``var`` for a field whose current value is ``current``.

    Raises:
        ValueError: naming the variable and what it should look like.
    """
    text = raw.strip()
    name = var.removeprefix("GRAPHCAP_").lower()
    if name in ("buckets", "decode_buckets"):
        try:
            return tuple(int(x) for x in text.split(",") if x.strip()) or None
        except ValueError:
            raise ValueError(f"{var}={raw!r} is not a comma-separated list of ints") from None
    if name == "mode":
        return text or None
    if isinstance(current, bool):
        if text.lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(f"{var}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")
        return text.lower() in ("1", "true", "yes", "on")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not an int") from None


def _accepted(base: CaptureConfig, name: str, value: object) -> bool:
    """Whether ``base`` with only ``name`` changed to ``value`` is a valid config."""
    try:
        replace(base, **{name: value})
    except ValueError:
        return False
    return True
