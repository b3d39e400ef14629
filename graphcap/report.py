"""Reports: per-graph stats and measured coverage (kernels in graphs vs eager), with rich."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from rich.console import Console
from rich.table import Table

from .splice import Step

_GRAPH_LAUNCH = "cudaGraphLaunch"


@dataclass
class Coverage:
    """One profiled step: what ran inside graphs and what ran eagerly.

    On a GPU the unit is kernels and GPU microseconds; on a CPU (debug-eager, no graphs) the
    unit is aten ops, attributed to producer segments or splices.
    """

    unit: str
    layers: int | None = None
    in_graphs: int = 0
    in_graphs_us: float = 0.0
    eager: int = 0
    eager_us: float = 0.0
    eager_by_site: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    eager_us_by_site: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    graph_by_name: Counter = field(default_factory=Counter)  # what the graphs replay (GPU) / producer ops (CPU)
    graph_us_by_name: Counter = field(default_factory=Counter)
    graph_first_us: float | None = None  # trace time of the first in-graph kernel's start (GPU)
    graph_last_us: float | None = None  # and of the last one's end
    # every kernel of the step (in graphs and eager) as (start, end, name) trace times (GPU)
    kernel_times: list[tuple[float, float, str]] = field(default_factory=list)

    @property
    def graph_span_us(self) -> float:
        """GPU time from the first in-graph kernel's start to the last one's end, the gaps
        between kernels included (a decode step's graph replay; kernels launched with
        programmatic dependent launch overlap, so their summed durations, ``busy_us``, would
        count the waits twice). 0 where no kernel ran in a graph."""
        if self.graph_first_us is None or self.graph_last_us is None:
            return 0.0
        return self.graph_last_us - self.graph_first_us

    def exposed_us_by_name(self) -> Counter:
        """Where the graph span goes when kernels overlap: each kernel's time past the latest
        end of the kernels that started before it (its share of the span, by kernel name cut to
        40 characters), and ``(idle before) <name>`` for the time no kernel ran, named by the
        kernel that ended the wait. Over the kernels within the graph span (eager splices between
        a piecewise step's graphs included; the copy-in before the graph and the work after it,
        with the host's time between them, left out), so the values sum to ``graph_span_us``;
        over every kernel where none ran in a graph. Under programmatic dependent launch a
        kernel's duration includes its wait for the one before (``busy_us`` counts it twice);
        its exposed time is what removing it (or making it faster) can save at most."""
        lo, hi = self.graph_first_us, self.graph_last_us
        inside = [k for k in self.kernel_times if lo is None or hi is None or (k[0] >= lo and k[1] <= hi)]
        out: Counter = Counter()
        latest = None
        for start, end, name in sorted(inside):
            if latest is not None and start > latest:
                out["(idle before) " + name[:40]] += start - latest
            base = start if latest is None else max(start, latest)
            if end > base:
                out[name[:40]] += end - base
            latest = end if latest is None else max(latest, end)
        return out

    @property
    def busy_us(self) -> float:
        """GPU time of every kernel of the step, in graphs and eager (CPU: aten op time)."""
        return self.in_graphs_us + self.eager_us

    @property
    def fraction_in_graphs(self) -> float:
        total = self.in_graphs + self.eager
        return self.in_graphs / total if total else 0.0

    def non_attention_eager(self) -> dict[str, Counter]:
        """Eager work outside attention splices: the list a user should drive to empty."""
        return {site: c for site, c in self.eager_by_site.items() if "attention" not in site}

    def as_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "in_graphs": self.in_graphs,
            "in_graphs_us": round(self.in_graphs_us, 2),
            "eager": self.eager,
            "eager_us": round(self.eager_us, 2),
            "fraction_in_graphs": round(self.fraction_in_graphs, 4),
            "eager_by_site": {k: dict(v) for k, v in self.eager_by_site.items()},
            "eager_us_by_site": {k: {n: round(t, 2) for n, t in v.items()} for k, v in self.eager_us_by_site.items()},
            "layers": self.layers,
            "busy_us": round(self.busy_us, 2),
            "graph_span_us": round(self.graph_span_us, 2),
            "graph_kernels": {n: dict(count=c, us=round(self.graph_us_by_name[n], 2))
                              for n, c in self.graph_by_name.most_common()},
        }


@contextlib.contextmanager
def _native_stderr_quiet() -> Iterator[None]:
    """Native code's writes to file descriptor 2 go to /dev/null within the block (Python's own
    errors still propagate as exceptions)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _site(ts: float, ranges: list[tuple[float, float, str]]) -> str:
    for start, end, name in ranges:
        if start <= ts <= end:
            return name
    return "outside splices (input copy-in, plan)"


