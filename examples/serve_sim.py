"""Serving simulation: the same request list through several capture modes, in one process.

    python examples/serve_sim.py                              # tiny preset, CPU or GPU, < 1 min
    python examples/serve_sim.py --preset rank-of-8 --modes none,decode,full_and_piecewise \\
        --concurrency 30 --requests 45 --prompt-len 800:3200 --output-len 48:160 --chunk 1024

Under ``torchrun --nproc-per-node N ... --tp N`` every rank runs the same engine on its shard
(the same requests, hence the same steps; every rank samples the gathered logits alike) and
rank 0 reports. Open loop is refused there: arrivals follow each rank's own clock, so the ranks
would compose different steps and their collectives would not pair up.

Closed loop (``--concurrency C``: C requests in the system, a new one enters as one ends) or
open loop (``--rate R``: Poisson arrivals, R requests per second). Each mode gets a runner
over the same weights and cache (``runner.with_capture``), captures, serves a short warm-up
list, then the measured list; its graphs are freed before the next mode. The table gives
per-user output tok/s (mean, p50, p10), TTFT (p50, p99), TPOT, total tok/s, steps by kind,
bucket hits and padding and memory, with ratios against ``decode`` mode (whole graphs for
pure decode steps only: the baseline before producer graphs). On a CPU, capture modes run the
padded debug-eager path, so CPU figures show the wiring, not speed.

Long context (``--workload long``): concurrency 8, prompts uniform 32K-128K, outputs 128-256,
chunk 1024, modes decode and full_and_piecewise, bf16 and fp8 KV (``--kv-dtype``: each KV
dtype, like each weight format, gets its own build and serves the same requests)::

    python examples/serve_sim.py --preset rank-of-8 --workload long --json long.json
    python examples/serve_sim.py --preset tiny --workload long     # the CPU smoke (prompts 128-512)

It adds chunk-step times (median and worst of the steps holding a prompt chunk, in context
bins of 8 chunks, and worst / median), Triton compiles after capture (builds and disk-cache
loads, with the kernels: each stalled every request of its step; the count should be 0), the
KV pages (peak used and claimed, the cache, its capacity in tokens) and the most requests
running at once, and the garbage collector's time inside steps, and in the JSON a log of
every step (its host launch time among the columns) and the CUDA allocator's device
allocations while serving. On a GPU the cache is sized to the memory left beside the weights
(``--kv-headroom-gib`` kept for the rest): what does not fit is said before the run, and the
run shows it as fewer requests admitted. Compiles are counted per process: a kernel an earlier
run built is in memory for the later ones, so run one mode alone for its cold count.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import os
import sys
import time
import weakref
from typing import Callable

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from distributed import group_for_tp
from engine import (
    STEP_LOG_COLUMNS,
    Engine,
    EngineConfig,
    SamplingParams,
    SchedulerConfig,
    compile_figures,
    make_requests,
    serve,
    step_log,
    summarize,
)
from graphcap import CaptureConfig
from graphcap.config import MODES
from models.minimax_m3 import build_from_checkpoint, build_from_preset
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.model import MiniMaxM3ForCausalLM
from models.minimax_m3.routing import ROUTINGS, measure_routing_spread
from models.runner import ModelRunner, capture_reserve
from models.runner.kv_budget import KVBudget, kv_budget, page_bytes

# Small defaults for the tiny preset (a CPU run in well under a minute); the serving
# test for every other preset.
DEFAULTS = {"tiny": dict(requests=24, concurrency=6, prompt_len="16:96", output_len="8:24", chunk=64),
            "other": dict(requests=45, concurrency=30, prompt_len="800:3200", output_len="48:160", chunk=1024)}
# Long context (issue 21): 8 requests of 32K-128K in the system, one wave (8 prompts of 80K
# on average are ~640 chunk steps, about a minute per run on an H200). The tiny model holds
# 4096 positions and a CPU step is slow: its prompts are 1/256 of those, in chunks of 64, so
# the smoke run still spans several chunks per prompt in seconds.
LONG = {"tiny": dict(requests=8, concurrency=8, prompt_len="128:512", output_len="4:8", chunk=64),
        "other": dict(requests=8, concurrency=8, prompt_len="32768:131072", output_len="128:256", chunk=1024)}
WORKLOADS = {"default": DEFAULTS, "long": LONG}
# What a workload runs unless the command line says (None: the general defaults below).
WORKLOAD_RUNS = {"default": dict(modes=None, kv_dtype="bf16"),
                 "long": dict(modes="decode,full_and_piecewise", kv_dtype="bf16,fp8")}
# KV dtype names: bf16 is the model's own dtype (bf16 on a GPU, fp32 in a CPU run).
KV_DTYPES = {"bf16": None, "fp8": torch.float8_e4m3fn}


def span(text: str) -> tuple[int, int]:
    """``LO:HI`` (or ``N``) token counts, 1 <= LO <= HI; an argparse type."""
    lo, _, hi = text.partition(":")
    try:
        out = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO:HI token counts (e.g. 800:3200)") from None
    if not 1 <= out[0] <= out[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return out


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be >= {minimum}")
        return v

    return parse


positive = at_least(1)


def audit_list(text: str) -> list[int]:
    """``N`` or ``N1,N2,...`` (each >= 0); an argparse type."""
    return [at_least(0)(x) for x in text.split(",") if x.strip()] or [0]


def weight_bytes(config: MiniMaxM3Config, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters and buffers, counted on the meta device (nothing is
    allocated): what the weights will take before they are built."""
    model = MiniMaxM3ForCausalLM(config, dtype=dtype, device="meta")
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def bucket_figures(runner: ModelRunner, before: dict) -> dict:
    """Graph hits and padding of this run (the warm-up's subtracted), and graph memory."""
    st = runner.manager.stats
    hits = real = padded = 0
    per_bucket = {}
    for key, b in st.buckets.items():
        h0, r0, p0 = before.get(key, (0, 0, 0))
        dh, dr, dp = b.hits - h0, b.real_tokens - r0, b.padded_tokens - p0
        hits, real, padded = hits + dh, real + dr, padded + dp
        if dh:
            per_bucket[str(key)] = dh
    return {"graph_hits": hits, "padding_pct": 100 * padded / max(1, real + padded), "hits_by_bucket": per_bucket,
            "graphs": sum(1 for b in st.buckets.values() if b.status == "captured"), "pool_mib": st.pool_mib,
            "audits": st.audits, "audit_ms": 1e3 * st.audit_s, "audit_mismatches": st.audit_mismatches,
            "audit_findings": [f.describe() for f in st.audit_findings],
            "dropped": sorted(str(k) for k, b in st.buckets.items() if b.status == "dropped")}


