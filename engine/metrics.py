"""Serving figures from an engine's requests and steps.

Per-user output throughput is what one user sees while their answer streams: tokens after
the first over the time they took, ``(n - 1) / (t_last - t_first)`` (1 / TPOT). TTFT is from
submission to the first token the host read. Times are the engine's clock at the moment the
host saw the token (with overlap, one step after the GPU produced it).

A step's wall time is completion to completion. With overlap, work the host does while
launching step N+1 (a kernel compile, say) delays the completion it waits for next, step N's:
a stall shows in the step before the one that compiled.
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


def _step_walls(engine: Engine) -> list[tuple[Any, float]]:
    """(step, wall ms completion to completion) for every step after the first completed one."""
    steps = engine.stats.steps
    return [(b, 1e3 * (b.t_done - a.t_done)) for a, b in zip(steps, steps[1:]) if a.t_done and b.t_done]


def chunk_step_figures(engine: Engine, context_bin: int | None = None, min_steps: int = 3) -> dict[str, Any]:
    """Steps holding a prompt chunk (``prefill`` and ``mixed``) by the context the chunk
    reaches, in bins of ``context_bin`` tokens (``context_from < context <= context_to``;
    default 8 chunks of the scheduler's size): median and worst wall ms per bin, and worst /
    median. A step's time grows with context, so only steps of one bin are compared;
    ``chunk_step_worst_ratio`` is the largest over bins of at least ``min_steps`` steps (a
    first-use stall of a new length range shows as a ratio far above 1; nan when no bin has
    that many)."""
    width = context_bin or 8 * engine.config.scheduler.chunk_size
    bins: dict[int, list[tuple[Any, float]]] = {}
    for step, ms in _step_walls(engine):
        if step.kind != "decode":
            bins.setdefault((max(step.context, 1) - 1) // width, []).append((step, ms))
    rows = []
    for b, items in sorted(bins.items()):
        walls = [ms for _, ms in items]
        worst_step, worst = max(items, key=lambda x: x[1])
        med = _pct(walls, 0.5)
        rows.append({"context_from": b * width, "context_to": (b + 1) * width, "steps": len(items),
                     "median_ms": med, "worst_ms": worst, "ratio": worst / med if med > 0 else float("nan"),
                     "worst_step": worst_step.step_id, "worst_context": worst_step.context,
                     "worst_tokens": worst_step.num_tokens, "worst_decodes": worst_step.num_decodes,
                     "worst_launch_ms": worst_step.launch_ms, "worst_gc_ms": worst_step.gc_ms})
    ranked = [r for r in rows if r["steps"] >= min_steps]
    top = max(ranked, key=lambda r: r["ratio"], default=None)
    all_walls = [ms for items in bins.values() for _, ms in items]
    return {"chunk_steps": len(all_walls), "chunk_step_ms_p50": _pct(all_walls, 0.5),
            "chunk_step_ms_max": max(all_walls, default=float("nan")),
            "chunk_step_worst_ratio": top["ratio"] if top else float("nan"),
            "chunk_step_worst_bin": top, "chunk_step_bins": rows, "context_bin": width}


def compile_figures(engine: Engine) -> dict[str, Any]:
    """Kernel compiles while the engine launched steps after the runner's capture: builds,
    disk-cache loads, their seconds, the kernels (name: count) and the steps they stalled.
    ``None`` counts when the runner counts none (never captured)."""
    events = engine.stats.compiles
    if not engine.stats.counting_compiles:
        return {"compiles_after_capture": None, "disk_loads_after_capture": None, "compile_s_after_capture": None,
                "compiled_kernels": {}, "compile_steps": []}
    kernels: dict[str, int] = {}
    for e in events:
        kernels[e.kernel] = kernels.get(e.kernel, 0) + 1
    return {"compiles_after_capture": sum(not e.cached for e in events),
            "disk_loads_after_capture": sum(bool(e.cached) for e in events),
            "compile_s_after_capture": sum(e.seconds for e in events),
            "compiled_kernels": dict(sorted(kernels.items(), key=lambda kv: (-kv[1], kv[0]))),
            "compile_steps": [s.step_id for s in engine.stats.steps if s.compiles]}


def gc_figures(engine: Engine) -> dict[str, Any]:
    """Garbage collection inside the engine's steps (``StepRecord.gc_ms``): total and largest
    ms, full collections, steps that held more than 5 ms of it."""
    steps = engine.stats.steps
    return {"gc_ms_total": sum(s.gc_ms for s in steps), "gc_ms_max": max((s.gc_ms for s in steps), default=0.0),
            "gc_full_collections": sum(s.gc_full for s in steps),
            "gc_steps_over_5ms": sum(s.gc_ms > 5.0 for s in steps)}


def step_log(engine: Engine) -> list[list]:
    """Every step after the first completed one as a row of ``STEP_LOG_COLUMNS``."""
    return [[s.step_id, s.kind, s.num_tokens, s.num_decodes, s.context, round(ms, 3), round(s.launch_ms, 3),
             round(s.gc_ms, 3), s.gc_full, s.admitted, s.compiles] for s, ms in _step_walls(engine)]


STEP_LOG_COLUMNS = ("step", "kind", "tokens", "decodes", "context", "wall_ms", "launch_ms", "gc_ms", "gc_full",
                    "admitted", "compiles")


def summarize(engine: Engine, wall_s: float, context_bin: int | None = None) -> dict[str, Any]:
    """Request, step, chunk-step (``context_bin``: see ``chunk_step_figures``) and compile
    figures plus total output tok/s over ``wall_s``."""
    req = request_figures(engine.states.values())
    return {**req, "wall_s": wall_s, "total_tok_s": req["output_tokens"] / wall_s if wall_s > 0 else float("nan"),
            **step_figures(engine), **chunk_step_figures(engine, context_bin), **compile_figures(engine),
            **gc_figures(engine)}


__all__ = ["STEP_LOG_COLUMNS", "chunk_step_figures", "compile_figures", "gc_figures", "request_figures",
           "step_figures", "step_log", "summarize"]
