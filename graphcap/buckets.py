"""Token-count buckets: pure functions, no torch."""

from __future__ import annotations

from bisect import bisect_left

from .config import CaptureConfig


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


def bucket_list(config: CaptureConfig) -> tuple[int, ...]:
    """The buckets a config captures, ascending."""
    return config.buckets if config.buckets is not None else default_buckets(config.max_tokens)


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