def device_allocs() -> tuple[int, int]:
    """The CUDA caching allocator's device allocations (cudaMalloc) and retries (a full free of
    its cache, then cudaMalloc again) so far: either inside a serving step stalls it."""
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)


def hits_snapshot(runner: ModelRunner) -> dict:
    return {k: (b.hits, b.real_tokens, b.padded_tokens) for k, b in runner.manager.stats.buckets.items()}


def run_mode(base: ModelRunner, mode: str, audit_every: int, env: CaptureConfig, args, requests, warmup,
             cuda: bool, console: Console, trace: bool) -> dict:
    """Serve the warm-up list, then the measured list, with capture mode ``mode`` auditing one
    graph step in ``audit_every`` (the other capture settings from ``env``: ``GRAPHCAP_*``)."""
    cap = dataclasses.replace(env, enabled=False, mode=mode, debug_eager=not cuda and mode != "none",
                              audit_every=audit_every)
    runner = base.with_capture(cap)
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    sched = SchedulerConfig(token_budget=args.token_budget, chunk_size=args.chunk, max_running=args.concurrency)
    config = EngineConfig(sched, overlap=not args.no_overlap)
    warm = Engine(runner, config)
    serve(warm, warmup, concurrency=args.concurrency)  # JIT, tuning, allocator
    warm_choices = runner.kernel_choices_after_capture() or []
    before = hits_snapshot(runner)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    engine = Engine(runner, config)
    profiler = None
    peak = {"kv_pages_peak_used": 0, "kv_pages_peak_claimed": 0, "peak_running": 0, "kv_bound_steps": 0}
    allocs: list[list[int]] = []  # [steps launched, cudaMalloc calls, allocator retries] whenever they grew
    last_allocs = device_allocs() if cuda else None

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"{mode:>18}", total=len(requests))

        def on_step(eng: Engine, ended) -> None:
            nonlocal profiler, last_allocs
            bar.advance(task, len(ended))
            running = sum(not s.stopped for s in eng.running)
            peak["kv_pages_peak_used"] = max(peak["kv_pages_peak_used"], runner.num_pages - runner.num_free_pages)
            peak["kv_pages_peak_claimed"] = max(peak["kv_pages_peak_claimed"], eng.scheduler.claimed_pages)
            peak["peak_running"] = max(peak["peak_running"], running)
            # Requests waited while a slot was free: only the KV pages held them back.
            peak["kv_bound_steps"] += bool(eng.waiting) and running < args.concurrency
            n = len(eng.stats.steps)
            if cuda and (now := device_allocs()) != last_allocs:
                allocs.append([n, now[0] - last_allocs[0], now[1] - last_allocs[1]])
                last_allocs = now
            if trace and n == args.trace_start:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                                  + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
                profiler.start()
            elif profiler is not None and n == args.trace_start + args.trace_steps:
                profiler.stop()
                profiler.export_chrome_trace(args.trace)
                profiler = None

        wall = serve(engine, requests, concurrency=None if args.rate else args.concurrency, on_step=on_step)
    if profiler is not None:
        profiler.stop()
        profiler.export_chrome_trace(args.trace)
    runner.manager.release()  # before the figures: every rank frees its graphs at the same point
    label = mode if not audit_every else f"{mode}+audit{audit_every}"
    out = {"mode": label, "audit_every": audit_every, "capture_s": capture_s, **summarize(engine, wall),
           **bucket_figures(runner, before), **peak, **compile_events(runner, warm, engine)}
    choices = runner.kernel_choices_after_capture() or []
    out.update(warmup_kernel_choices=warm_choices, kernel_choices=[c for c in choices if c not in warm_choices])
    out["step_log"] = step_log(engine)
    out["device_allocs"] = allocs
    kv = runner.cache.config
    out.update(kv_pages=runner.num_pages, kv_capacity_tokens=runner.num_pages * runner.page_size,
               kv_cache_dtype=str(kv.dtype).removeprefix("torch."),
               kv_index_dtype=str(kv.index_dtype).removeprefix("torch."))
    if cuda:
        out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    out["per_user"] = sorted((len(s.output) - 1) / (s.t_done - s.t_first) for s in engine.states.values()
                             if len(s.output) > 1 and s.t_done > s.t_first)
    out["ttft"] = sorted(s.t_first - s.t_submit for s in engine.states.values() if s.t_first is not None)
    if cuda:
        torch.cuda.empty_cache()
    return out


