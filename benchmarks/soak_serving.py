"""Serving soak: many steps of arrivals and departures with graphs, recaptures and checks.

    python benchmarks/soak_serving.py --steps 10000 --json soak.json      (GPU)

Closed loop on a small rank-of-8 slice with random prompt and output lengths and
``max_seqs`` tight enough that requests finish and enter in the same steps. Every
``--invalidate-every`` steps a registered buffer is marked moved (``manager.invalidate``), so
the graphs are recaptured while requests are live; every ``--check-every``-th step also runs
on the padded debug-eager twin and must give bit-identical logits. At the end: no page or
sequence-slot leak, device memory flat after the first recapture, every request finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from engine import Engine, EngineConfig, SchedulerConfig, make_requests, serve
from graphcap import CaptureConfig
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.routing import measure_routing_spread


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="rank-of-8")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--max-seqs", type=int, default=12)
    p.add_argument("--chunk", type=int, default=96)
    p.add_argument("--prompt-len", default="8:300")
    p.add_argument("--output-len", default="4:80")
    p.add_argument("--invalidate-every", type=int, default=1000)
    p.add_argument("--check-every", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    plo, phi = (int(x) for x in args.prompt_len.split(":"))
    olo, ohi = (int(x) for x in args.output_len.split(":"))
    config = MiniMaxM3Config.preset(args.preset).first_layers(args.layers)
    budget = args.chunk + args.max_seqs
    capture = CaptureConfig(enabled=True, max_tokens=budget)
    runner = build_from_preset(config, "cuda", torch.bfloat16, backend="auto", max_tokens=budget,
                               max_seqs=args.max_seqs, max_seq_len=phi + ohi, capture=capture)
    reference = runner.with_capture(dataclasses.replace(capture, debug_eager=True))
    print(measure_routing_spread(runner, batch=32).describe(), flush=True)
    runner.capture()
    reference.capture()
    engine = Engine(runner, EngineConfig(SchedulerConfig(chunk_size=args.chunk), check_every=args.check_every),
                    reference=reference)
    mem: dict[int, int] = {}
    overlapping = 0

    def on_step(eng: Engine, ended) -> None:
        nonlocal overlapping
        n = len(eng.stats.steps)
        if ended and eng.stats.steps and eng.stats.steps[-1].admitted:
            overlapping += 1
        if n % args.invalidate_every == 0 and n not in mem:
            runner.manager.invalidate(f"soak: forced at step {n}")
            mem[n] = torch.cuda.memory_allocated()

    per_batch, served = 400, 0
    t0 = time.perf_counter()
    while len(engine.stats.steps) < args.steps:
        batch = make_requests(per_batch, (plo, phi), (olo, ohi), runner.vocab_size, seed=served,
                              prefix=f"b{served}-")
        serve(engine, batch, concurrency=args.max_seqs + 2, on_step=on_step)
        served += 1
    wall = time.perf_counter() - t0
    states = list(engine.states.values())
    mib = {k: v / 2**20 for k, v in mem.items()}
    later = [v for k, v in mib.items() if k > args.invalidate_every]
    result = {
        "steps": len(engine.stats.steps), "requests": len(states), "wall_s": wall,
        "finished": sum(s.status.value == "finished" for s in states),
        "failed": sum(s.status.value == "failed" for s in states),
        "checked_steps": engine.stats.checked_steps, "mismatches": engine.stats.mismatches,
        "recaptures": runner.manager.stats.recaptures, "invalidations": runner.manager.stats.invalidations,
        "steps_with_admission_and_completion": overlapping,
        "free_pages": runner.num_free_pages, "num_pages": runner.num_pages, "live_seqs": runner.cache.num_live_seqs,
        "memory_mib_at_recaptures": mib, "memory_drift_mib": (max(later) - min(later)) if later else 0.0,
        "graphs": sum(1 for b in runner.manager.stats.buckets.values() if b.status == "captured"),
        "args": vars(args), "gpu": torch.cuda.get_device_name(),
    }
    ok = (not result["mismatches"] and result["failed"] == 0 and result["free_pages"] == result["num_pages"]
          and result["live_seqs"] == 0 and result["memory_drift_mib"] < 64)
    result["ok"] = ok
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
