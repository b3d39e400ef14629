"""Token-count buckets, graph keys and the one padding decision per step: pure functions, no torch.

Two kinds of graph, one name each everywhere (code, stats, reports, docs):

- a **decode graph** records the whole forward of a uniform decode step (one token per
  request), its splices captured inside; ``CaptureConfig.decode_buckets`` lists their sizes
  (the mode ``full_and_piecewise`` says "full" for them, as vLLM does);
- a **piecewise graph** records the producers between splices as graph segments and runs the
  splices eagerly between them; ``CaptureConfig.buckets`` lists their sizes.

A ``GraphKey`` names one graph: its token rows and its kind.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from common.deprecation import module_aliases, warn_renamed
from common.values import is_int

from .config import CaptureConfig

DECODE, PIECEWISE = "decode", "piecewise"


class GraphKey(NamedTuple):
    """One graph of a manager: ``rows`` token rows, a decode graph (``decode=True``: the whole
    forward of a uniform decode step of ``rows`` requests) or a piecewise graph.

    ``str(key)`` is ``"64 decode"`` / ``"64 piecewise"`` (reports, the choice store)."""

    rows: int
    decode: bool = False

    @property
    def kind(self) -> str:
        """``"decode"`` or ``"piecewise"``."""
        return DECODE if self.decode else PIECEWISE

    def __str__(self) -> str:
        return f"{self.rows} {self.kind}"


def capture_order(keys: Iterable[GraphKey]) -> list[GraphKey]:
    """Largest rows first (one pool: the largest graph sets its size), the piecewise graph of a
    size before its decode graph."""
    return sorted(keys, key=lambda k: (-k.rows, k.decode))


def default_buckets(max_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then 2^k and 1.5 * 2^k up to ``max_tokens`` (always included).

    Geometric steps keep padding waste under a third of any step while the number of graphs
    grows only with log(max_tokens): 15 buckets for a ceiling of 512.
    """
    out: list[int] = []
    b = 1
    while b <= max_tokens:
        out.append(b)
        if b >= 8 and b + b // 2 <= max_tokens:
            out.append(b + b // 2)
        b *= 2
    if out[-1] != max_tokens:
        out.append(max_tokens)
    return tuple(sorted(set(out)))


def decode_graph_buckets(config: CaptureConfig, request_capacity: int | None = None) -> tuple[int, ...]:
    """The sizes captured as decode graphs (one token per request, so none above
    ``request_capacity``): ``config.decode_buckets``; else the explicit ``config.buckets`` up to
    the capacity; else the default geometric buckets up to it. Empty in mode ``piecewise``
    (mode ``none`` lists what enabling would capture; nothing replays).

    Raises:
        ValueError: an explicit ``decode_buckets`` entry above the request capacity.
    """
    if config.graph_mode == "piecewise":
        return ()
    limit = min(config.max_tokens, request_capacity or config.max_tokens)
    if config.decode_buckets is not None:
        over = [b for b in config.decode_buckets if b > limit]
        if over:
            raise ValueError(
                f"CaptureConfig.decode_buckets {over} exceed the request capacity {limit} (a decode graph of "
                f"b tokens holds b requests); drop them or raise max_seqs"
            )
        return config.decode_buckets
    if config.buckets is not None:
        return tuple(b for b in config.buckets if b <= limit)
    return default_buckets(limit)


def piecewise_graph_buckets(config: CaptureConfig, decode: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The piecewise-graph sizes, ascending: ``config.buckets``, or derived from the decode-graph
    sizes ``decode``; empty in mode ``decode`` (its other steps run eagerly).

    Derived: the default geometric buckets above ``max(decode)``. A step of at most that many
    tokens that is not a uniform decode (a short prompt, or a few decodes with a short chunk)
    pads into the smallest piecewise bucket; in serving such steps are rare (chunked prefill
    fills steps up to the token budget), and every piecewise graph costs capture time and
    memory. A decode graph that cannot be captured gets its piecewise graph back
    (``CaptureManager`` adds it).
    """
    if config.graph_mode == "decode":
        return ()
    if config.buckets is not None:
        return config.buckets
    top = max(decode, default=0)
    return tuple(b for b in default_buckets(config.max_tokens) if b > top) or (config.max_tokens,)


def eager_warmup_buckets(config: CaptureConfig, decode: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Sizes warmed up eagerly before capture returns, with no graph: in mode ``decode`` its
    other steps (prefill chunks, mixed steps) run eagerly at their own sizes, and a kernel
    specialised on a size range (a router config per power-of-two range, a prefill tile
    kernel) would otherwise compile or be validated on the first serving step that meets it,
    stalling every request. The sizes are those ``piecewise_graph_buckets`` would derive for
    mode ``full_and_piecewise`` (the default geometric buckets above ``max(decode)``), one per
    range a size-dependent choice could make, and at least ``max_tokens``: a warm-up step of a
    piecewise key mixes a chunk with a one-token request, so the prefill paths of the eager
    splices are built even where decode graphs cover every size. Empty in every other mode:
    their steps pad into piecewise graphs, whose warm-up builds the same kernels."""
    if config.graph_mode != "decode":
        return ()
    top = max(decode, default=0)
    return tuple(b for b in default_buckets(config.max_tokens) if b > top) or (config.max_tokens,)


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``num_tokens``; ``None`` above the ceiling (run eagerly)."""
    if num_tokens < 1:
        raise ValueError(f"a step needs at least one token, got num_tokens={num_tokens}")
    i = bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def padded_rows(num_tokens: int, bucket: int) -> int:
    """Padded rows a step of ``num_tokens`` carries in ``bucket``."""
    if num_tokens > bucket:
        raise ValueError(f"{num_tokens} tokens do not fit bucket {bucket}")
    return bucket - num_tokens


@dataclass(frozen=True)
class Padding:
    """How one step runs: the manager decides it once, and static inputs, metadata padding, the
    attention backends and kernel choices all read this one value.

    Attributes:
        num_tokens: real tokens of the step.
        num_seqs: real requests of the step.
        rows: token rows the forward sees (the bucket, or ``num_tokens`` when unpadded).
        request_rows: request rows the attention metadata presents. A decode graph is captured
            for a fixed batch, so its request rows are padded to the bucket (one token per
            request); a piecewise graph runs attention eagerly with this step's real requests,
            so ``request_rows == num_seqs`` there.
        decode_graph: the step replays (or, in debug-eager, mirrors) a decode graph.
        graph_size: ``rows`` is a size this manager captures graphs of. Kernel choices for it
            are timed (its kernels run inside graphs); other row counts, which a serving loop
            meets by the hundred, validate a default configuration only.
    """

    num_tokens: int
    num_seqs: int
    rows: int
    request_rows: int
    decode_graph: bool = False
    graph_size: bool = False

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_seqs", "rows", "request_rows"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"Padding.{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.num_tokens <= self.rows or not self.num_seqs <= self.request_rows:
            raise ValueError(f"padding below the real sizes: {self}")
        if self.decode_graph and not (self.num_tokens == self.num_seqs and self.rows == self.request_rows):
            raise ValueError(f"a decode graph runs one token per request: {self}")

    @property
    def padded(self) -> bool:
        """Whether any row is padding (a bucket larger than the step)."""
        return self.rows > self.num_tokens

    @property
    def whole_graph(self) -> bool:
        """Deprecated spelling of ``decode_graph``."""
        warn_renamed("Padding.whole_graph", "Padding.decode_graph")
        return self.decode_graph

    @classmethod
    def unpadded(cls, num_tokens: int, num_seqs: int, graph_size: bool = False) -> "Padding":
        """An eager run at the step's own size."""
        return cls(num_tokens, num_seqs, num_tokens, num_seqs, False, graph_size)

    @classmethod
    def for_graph(cls, num_tokens: int, num_seqs: int, key: GraphKey) -> "Padding":
        """A step run as graph ``key``: token rows padded to it; request rows too for a decode graph."""
        return cls(num_tokens, num_seqs, key.rows, key.rows if key.decode else num_seqs, key.decode, True)

    @classmethod
    def bucketed(cls, num_tokens: int, num_seqs: int, bucket: int, whole_graph: bool) -> "Padding":
        """Deprecated: ``Padding.for_graph(num_tokens, num_seqs, GraphKey(bucket, decode))``."""
        warn_renamed("Padding.bucketed", "Padding.for_graph(n, s, GraphKey(bucket, decode))")
        return cls.for_graph(num_tokens, num_seqs, GraphKey(bucket, whole_graph))


# Spellings of the previous release, served with a warning.
__getattr__ = module_aliases(__name__, {
    "whole_graph_buckets": ("decode_graph_buckets", lambda: decode_graph_buckets),
    "bucket_list": ("piecewise_graph_buckets", lambda: piecewise_graph_buckets),
    "padding": ("padded_rows", lambda: padded_rows),
})