def compile_events(runner: ModelRunner, warm: Engine, engine: Engine) -> dict:
    """Triton compiles of a mode: during its capture, in the warm-up serving and in the measured
    serving (the last two are after capture: each stalled a step), with what compiled."""
    during = runner.compiles_during_capture()
    warmup = compile_figures(warm)
    return {"capture_compiles": sum(not e.cached for e in during),
            "capture_disk_loads": sum(e.cached for e in during),
            "warmup_compiles": warmup["compiles_after_capture"] or 0,
            "warmup_disk_loads": warmup["disk_loads_after_capture"] or 0,
            "compile_events": [e.describe() for e in engine.stats.compiles],
            "warmup_compile_events": [e.describe() for e in warm.stats.compiles]}


def table(results: list[dict]) -> Table:
    base = next((r for r in results if r["mode"].split()[0] == "decode"), None)  # "decode" or "decode bf16"
    t = Table(title="serving simulation" + (f" (ratios vs {base['mode']} mode)" if base else ""))
    t.add_column("figure")
    for r in results:
        t.add_column(r["mode"], justify="right")

    def row(name: str, key: str, fmt: str, ratio: bool = False) -> None:
        cells = []
        for r in results:
            v = r[key]
            cell = format(v, fmt)
            if ratio and base and base[key] and not math.isnan(v):
                cell += f" ({v / base[key]:.2f}x)"
            cells.append(cell)
        t.add_row(name, *cells)

    row("per-user tok/s mean", "per_user_tok_s_mean", ".2f", True)
    row("per-user tok/s p50", "per_user_tok_s_p50", ".2f", True)
    row("per-user tok/s p10", "per_user_tok_s_p10", ".2f", True)
    row("TTFT p50 s", "ttft_s_p50", ".3f", True)
    row("TTFT p99 s", "ttft_s_p99", ".3f", True)
    row("TPOT ms", "tpot_ms_mean", ".1f", True)
    row("total tok/s", "total_tok_s", ".1f", True)
    row("wall s", "wall_s", ".1f")
    for kind in ("decode", "mixed", "prefill"):
        t.add_row(f"{kind} steps (p50 ms)", *[f"{r['by_kind'][kind]['steps']} ({r['by_kind'][kind]['wall_ms_p50']:.1f})"
                                              for r in results])
    row("graph hits", "graph_hits", "d")
    row("padding %", "padding_pct", ".1f")
    row("graphs", "graphs", "d")
    t.add_row("pool MiB", *[f"{r['pool_mib']:.0f}" for r in results])
    if "peak_mib" in results[0]:
        row("peak MiB", "peak_mib", ".0f")
    row("capture s", "capture_s", ".1f")
    t.add_row("chunk steps (p50 / worst ms)", *[f"{r['chunk_steps']} ({r['chunk_step_ms_p50']:.1f} / "
                                                 f"{r['chunk_step_ms_max']:.1f})" for r in results])
    t.add_row("worst / p50, same context", *[same_context(r["chunk_step_worst_bin"]) for r in results])
    t.add_row("GC in steps ms (max; full)",
              *[f"{r['gc_ms_total']:.0f} ({r['gc_ms_max']:.1f}; {r['gc_full_collections']})" for r in results])
    t.add_row("compiles after capture (disk)", *[f"{r['compiles_after_capture']} ({r['disk_loads_after_capture']})"
                                                  + (f" +{r['warmup_compiles']} ({r['warmup_disk_loads']}) warm-up"
                                                     if r["warmup_compiles"] or r["warmup_disk_loads"] else "")
                                                  for r in results])
    t.add_row("kernel validations after capture", *[f"{len(r['kernel_choices'])}"
                                                     + (f" +{len(r['warmup_kernel_choices'])} warm-up"
                                                        if r["warmup_kernel_choices"] else "") for r in results])
    t.add_row("KV pages peak used / claimed / cache", *[f"{r['kv_pages_peak_used']} / {r['kv_pages_peak_claimed']} / "
                                                         f"{r['kv_pages']}" for r in results])
    t.add_row("KV capacity tokens", *[f"{r['kv_capacity_tokens']:,} {r['kv_cache_dtype']}" for r in results])
    t.add_row("peak running (KV-bound steps)", *[f"{r['peak_running']} ({r['kv_bound_steps']})" for r in results])
    t.add_row("finished / failed", *[f"{r['finished']} / {r['failed']}" for r in results])
    if any(r["audit_every"] for r in results):
        t.add_row("audits (ms) / mismatches", *[f"{r['audits']} ({r['audit_ms']:.0f}) / {r['audit_mismatches']}"
                                                 for r in results])
        t.add_row("ms per audit", *[f"{r['audit_ms'] / r['audits']:.1f}" if r["audits"] else "-" for r in results])
        t.add_row("dropped graphs", *[", ".join(r["dropped"]) or "-" for r in results])
    return t


