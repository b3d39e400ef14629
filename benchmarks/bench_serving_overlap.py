"""Host overlap: decode step wall time against its GPU-busy time, through the serving engine.

    python benchmarks/bench_serving_overlap.py --layers 60 --json out.json   (H200)

For each decode batch size B, B requests with ``--context``-token prompts are prefilled
through the engine, then steady decode steps are timed three ways on the same runner (graphs
captured, ``full_and_piecewise``): ``runner.step`` in a loop (sync per step, the host on the
critical path), the engine without overlap, and the engine with overlap (step N+1 launched
before step N's tokens are read, tokens fed on the device). Wall = median time between
consecutive step completions. GPU-busy = median device time of one step with the host out of
the way: the stream is held by a spin kernel while the host queues the step, then events
time the step alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from engine import Engine, EngineConfig, Request, SchedulerConfig
from graphcap import CaptureConfig
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.routing import measure_routing_spread
from models.runner import ModelRunner
from steps import TokenChunk

SPIN_CYCLES = 80_000_000  # ~40 ms at H200 clocks: longer than the host needs to queue a step


def engine_for(runner: ModelRunner, batch: int, context: int, steps: int, overlap: bool, tag: str) -> Engine:
    """An engine with ``batch`` requests prefilled and decoding (enough tokens left for ``steps``)."""
    eng = Engine(runner, EngineConfig(SchedulerConfig(chunk_size=runner.max_tokens), overlap=overlap))
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, runner.vocab_size, (context,), generator=g).tolist()
        eng.submit(Request(f"{tag}{i}", prompt, steps + 40))
    while any(not s.prompt_done or not s.output for s in eng.states.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    return eng


def wall_ms(eng: Engine, steps: int) -> float:
    first = len(eng.stats.steps)
    for _ in range(steps):
        eng.step()
    done = [s.t_done for s in eng.stats.steps[first:] if s.t_done]
    return 1e3 * statistics.median(b - a for a, b in zip(done, done[1:]))


def busy_ms(eng: Engine, steps: int) -> float:
    out = []
    for _ in range(steps):
        torch.cuda._sleep(SPIN_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        eng.step()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def runner_loop_ms(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """``runner.step`` per decode step (greedy tokens read on the host every step)."""
    ids = [f"loop{i}" for i in range(batch)]
    g = torch.Generator().manual_seed(7)
    toks = []
    for sid in ids:  # prefill one request at a time, in chunks of the step capacity
        runner.add_request(sid)
        prompt = torch.randint(0, runner.vocab_size, (context,), generator=g).tolist()
        for a in range(0, context, runner.max_tokens):
            out = runner.step([TokenChunk(sid, a, prompt[a : a + runner.max_tokens])])
        toks.append(out.next_tokens[0])
    times = []
    for _ in range(steps + 3):
        t0 = time.perf_counter()
        out = runner.step([TokenChunk(s, runner.num_written(s), [t]) for s, t in zip(ids, toks)])
        toks = out.next_tokens
        times.append(1e3 * (time.perf_counter() - t0))
    for sid in ids:
        runner.free_request(sid)
    return statistics.median(times[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="rank-of-8")
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=1054)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    config = MiniMaxM3Config.preset(args.preset).first_layers(args.layers)
    runner = build_from_preset(config, "cuda", torch.bfloat16, backend="auto", max_tokens=args.max_tokens,
                               max_seqs=max(batches), max_seq_len=args.context + 2 * args.steps + 200,
                               capture=CaptureConfig(enabled=True, max_tokens=args.max_tokens))
    spread = measure_routing_spread(runner, batch=32)
    print(spread.describe(), flush=True)
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    rows = []
    for b in batches:
        loop = runner_loop_ms(runner, b, args.context, args.steps)
        serial = engine_for(runner, b, args.context, 2 * args.steps, overlap=False, tag="s")
        serial_ms = wall_ms(serial, args.steps)
        serial.drain()
        eng = engine_for(runner, b, args.context, 2 * args.steps + 20, overlap=True, tag="o")
        overlap_ms = wall_ms(eng, args.steps)
        busy = busy_ms(eng, 10)
        eng.drain()
        rows.append({"batch": b, "runner_step_ms": loop, "engine_serial_ms": serial_ms, "engine_overlap_ms": overlap_ms,
                     "gpu_busy_ms": busy, "overlap_over_busy": overlap_ms / busy, "serial_over_busy": serial_ms / busy})
    t = Table(title=f"decode step wall vs GPU-busy ({args.layers}-layer {args.preset}, context {args.context}, "
                    f"{torch.cuda.get_device_name()})")
    for c in ("batch", "runner.step ms", "engine serial ms", "engine overlap ms", "GPU busy ms", "overlap/busy",
              "serial/busy"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["batch"]), f"{r['runner_step_ms']:.2f}", f"{r['engine_serial_ms']:.2f}",
                  f"{r['engine_overlap_ms']:.2f}", f"{r['gpu_busy_ms']:.2f}", f"{r['overlap_over_busy']:.3f}",
                  f"{r['serial_over_busy']:.3f}")
    Console().print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "capture_s": capture_s, "expert_spread": spread.as_dict(),
                       "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