def measure_coverage(manager: Any, step: Step, layers: int | None = None) -> Coverage:
    """Profile ``manager.run(step)`` once and attribute every kernel (GPU) or aten op (CPU).

    A GPU kernel whose launch is a ``cudaGraphLaunch`` ran inside a graph (counted per kernel
    name for ``kernel_table``); any other kernel ran eagerly and is attributed to the splice
    range (or neither) that launched it. ``layers``: per-layer figures in the tables.
    """
    cuda = manager.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    manager.run(step)  # keep first-use costs out of the profile
    prof = torch.profiler.profile(activities=activities)
    with _native_stderr_quiet():  # kineto logs "USDT: ... profiler_start" lines on fd 2
        prof.start()
    try:
        manager.run(step)
        if cuda:
            torch.cuda.synchronize()
    finally:
        with _native_stderr_quiet():
            prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"].split(":", 1)[1])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("graphcap.splice:")
    )
    cov = Coverage(unit="kernels" if cuda else "aten ops", layers=layers)
    if cuda:
        launches = {
            e["args"]["correlation"]: e
            for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
        }
        for k in (e for e in events if e.get("cat") == "kernel"):
            cov.kernel_times.append((k["ts"], k["ts"] + k["dur"], k["name"]))
            launch = launches.get(k["args"].get("correlation"))
            if launch is not None and launch["name"] == _GRAPH_LAUNCH:
                cov.in_graphs += 1
                cov.in_graphs_us += k["dur"]
                cov.graph_by_name[k["name"][:100]] += 1
                cov.graph_us_by_name[k["name"][:100]] += k["dur"]
                start, end = k["ts"], k["ts"] + k["dur"]
                cov.graph_first_us = start if cov.graph_first_us is None else min(cov.graph_first_us, start)
                cov.graph_last_us = end if cov.graph_last_us is None else max(cov.graph_last_us, end)
            else:
                cov.eager += 1
                cov.eager_us += k["dur"]
                site, name = _site(launch["ts"], ranges) if launch else "unknown launch", k["name"][:80]
                cov.eager_by_site[site][name] += 1
                cov.eager_us_by_site[site][name] += k["dur"]
    else:
        for op in (e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")):
            site = _site(op["ts"], ranges)
            if site.startswith("outside"):
                cov.in_graphs += 1  # producer code: what a GPU run would capture
                cov.in_graphs_us += op["dur"]
                cov.graph_by_name[op["name"]] += 1
                cov.graph_us_by_name[op["name"]] += op["dur"]
            else:
                cov.eager += 1
                cov.eager_us += op["dur"]
                cov.eager_by_site[site][op["name"]] += 1
                cov.eager_us_by_site[site][op["name"]] += op["dur"]
    return cov


def stats_table(manager: Any) -> Table:
    """Per-graph stats as a rich table; the caption counts eager steps by cause, invalidations,
    capture cost and audits (``CaptureConfig.audit_every``), and names every audit finding."""
    table = Table(title="graphcap graphs")
    for col in ("rows", "graph", "status", "hits", "padding", "segments", "splices", "audits", "capture ms", "MiB",
                "note"):
        table.add_column(col, justify="right" if col not in ("graph", "status", "note") else "left",
                         overflow="fold" if col == "note" else "ellipsis")
    for key, s in sorted(manager.stats.buckets.items()):
        table.add_row(
            str(key.rows), key.kind, s.status, str(s.hits), f"{100 * s.padding_waste:.0f}%", str(s.segments),
            str(s.splices), str(s.audits), f"{s.capture_ms:.1f}", f"{s.memory_mib:.1f}", s.reason,
        )
    st = manager.stats
    caption = (
        f"eager by mode {st.eager_steps} | above ceiling {st.fallbacks} | dropped-graph fallbacks "
        f"{st.dropped_fallbacks} | invalidations {st.invalidations} | recaptures {st.recaptures} | "
        f"capture {st.capture_ms:.0f} ms, {st.memory_mib:.1f} MiB | audits {st.audits} "
        f"({st.audit_s * 1e3:.0f} ms), mismatches {st.audit_mismatches}"
    )
    table.caption = "\n".join([caption, *(f"audit: {f.describe()}" for f in st.audit_findings)])
    return table


def coverage_table(cov: Coverage, per_site: int = 8) -> Table:
    """Coverage as a rich table; the ``per_site`` most frequent eager names of each splice
    (``Coverage.as_dict`` keeps them all)."""
    table = Table(title=f"coverage per forward ({cov.unit})")
    table.add_column("where")
    table.add_column(cov.unit, justify="right")
    table.add_column("time us", justify="right")
    table.add_row("inside graphs" if cov.unit == "kernels" else "producer segments", str(cov.in_graphs),
                  f"{cov.in_graphs_us:.1f}")
    table.add_row("eager", str(cov.eager), f"{cov.eager_us:.1f}")
    for site, names in sorted(cov.eager_by_site.items()):
        times = cov.eager_us_by_site[site]
        for name, count in names.most_common(per_site):
            table.add_row(f"  {site}: {name}", str(count), f"{times[name]:.1f}")
        if len(names) > per_site:
            rest = sum(names.values()) - sum(c for _, c in names.most_common(per_site))
            table.add_row(f"  {site}: {len(names) - per_site} more names", str(rest), "")
    if cov.unit == "kernels":
        table.caption = (f"{100 * cov.fraction_in_graphs:.1f}% of kernels in graphs | graph span "
                         f"{cov.graph_span_us:.1f} us (first in-graph kernel to the last, gaps included; kernel "
                         f"times of programmatic dependent launches include their waits)")
    else:  # CPU: nothing is captured; producer segments are what a GPU run would capture
        table.caption = (f"{100 * cov.fraction_in_graphs:.1f}% of aten ops in producer segments "
                         f"(CPU, debug-eager: no graphs; a GPU run captures these)")
    return table


def kernel_table(cov: Coverage, top: int = 25) -> Table:
    """What the graphs replay, by kernel name: count and GPU time per step and per layer
    (CPU: the producer aten ops), the ``top`` most expensive first."""
    per = cov.layers or 0
    table = Table(title=f"inside graphs, by {cov.unit[:-1]} ({cov.in_graphs} {cov.unit}, {cov.in_graphs_us:.0f} us"
                        + (f", {cov.layers} layers" if per else "") + ")")
    table.add_column("name")
    for col in ("count", "us") + (("per layer", "us / layer") if per else ()) + ("share",):
        table.add_column(col, justify="right")
    ranked = sorted(cov.graph_by_name, key=lambda n: -cov.graph_us_by_name[n])
    for name in ranked[:top]:
        c, us = cov.graph_by_name[name], cov.graph_us_by_name[name]
        extra = (f"{c / per:.1f}", f"{us / per:.1f}") if per else ()
        table.add_row(name[:70], str(c), f"{us:.1f}", *extra, f"{100 * us / max(cov.in_graphs_us, 1e-9):.1f}%")
    if len(ranked) > top:
        rest = ranked[top:]
        table.add_row(f"{len(rest)} more names", str(sum(cov.graph_by_name[n] for n in rest)),
                      f"{sum(cov.graph_us_by_name[n] for n in rest):.1f}", *(("", "") if per else ()), "")
    return table


def choices_table(choices: Mapping[Any, Any]) -> Table:
    """Validated kernel choices (``graphcap.startup.tuning.KernelTuner.choices``): per op and shape, the
    chosen candidate, the passing ones' times and every rejected one with its reason."""
    table = Table(title="kernel choices (validated against the reference before use)")
    for col in ("op", "shape", "chosen", "passing (us)", "rejected"):
        table.add_column(col, justify="right" if col == "shape" else "left")
    for c in choices.values():
        times = ", ".join(f"{n} {t:.1f}" if t is not None else n for n, t in c.timings_us.items())
        rejected = "; ".join(f"{n}: {why}" for n, why in c.rejected.items()) or "-"
        table.add_row(c.op, str(c.key), c.chosen, times, rejected[:80])
    return table


def print_report(manager: Any, coverage: Coverage | None = None, console: Console | None = None) -> None:
    console = console or Console()
    console.print(stats_table(manager))
    if coverage is not None:
        console.print(coverage_table(coverage))
        console.print(kernel_table(coverage))