def same_context(b: dict | None) -> str:
    """A table cell: the context bin with the largest worst / median chunk step, and the worst
    step's host launch time (an eager step is host-bound: a slow launch is a slow step)."""
    if not b:
        return "-"
    return (f"{b['ratio']:.2f}x ({b['worst_ms']:.1f} / {b['median_ms']:.1f} ms at <= {short(b['context_to'])}; "
            f"launch {b['worst_launch_ms']:.1f} ms)")


def short(tokens: int) -> str:
    """``65536`` -> ``64K``; a count not in whole K as it is."""
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def plot_title(workload: str, cuda: bool) -> str:
    """The PNG's title: the workload, and on CPU the caveat that the figures show wiring."""
    return workload if cuda else f"{workload}\nCPU: debug-eager, the wiring, not speed"


def plot(results: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["mode"] for r in results]
    for ax, key, label in ((a, "per_user", "per-user output tok/s"), (b, "ttft", "TTFT (s)")):
        ax.boxplot([r[key] for r in results])
        ax.set_xticks(range(1, len(names) + 1), names)
        ax.set_title(label)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="tiny | slice | rank-of-8 | real")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="default",
                   help="default: the c30 serving test (tiny: a small CPU run); long: concurrency 8, prompts "
                        "32K-128K, outputs 128-256, modes decode and full_and_piecewise, KV bf16 and fp8 (tiny: "
                        "prompts 128-512, outputs 4-8, chunk 64); every option given wins")
    p.add_argument("--checkpoint", default=None, help="a Hugging Face folder instead of a preset")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, of {', '.join(MODES)} (default: none,decode,full_and_piecewise; with "
                        f"GRAPHCAP_MODE or GRAPHCAP_ENABLED set: decode and that mode)")
    p.add_argument("--requests", type=positive, default=None)
    p.add_argument("--concurrency", type=positive, default=None, help="closed loop: requests in the system")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--prompt-len", type=span, default=None, help="LO:HI tokens, uniform")
    p.add_argument("--output-len", type=span, default=None, help="LO:HI tokens, uniform")
    p.add_argument("--chunk", type=positive, default=None, help="most prompt tokens of one request per step")
    p.add_argument("--token-budget", type=positive, default=None,
                   help="tokens per step (default: chunk + concurrency)")
    p.add_argument("--audit-every", type=audit_list, default=None,
                   help="audit one graph step in N against the padded eager path (0: off; GRAPHCAP_AUDIT_EVERY); "
                        "a comma list (0,10,1000) runs every capturing mode once per value, side by side")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=ROUTINGS, default="model",
                   help="model (the router; random weights get a calibrated bias), or a simulation: uniform, balanced")
    p.add_argument("--weights", default="bf16",
                   help="comma list of weight formats, bf16 and/or mxfp8 (random weights quantized); each is built "
                        "in turn (one model in memory at a time) and serves the same requests")
    p.add_argument("--kv-dtype", default=None,
                   help="comma list of KV cache dtypes, bf16 (the model dtype) and/or fp8 (e4m3: main K/V and "
                        "index-K); each is built in turn and serves the same requests (default: the workload's)")
    p.add_argument("--kv-headroom-gib", type=float, default=10.0,
                   help="GPU: memory kept beside the weights for activations, graphs and workspaces when the KV "
                        "cache is sized to what is left")
    p.add_argument("--kv-pages", type=positive, default=None,
                   help="KV pages of the cache (default: every request at its longest length, capped on a GPU by "
                        "the memory left)")
    p.add_argument("--no-overlap", action="store_true", help="read each step's tokens before the next launch")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--trace", default=None, help="chrome trace of a few steps of the last mode")
    p.add_argument("--trace-start", type=int, default=20)
    p.add_argument("--trace-steps", type=int, default=4)
    p.add_argument("--plot", default=None, help="PNG of per-user tok/s and TTFT by mode (needs matplotlib)")
    p.add_argument("--tp", type=int, default=None, help="shard over N ranks (launch with torchrun --nproc-per-node N)")
    args = p.parse_args()
    d = WORKLOADS[args.workload]["tiny" if args.preset == "tiny" and not args.checkpoint else "other"]
    for k, v in {**d, **WORKLOAD_RUNS[args.workload]}.items():
        if getattr(args, k) is None:
            setattr(args, k, span(v) if k in ("prompt_len", "output_len") else v)
    try:  # the one flag and every other GRAPHCAP_* setting, for every capturing mode
        env = CaptureConfig.from_env(CaptureConfig(max_tokens=args.token_budget or args.chunk + args.concurrency))
    except ValueError as e:
        sys.exit(f"environment: {e}")
    audits = args.audit_every if args.audit_every is not None else [env.audit_every]  # the command line wins
    if args.modes is None:
        chosen = {"GRAPHCAP_MODE", "GRAPHCAP_ENABLED"} & set(os.environ)
        args.modes = ",".join(dict.fromkeys(["decode", env.graph_mode])) if chosen else "none,decode,full_and_piecewise"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        sys.exit(f"--modes: {bad} are not modes; pick from {', '.join(MODES)}")
    prompt_len, output_len = args.prompt_len, args.output_len
    args.token_budget = args.token_budget or args.chunk + args.concurrency
    if args.tp is not None and args.tp > 1 and args.rate:
        sys.exit("--rate with --tp > 1: open-loop arrivals follow each rank's clock, so ranks would build different "
                 "steps and their collectives would hang; use --concurrency (closed loop)")
    if args.tp is not None and not args.checkpoint and MiniMaxM3Config.preset(args.preset).tp_size > 1:
        sys.exit(f"--tp shards a whole model; {args.preset} is already one rank of a shard (use --preset real)")
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    group = group_for_tp(args.tp, args.device)
    max_seq_len = prompt_len[1] + output_len[1]
    kw = dict(device=group.device if group else args.device, dtype=dtype, backend="auto", max_tokens=args.token_budget,
              max_seqs=args.concurrency, max_seq_len=max_seq_len, group=group, routing=args.routing)
    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not formats or set(formats) - {"bf16", "mxfp8"} or (args.checkpoint and formats != ["bf16"]):
        sys.exit(f"--weights {args.weights!r}: a comma list of bf16 and mxfp8 (random weights only; a checkpoint "
                 "brings its own format)")
    kvs = list(dict.fromkeys(k.strip() for k in args.kv_dtype.split(",") if k.strip()))
    if not kvs or set(kvs) - set(KV_DTYPES):
        sys.exit(f"--kv-dtype {args.kv_dtype!r}: a comma list of {' and '.join(KV_DTYPES)}")
    maker = build_from_checkpoint if args.checkpoint else build_from_preset
    if any(KV_DTYPES[k] is not None for k in kvs) and "kv_dtype" not in inspect.signature(maker).parameters:
        sys.exit(f"--kv-dtype {args.kv_dtype}: this checkout's {maker.__name__} takes no kv_dtype keyword yet (the fp8 "
                 "KV cache of issue 21); run with --kv-dtype bf16")
    budgets: dict[tuple[str, str], KVBudget] = {}

    def model_config(weights: str) -> MiniMaxM3Config:
        if args.checkpoint:
            config = MiniMaxM3Config.from_hf(args.checkpoint)
        else:
            config = MiniMaxM3Config.preset(args.preset, quantization="mxfp8" if weights == "mxfp8" else None)
        return config.first_layers(args.layers) if args.layers else config

    def size_cache(weights: str, kv: str) -> KVBudget:
        """Every request at its longest length, or on a GPU what fits beside the weights."""
        config = model_config(weights)
        kv_dtype = KV_DTYPES[kv] or dtype  # bf16: the model's own
        layout = config.kv_cache_config(num_pages=1, max_seqs=1, max_pages_per_seq=1, dtype=kv_dtype,
                                        index_dtype=kv_dtype)
        _, extra = capture_reserve(args.token_budget, args.concurrency, layout.page_size, max_seq_len)
        free = reserved = None
        if args.kv_pages is None and cuda and group is None:  # under TP, each rank holds 1/N: not sized
            torch.cuda.synchronize()
            free = torch.cuda.mem_get_info(kw["device"])[0]
            reserved = weight_bytes(config, dtype) + int(args.kv_headroom_gib * 2**30)
        try:
            plan = kv_budget(layout, args.concurrency, max_seq_len, free_bytes=free, reserved_bytes=reserved or 0,
                             extra_pages=extra + 1)
        except ValueError as e:
            sys.exit(f"{kv} KV: {e}")
        if args.kv_pages is not None:
            plan = dataclasses.replace(plan, pages=args.kv_pages)
        budgets[(weights, kv)] = plan
        return plan

    def build(weights: str, kv: str):
        plan = size_cache(weights, kv)
        extra = {"kv_dtype": KV_DTYPES[kv]} if KV_DTYPES[kv] is not None else {}
        if args.checkpoint:
            return build_from_checkpoint(args.checkpoint, num_layers=args.layers, num_pages=plan.pages, **kw, **extra)
        config = model_config(weights)
        base = build_from_preset(config, num_pages=plan.pages, **kw, **extra)
        # Kernel choices for every bucket size of the fullest mode, before any mode runs: every
        # mode's eager and graphed steps of one size then run the same kernels.
        sizes = {k.rows for k in base.with_capture(dataclasses.replace(env, enabled=True, mode=None)).manager.keys()}
        for rows in sorted(sizes):
            base.model.ops.choose_kernels(base.model, rows)
        return base

    # Every weight format with every KV dtype, one build each (one model in memory at a time).
    builds = [(w, kv) for w in formats for kv in kvs]
    base = build(*builds[0])
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    requests = make_requests(args.requests, prompt_len, output_len, base.vocab_size, seed=args.seed,
                             sampling=sampling, rate=args.rate)
    # Warm-up prompts of at most 4 chunks: a long workload's shortest prompt would cost a
    # minute per mode, and warm-up is for the allocator and first launches, not for lengths.
    warm_len = min(prompt_len[0], 4 * args.chunk)
    warmup = make_requests(min(4, args.concurrency), (warm_len, warm_len), (4, 4), base.vocab_size,
                           seed=args.seed + 1, sampling=sampling, prefix="warmup")
    rank = group.rank if group else 0
    console = Console(quiet=rank != 0)
    layers = base.model.config.num_hidden_layers
    spread = measure_routing_spread(base, batch=32)
    console.print(f"{args.checkpoint or args.preset} ({layers} layers) on {args.device}: {args.requests} requests, "
                  + (f"Poisson {args.rate}/s" if args.rate else f"concurrency {args.concurrency}")
                  + f", prompts {prompt_len}, outputs {output_len}, chunk {args.chunk}, budget {args.token_budget}, "
                  + f"overlap {'off' if args.no_overlap else 'on'}" + (f", TP{args.tp}/EP{args.tp}" if group else "")
                  + (f", audits 1 graph step in {'/'.join(map(str, audits))}" if any(audits) else ""))
    if spread is not None:
        console.print(spread.describe())
    runs = [(mode, n) for mode in modes for n in (audits if mode != "none" else [0])]

    def write_json(results: list[dict]) -> None:
        if not args.json or rank != 0:
            return
        meta = dict(vars(args), layers=layers, gpu=torch.cuda.get_device_name() if cuda else None,
                    expert_spread=spread.as_dict() if spread else None, step_log_columns=STEP_LOG_COLUMNS,
                    kv_budgets={f"{w} {kv}": dict(dataclasses.asdict(b), tokens=b.tokens, fits=b.fits,
                                                  longest_requests=b.longest_requests)
                                for (w, kv), b in budgets.items()})
        with open(args.json, "w") as f:
            json.dump({"args": meta, "results": results}, f, indent=1)

    results = []
    against_first = []  # (a later build's result, the first build's of the same run)
    for bi, (weights, kv) in enumerate(builds):
        if bi:  # one model in memory at a time: the next build starts after the last is freed
            base.destroy()
            gone = weakref.ref(base.model)
            del base
            gc.collect()  # runners and engines in reference cycles go only with the collector
            if gone() is not None:
                sys.exit(f"the {' '.join(builds[bi - 1])} model is still referenced; cannot free it for the next build")
            if cuda:
                torch.cuda.empty_cache()
            base = build(weights, kv)
        plan = budgets[(weights, kv)]
        console.print(plan.describe(f"{kv} ({str(base.cache.config.dtype).removeprefix('torch.')})"))
        actual = page_bytes(base.cache.config)
        if actual != plan.page_bytes:  # the build chose other cache dtypes than the sizing assumed
            console.print(f"[yellow]{kv} KV: a page holds {actual} bytes, sized for {plan.page_bytes}[/]")
        for i, (mode, n) in enumerate(runs):
            last = bi == len(builds) - 1 and i == len(runs) - 1
            results.append(run_mode(base, mode, n, env, args, requests, warmup, cuda, console,
                                    trace=bool(args.trace) and last and rank == 0))
            r = results[-1]
            r.update(weights=weights, kv_dtype=kv, kv_fit=plan.describe(kv), kv_fits=plan.fits)
            r["mode"] += "".join([f" {weights}"] * (len(formats) > 1) + [f" kv-{kv}"] * (len(kvs) > 1))
            if bi:
                against_first.append((r, results[i]))
            console.print(f"{r['mode']}: per-user {r['per_user_tok_s_mean']:.2f} tok/s, TTFT p50 "
                          f"{r['ttft_s_p50']:.3f} s, {r['steps']} steps in {r['wall_s']:.1f} s, "
                          f"{r['compiles_after_capture']} compiles and {len(r['kernel_choices'])} kernel validations "
                          f"after capture, worst chunk step / p50 "
                          f"{same_context(r['chunk_step_worst_bin'])}, GC in steps {r['gc_ms_total']:.0f} ms "
                          f"(largest {r['gc_ms_max']:.1f} ms, {r['gc_full_collections']} full)")
            write_json(results)  # after every run: a run cut short by a time box keeps the finished ones
    console.print(table(results))
    for r, first in against_first:
        console.print(f"{r['mode']} vs {first['mode']}: per-user tok/s "
                      f"{r['per_user_tok_s_mean'] / first['per_user_tok_s_mean']:.2f}x, total tok/s "
                      f"{r['total_tok_s'] / first['total_tok_s']:.2f}x")
    for r in results:
        if r["compile_events"] or r["warmup_compile_events"]:
            console.print(f"{r['mode']}: compiled after capture (each stalled its step): "
                          + ", ".join(f"{k} x{v}" for k, v in r["compiled_kernels"].items())
                          + (f"; in warm-up {len(r['warmup_compile_events'])}" if r["warmup_compile_events"] else ""))
    for r in results:
        if not r["kv_fits"]:
            console.print(f"{r['mode']}: {r['kv_fit']}; measured: at most {r['peak_running']} of {args.concurrency} "
                          f"requests ran at once, {r['kv_bound_steps']} steps with requests waiting on KV pages")
    base.destroy()
    if group:
        group.destroy()
    if rank != 0:
        return
    title = plot_title(f"{args.checkpoint or args.preset} ({layers} layers), {args.requests} requests, "
                       + (f"Poisson {args.rate}/s" if args.rate else f"concurrency {args.concurrency}"), cuda)
    if args.plot and not plot(results, args.plot, title):
        console.print("--plot: matplotlib is not installed; no plot written")

if __name__ == "__main__":
    main()
