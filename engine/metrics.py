"""Serving figures from an engine's requests and steps.

Per-user output throughput is what one user sees while their answer streams: tokens after
the first over the time they took, ``(n - 1) / (t_last - t_first)`` (1 / TPOT). TTFT is from
submission to the first token the host read. Times are the engine's clock at the moment the
host saw the token (with overlap, one step after the GPU produced it).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from .engine import Engine
from .request import RequestState, Status


def _pct(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    x = q * (len(v) - 1)
    lo = int(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


def request_figures(states: Iterable[RequestState]) -> dict[str, Any]:
    """Per-user tok/s (mean, p50, p10), TTFT (p50, p99, seconds), TPOT (mean, ms), counts."""
    done = [s for s in states if s.status is Status.FINISHED]
    failed = [s for s in states if s.status is Status.FAILED]
    streams = [s for s in done if len(s.output) >= 2 and s.t_done > s.t_first]
    per_user = [(len(s.output) - 1) / (s.t_done - s.t_first) for s in streams]
    tpot = [(s.t_done - s.t_first) / (len(s.output) - 1) for s in streams]
    ttft = [s.t_first - s.t_submit for s in done if s.t_first is not None]
    return {
        "finished": len(done), "failed": len(failed), "output_tokens": sum(len(s.output) for s in done),
        "per_user_tok_s_mean": statistics.fmean(per_user) if per_user else float("nan"),
        "per_user_tok_s_p50": _pct(per_user, 0.5), "per_user_tok_s_p10": _pct(per_user, 0.1),
        "ttft_s_p50": _pct(ttft, 0.5), "ttft_s_p99": _pct(ttft, 0.99),
        "tpot_ms_mean": 1e3 * statistics.fmean(tpot) if tpot else float("nan"),
    }


def step_figures(engine: Engine) -> dict[str, Any]:
    """Steps by kind with their median wall time (completion to completion, ms)."""
    steps = engine.stats.steps
    out: dict[str, Any] = {"steps": len(steps), "by_kind": {}}
    for kind in ("decode", "mixed", "prefill"):
        ks = [s for s in steps if s.kind == kind]
        walls = [1e3 * (b.t_done - a.t_done) for a, b in zip(steps, steps[1:]) if b.kind == kind and a.t_done]
        out["by_kind"][kind] = {"steps": len(ks), "tokens": sum(s.num_tokens for s in ks),
                                "wall_ms_p50": _pct(walls, 0.5)}
    out["checked_steps"] = engine.stats.checked_steps
    out["mismatches"] = list(engine.stats.mismatches)
    out["dropped_tokens"] = engine.stats.dropped_tokens
    return out


def summarize(engine: Engine, wall_s: float) -> dict[str, Any]:
    """Request and step figures plus total output tok/s over ``wall_s``."""
    req = request_figures(engine.states.values())
    return {**req, "wall_s": wall_s, "total_tok_s": req["output_tokens"] / wall_s if wall_s > 0 else float("nan"),
            **step_figures(engine)}


__all__ = ["request_figures", "step_figures", "summarize"]
