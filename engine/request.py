"""A request and its life in the engine: waiting, running, finished or failed."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Hashable

from common.values import as_int, integer_items

from .sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    """What a client asks for.

    Attributes:
        request_id: unique among live requests (also the runner's sequence id).
        prompt: token ids (at least one).
        max_new_tokens: tokens to generate at most (>= 1).
        sampling: how to pick each token (greedy by default).
        stop_token_ids: generating one of these finishes the request (it is kept in the output).
        arrival_s: seconds after the workload's start when the request arrives (open-loop runs).
    """

    request_id: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        # Token ids and counts from NumPy arrays or tensors are integers to a user: accepted and
        # stored as Python ints; floats and bools are refused, never truncated.
        rid = self.request_id
        object.__setattr__(self, "prompt", integer_items(f"request {rid!r}: prompt", self.prompt, "integer token id"))
        stop = integer_items(f"request {rid!r}: stop_token_ids", self.stop_token_ids, "integer token id")
        object.__setattr__(self, "stop_token_ids", frozenset(stop))
        n = as_int(self.max_new_tokens)
        if n is None or n < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        object.__setattr__(self, "max_new_tokens", n)
        if not isinstance(self.arrival_s, (int, float)) or not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"request {self.request_id!r}: arrival_s must be a finite number >= 0, "
                             f"got {self.arrival_s!r}")

    @property
    def max_len(self) -> int:
        """Positions the request may write: the prompt and every generated token but the last."""
        return len(self.prompt) + self.max_new_tokens - 1


class Status(enum.Enum):
    WAITING = "waiting"  # submitted, no cache row yet
    RUNNING = "running"  # admitted: prefilling or decoding
    FINISHED = "finished"  # max_new_tokens reached or a stop token generated
    FAILED = "failed"  # refused or failed; ``error`` says why


@dataclass(eq=False)
class RequestState:
    """The engine's bookkeeping of one request (times from the engine's clock, seconds).

    Attributes:
        prefilled: prompt tokens already sent to the model.
        output: generated tokens the host has seen.
        scheduled: tokens steps already launched will generate (seen or still in flight).
        in_flight: launched steps holding this request that have not completed; its cache row
            is freed only when this is 0, so no step in flight can read a reused page.
        has_row: the runner holds a cache row for it.
        reserved_pages: KV pages set aside for it at admission (its whole length).
        pending: (step id, row) of its newest sampled token while the host has not seen it.
    """

    request: Request
    status: Status = Status.WAITING
    error: str | None = None
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    scheduled: int = 0
    in_flight: int = 0
    has_row: bool = False
    reserved_pages: int = 0
    pending: tuple[int, int] | None = None
    t_submit: float = 0.0
    t_admit: float | None = None
    t_first: float | None = None
    t_done: float | None = None

    @property
    def id(self) -> Hashable:
        return self.request.request_id

    @property
    def prompt_done(self) -> bool:
        return self.prefilled == len(self.request.prompt)

    @property
    def stopped(self) -> bool:
        """Finished or failed: nothing more is scheduled for it."""
        return self.status in (Status.FINISHED, Status.FAILED)

    @property
    def wants_decode(self) -> bool:
        """Running, prompt sent, and more tokens to schedule."""
        return (self.status is Status.RUNNING and self.prompt_done
                and self.scheduled < self.request.max_new_tokens)


__all__ = ["Request", "RequestState", "Status"]
