"""GPU timing shared by the benchmark scripts (imported as ``timing``: scripts run from this
folder have it on ``sys.path``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


class Timer:
    """Median GPU time in microseconds (do_bench), or one host-timed run for ``--smoke``."""

    def __init__(self, smoke: bool, warmup_ms: int, rep_ms: int) -> None:
        self.smoke, self.warmup_ms, self.rep_ms = smoke, warmup_ms, rep_ms

    def __call__(self, fn: Callable[[], None], rep_ms: int | None = None) -> float:
        if self.smoke:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=rep_ms or self.rep_ms,
                                             return_mode="median")

    def graph(self, fn: Callable[[], None]) -> float | None:
        """Time of the ops in ``fn`` captured as one CUDA graph and replayed."""
        if self.smoke:
            return None
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return self(g.replay)


def kernel_times(ops: dict[str, Callable[[], None]], reps: int = 20) -> dict[str, dict[str, float]]:
    """GPU us per kernel of each op (``torch.profiler``, mean of ``reps`` eager runs after one)."""
    out: dict[str, dict[str, float]] = {}
    for name, fn in ops.items():
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        out[name] = {e.key[:48]: round(e.device_time_total / reps, 1) for e in prof.key_averages()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.count}
        print(f"kernels of {name}: {sum(out[name].values()):.1f} us  {out[name]}", flush=True)
    return out


def graph_replay_us(calls: Sequence[Callable[[], None]], reps: int) -> float:
    """Median GPU microseconds per call: ``calls`` captured in order as one CUDA graph, replayed
    ``reps`` times between CUDA events. Many calls per graph amortise the replay's own launch,
    which one-call graphs of microsecond kernels would otherwise measure. The calls must have
    run once already (lazy allocations and JIT builds cannot happen inside a capture)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()  # warm
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def step_ms(runner, chunks: Sequence, iters: int) -> dict[str, float]:
    """Median wall ms and CUDA-event span ms of ``runner.step(chunks)`` (the greedy tokens read
    on the host), the chunks' requests rewound after each run so the same step runs again; 3
    warm-up runs first. Uses only the runner API every release has (older checkouts too)."""
    def once() -> None:
        runner.step(chunks)
        for ch in chunks:
            runner.rewind_request(ch.seq_id, ch.start_pos)

    for _ in range(3):
        once()
    walls, spans = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        once()
        end.record()
        end.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        spans.append(start.elapsed_time(end))
    return dict(wall_ms=round(statistics.median(walls), 3), span_ms=round(statistics.median(spans), 3))
