"""Which requests run in the next step: admission and the token budget.

Admission is bounded by two things the cache has: block-table rows (a step holds at most
``max_running`` generating requests, and the cache at most ``max_live_requests`` rows, which
also counts finished requests whose last step is still in flight: the headroom rule of
``kvcache.paged``), and KV pages. A request is admitted only when the pages of its whole
length (prompt plus ``max_new_tokens``) are free of every earlier admission's claim, so a
running request can never run out of pages and nothing is ever preempted.

A step takes every decoding request first (one token each: decode latency is what users
feel), then prompt chunks in admission order, each at most ``chunk_size`` tokens, until the
step holds ``token_budget`` tokens or ``max_seqs`` requests: chunked prefill mixed with
decodes in one step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.values import is_int

from .request import RequestState, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """Step composition limits (``None``: the runner's capacity).

    Attributes:
        token_budget: most tokens in one step (<= the runner's ``max_tokens``).
        chunk_size: most prompt tokens of one request in one step.
        max_running: most admitted, unfinished requests (<= the runner's ``max_seqs``).
    """

    token_budget: int | None = None
    chunk_size: int = 1024
    max_running: int | None = None

    def __post_init__(self) -> None:
        for name in ("token_budget", "chunk_size", "max_running"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"SchedulerConfig.{name} must be a positive int or None, got {v!r}")


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's part of a step: ``num_tokens`` tokens; ``samples``: its last token's
    logits give the request a new token (a decode, or the last chunk of the prompt)."""

    state: RequestState
    num_tokens: int
    samples: bool


class Scheduler:
    """Admission and step composition over one runner's capacity.

    Args:
        config: limits; resolved against ``max_tokens``, ``max_seqs``, ``max_live_requests``
            and ``num_pages``/``page_size`` of the runner.
    """

    def __init__(self, config: SchedulerConfig, *, max_tokens: int, max_seqs: int, max_live_requests: int,
                 num_pages: int, page_size: int) -> None:
        self.token_budget = config.token_budget or max_tokens
        self.max_running = config.max_running or max_seqs
        if self.token_budget > max_tokens:
            raise ValueError(f"SchedulerConfig.token_budget={self.token_budget} exceeds the runner's max_tokens="
                             f"{max_tokens}; lower it or build the runner with more")
        if self.max_running > max_seqs:
            raise ValueError(f"SchedulerConfig.max_running={self.max_running} exceeds the runner's max_seqs="
                             f"{max_seqs}; lower it or build the runner with more")
        self.chunk_size = config.chunk_size
        self.max_seqs = max_seqs
        self.max_live = max_live_requests
        self.num_pages = num_pages
        self.page_size = page_size
        self.claimed_pages = 0  # pages set aside for requests holding a cache row

    def pages_for(self, state: RequestState) -> int:
        """Pages the request's whole length needs."""
        return -(-state.request.max_len // self.page_size)

    def admit(self, waiting: deque[RequestState], running: list[RequestState], live: int) -> list[RequestState]:
        """Pop the waiting requests that fit now, in arrival order (first come, first served:
        a request that does not fit blocks the ones behind it, so none starves). ``live`` is
        the requests holding a cache row. The caller gives each a row."""
        out: list[RequestState] = []
        active = sum(1 for s in running if not s.stopped)
        while waiting and active < self.max_running and live < self.max_live:
            need = self.pages_for(waiting[0])
            if self.claimed_pages + need > self.num_pages:
                break
            state = waiting.popleft()
            state.reserved_pages = need
            self.claimed_pages += need
            out.append(state)
            active += 1
            live += 1
        return out

    def release(self, state: RequestState) -> None:
        """The request's row and pages went back to the cache."""
        self.claimed_pages -= state.reserved_pages
        state.reserved_pages = 0

    def compose(self, running: list[RequestState]) -> list[ScheduledChunk]:
        """The next step's chunks: decodes first, then prompt chunks under the budget."""
        chunks = [ScheduledChunk(s, 1, True) for s in running if s.wants_decode][: self.max_seqs]
        left = self.token_budget - len(chunks)
        for s in running:
            if left <= 0 or len(chunks) == self.max_seqs:
                break
            if s.status is not Status.RUNNING or s.prompt_done:
                continue
            rest = len(s.request.prompt) - s.prefilled
            n = min(rest, self.chunk_size, left)
            chunks.append(ScheduledChunk(s, n, n == rest))
            left -= n
        return chunks


__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig"]
