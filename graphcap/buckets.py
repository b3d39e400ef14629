"""Token-count buckets and the one padding decision per step: pure functions, no torch."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from .config import CaptureConfig, is_int


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


def whole_graph_buckets(config: CaptureConfig, request_capacity: int | None = None) -> tuple[int, ...]:
    """The buckets captured as whole decode graphs (one token per request, so none above
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
                f"CaptureConfig.decode_buckets {over} exceed the request capacity {limit} (a whole decode "
                f"graph of b tokens holds b requests); drop them or raise max_seqs"
            )
        return config.decode_buckets
    if config.buckets is not None:
        return tuple(b for b in config.buckets if b <= limit)
    return default_buckets(limit)


def bucket_list(config: CaptureConfig, whole: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The segmented-graph buckets, ascending: ``config.buckets``, or derived from the whole
    decode buckets ``whole``; empty in mode ``decode`` (its other steps run eagerly).

    Derived: the default geometric buckets above ``max(whole)``. A step of at most that many
    tokens that is not a uniform decode (a short prompt, or a few decodes with a short chunk)
    pads into the smallest segmented bucket; in serving such steps are rare (chunked prefill
    fills steps up to the token budget), and every segmented graph costs capture time and
    memory. A whole bucket that cannot be captured gets its segmented graph back
    (``CaptureManager`` adds it).
    """
    if config.graph_mode == "decode":
        return ()
    if config.buckets is not None:
        return config.buckets
    top = max(whole, default=0)
    return tuple(b for b in default_buckets(config.max_tokens) if b > top) or (config.max_tokens,)


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``num_tokens``; ``None`` above the ceiling (run eagerly)."""
    if num_tokens < 1:
        raise ValueError(f"a step needs at least one token, got num_tokens={num_tokens}")
    i = bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def padding(num_tokens: int, bucket: int) -> int:
    """Padded rows a step of ``num_tokens`` carries in ``bucket``."""
    if num_tokens > bucket:
        raise ValueError(f"{num_tokens} tokens do not fit bucket {bucket}")
    return bucket - num_tokens


@dataclass(frozen=True)
class Padding:
    """How one step runs: the manager decides it once, and static inputs, metadata padding and
    the attention backends all read this one value.

    Attributes:
        num_tokens: real tokens of the step.
        num_seqs: real requests of the step.
        rows: token rows the forward sees (the bucket, or ``num_tokens`` when unpadded).
        request_rows: request rows the attention metadata presents. A whole decode graph is
            captured for a fixed batch, so its request rows are padded to the bucket (one token
            per request); a segmented graph runs attention eagerly with this step's real
            requests, so ``request_rows == num_seqs`` there.
        whole_graph: the step replays (or, in debug-eager, mirrors) a whole decode graph.
    """

    num_tokens: int
    num_seqs: int
    rows: int
    request_rows: int
    whole_graph: bool = False

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_seqs", "rows", "request_rows"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"Padding.{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.num_tokens <= self.rows or not self.num_seqs <= self.request_rows:
            raise ValueError(f"padding below the real sizes: {self}")
        if self.whole_graph and not (self.num_tokens == self.num_seqs and self.rows == self.request_rows):
            raise ValueError(f"a whole decode graph runs one token per request: {self}")

    @property
    def padded(self) -> bool:
        """Whether any row is padding (a bucket larger than the step)."""
        return self.rows > self.num_tokens

    @classmethod
    def unpadded(cls, num_tokens: int, num_seqs: int) -> "Padding":
        """An eager run at the step's own size."""
        return cls(num_tokens, num_seqs, num_tokens, num_seqs, False)

    @classmethod
    def bucketed(cls, num_tokens: int, num_seqs: int, bucket: int, whole_graph: bool) -> "Padding":
        """A step run in ``bucket``: token rows padded to it; request rows too for a whole graph."""
        return cls(num_tokens, num_seqs, bucket, bucket if whole_graph else num_seqs, whole_graph)
