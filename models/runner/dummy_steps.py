"""Dummy steps for warm-up, capture and the checks, on the KV cache's capture reserve.

A dummy step of ``rows`` tokens runs on private requests whose block-table rows and pages the
cache sets aside (``KVCacheConfig.capture_rows/capture_pages``): live requests' rows and pages
are never used, so a recapture while serving at full capacity touches nothing of theirs.
Every token of a dummy step sits at its own position of the shared capture pages (token ``g``
at capture position ``g``), so no two tokens write one slot, and each request reads only
positions this step wrote.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

from graphcap import GraphKey, Purpose, Step
from kvcache.paged import PagedKVCache
from steps import TokenChunk

DUMMY = "__graphcap_dummy__"


def fit_windows(spans: list[tuple[int, int]], page_size: int, max_seq_len: int) -> list[tuple[int, int]]:
    """Split ``(first capture position, tokens)`` spans so each fits one request: a request
    starting at position ``g`` sees capture pages from ``g // page_size`` on, ``max_seq_len``
    positions in all."""
    out = []
    for g, m in spans:
        while m > 0:
            take = min(m, max_seq_len - g % page_size)
            out.append((g, take))
            g, m = g + take, m - take
    return out


def capture_reserve(max_tokens: int, max_seqs: int, page_size: int, max_seq_len: int) -> tuple[int, int]:
    """Block-table rows and pages ``DummySteps`` needs on the cache's capture reserve: a row per
    dummy request (a decode graph of ``max_seqs`` requests, or a piecewise graph's chunks) and a
    page per ``page_size`` capture positions (one per token)."""
    chunks = len(fit_windows([(0, max_tokens // 2), (max_tokens // 2, max_tokens - max_tokens // 2)],
                             page_size, max_seq_len))
    return max(max_seqs, chunks), -(-max(max_tokens, max_seqs) // page_size)


class DummySteps:
    """Builds dummy steps on ``cache``'s capture reserve with ``make_step`` (the runner's step
    builder: checks, reserves and writes metadata like any step).

    Args:
        cache: the paged cache (its capture reserve).
        max_seqs: the step's request capacity (a decode graph holds one token per request).
        vocab_size: token ids of validation data lie below it.
        make_step: ``make_step(chunks) -> Step``.
    """

    def __init__(self, cache: PagedKVCache, max_seqs: int, vocab_size: int,
                 make_step: Callable[[Sequence[TokenChunk]], Step]) -> None:
        self.cache, self.max_seqs, self.vocab_size, self.make_step = cache, max_seqs, vocab_size, make_step
        self._requests: list[Hashable] = []

    def build(self, key: GraphKey, purpose: Purpose) -> Step:
        """A step of ``key.rows`` tokens over private requests (freed by the next ``build`` or by
        ``release``).

        ``Purpose.CAPTURE``: token 0, every row real (a decode graph: request ``i`` at capture
        position ``i``; a piecewise graph of >= 3 rows with ``max_seqs >= 2``: a chunk and a
        one-token request, the mix a serving step has, so the warm-up builds the eager
        splices' kernels for both).
        ``Purpose.VALIDATE``: random tokens, other positions (reversed, from the top), two
        chunks for a piecewise graph, every row real.
        ``Purpose.FROZEN_CHECK``: validation data with a quarter fewer real tokens, so that a
        host value of the step baked into a graph differs from the capture's.

        Raises:
            ValueError: a decode graph above ``max_seqs``.
            RuntimeError: the cache's capture reserve is too small for the step.
        """
        self.release()
        rows = key.rows
        if key.decode and rows > self.max_seqs:
            raise ValueError(f"a decode graph of {rows} tokens needs {rows} requests but max_seqs={self.max_seqs}; "
                             f"keep decode-graph buckets <= max_seqs")
        other = purpose is not Purpose.CAPTURE
        n = max(1, rows - rows // 4) if purpose is Purpose.FROZEN_CHECK else rows
        if key.decode:
            spans = [(i if not other else rows - 1 - i, 1) for i in range(n)]  # request i at capture position i
        else:
            if other:
                cuts = [0, n] if n < 2 else [0, n // 2, n]
            else:
                cuts = [0, n - 1, n] if n >= 3 and self.max_seqs >= 2 else [0, n]
            spans = [(a, b - a) for a, b in zip(cuts, cuts[1:])]
        ps = self.cache.page_size
        spans = fit_windows(spans, ps, self.cache.config.max_seq_len)
        gen = torch.Generator().manual_seed(rows * 2 + list(Purpose).index(purpose))
        c = self.cache.config
        chunks = []
        for i, (g, m) in enumerate(spans):
            sid = (DUMMY, i)
            try:
                self.cache.add_capture_sequence(sid, g // ps, g % ps)
            except (RuntimeError, ValueError) as e:
                self.release()
                raise RuntimeError(
                    f"the KV cache's capture reserve (capture_rows={c.capture_rows}, capture_pages={c.capture_pages}) "
                    f"cannot hold the dummy step of graph {key}: {e}. Build the cache with "
                    f"capture_reserve(max_tokens, max_seqs, page_size, max_seq_len) rows and pages"
                ) from None
            self._requests.append(sid)
            ids = torch.randint(0, self.vocab_size, (m,), generator=gen) if other else [0] * m
            chunks.append(TokenChunk(sid, g % ps, ids))
        return self.make_step(chunks)

    @property
    def alive(self) -> bool:
        """Whether requests made by ``build`` are still in the cache."""
        return bool(self._requests)

    def release(self) -> None:
        """Free the requests ``build`` made."""
        for sid in self._requests:
            self.cache.free(sid)
        self._requests = []


__all__ = ["DUMMY", "DummySteps", "capture_reserve", "fit_windows"]
