"""Request lists and arrival processes for serving runs.

``make_requests`` draws prompt and output lengths uniformly from the given ranges (inclusive)
and random prompt tokens, from one seed, so several capture modes serve the very same list.
``serve`` drives an engine through it: closed loop (``concurrency`` requests in the system at
any time; a new one enters when one ends) or open loop (each request enters at its
``arrival_s``, e.g. Poisson arrivals at ``rate`` requests per second).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .engine import Engine
from .request import Request, RequestState
from .sampling import SamplingParams

GREEDY = SamplingParams()


def make_requests(num: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, *,
                  seed: int = 0, sampling: SamplingParams = GREEDY, rate: float | None = None,
                  prefix: str = "req") -> list[Request]:
    """``num`` requests with lengths uniform in the inclusive ranges; with ``rate``, Poisson
    arrival times (exponential gaps of mean ``1 / rate`` seconds), else all at 0.

    Raises:
        ValueError: an empty or non-positive range, or a non-positive rate.
    """
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {(lo, hi)}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate}")
    g = torch.Generator().manual_seed(seed)
    out, t = [], 0.0
    for i in range(num):
        n = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        m = int(torch.randint(output_len[0], output_len[1] + 1, (1,), generator=g))
        prompt = torch.randint(0, vocab_size, (n,), generator=g).tolist()
        if rate is not None:
            t += float(torch.empty(1).exponential_(rate, generator=g))
        out.append(Request(f"{prefix}{i}", tuple(prompt), m, sampling, arrival_s=t))
    return out


def serve(engine: Engine, requests: list[Request], *, concurrency: int | None = None,
          on_step: Callable[[Engine, list[RequestState]], None] | None = None) -> float:
    """Serve ``requests`` to the end; returns the wall seconds.

    Args:
        concurrency: closed loop with this many requests in the system; ``None``: open loop
            on the requests' ``arrival_s`` (the host sleeps while idle until the next one).
        on_step: called after every engine step with the requests that ended in it (progress
            bars, forced invalidations in soaks).
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    queue = sorted(requests, key=lambda r: r.arrival_s) if concurrency is None else list(requests)
    t0 = engine.clock()
    nxt, live = 0, 0
    while nxt < len(queue) or engine.has_work:
        if concurrency is None:
            elapsed = engine.clock() - t0
            while nxt < len(queue) and queue[nxt].arrival_s <= elapsed:
                live += engine.submit(queue[nxt]).stopped is False
                nxt += 1
            if not engine.has_work and nxt < len(queue):
                time.sleep(max(0.0, queue[nxt].arrival_s - (engine.clock() - t0)))
                continue
        else:
            while nxt < len(queue) and live < concurrency:
                live += engine.submit(queue[nxt]).stopped is False
                nxt += 1
            if not engine.has_work:
                continue
        ended = engine.step()
        live -= len(ended)
        if on_step is not None:
            on_step(engine, ended)
    return engine.clock() - t0


__all__ = ["make_requests", "serve"]
