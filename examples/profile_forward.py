"""Profile a MiniMax-M3 forward: eager vs graphcap, per decode batch and for a mixed batch.

    python examples/profile_forward.py                                 # tiny preset, CPU or GPU
    python examples/profile_forward.py --preset rank-of-8 --layers 8   # per-GPU shapes of TP8/EP8
    torchrun --nproc-per-node 2 examples/profile_forward.py --preset real --layers 8 --tp 2

With ``--tp N`` (under torchrun) the preset's whole model is sharded over the N ranks (TP for
attention, dense MLP, shared expert and vocab, EP for the routed experts) and the all-reduces
run inside the captured segments; rank 0 prints, the JSON holds every rank's times.

On a GPU the runner replays CUDA graphs (segments with eager attention splices, and whole
graphs for uniform decode); on a CPU it runs the same padded, guarded segment/splice path
eagerly (debug-eager), so the CPU timings only show that the wiring works, not speed. Every
measured step is also checked: graphed logits against eager logits of the same step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from distributed import group_for_tp
from graphcap import CaptureConfig
from graphcap.report import coverage_table, kernel_table, measure_coverage, stats_table
from graphcap.verify.compare import relative_error
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.routing import ROUTINGS, measure_routing_spread
from models.runner import ModelRunner
from steps import TokenChunk


def timed(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Median wall-clock ms of ``fn`` (each call ends in a host sync: the sampled tokens)."""
    fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_again(runner: ModelRunner, chunks: list[TokenChunk], all_logits: bool = False):
    """Run ``chunks`` and rewind their requests, so the same step can run again (any runner
    over the same cache sees the same state)."""
    out = runner.step(chunks, all_logits=all_logits)
    for ch in chunks:
        runner.rewind_request(ch.seq_id, ch.start_pos)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="tiny | slice | rank-of-8 | real")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--decode", default="1,2,4,8", help="decode batch sizes to time")
    p.add_argument("--context", type=int, default=200, help="prompt tokens per request before decoding")
    p.add_argument("--chunk", type=int, default=32, help="prefill chunk of the mixed step")
    p.add_argument("--prefill-chunk", type=int, default=256, help="chunk size for prefilling the prompts")
    p.add_argument("--producer", default="auto", help="auto | torch | triton (the producer op table)")
    p.add_argument("--routing", choices=ROUTINGS, default="model",
                   help="model (the router; random weights get a calibrated bias), or a simulation: uniform, balanced")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--tp", type=int, default=None, help="shard over N ranks (launch with torchrun --nproc-per-node N)")
    args = p.parse_args()

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = MiniMaxM3Config.preset(args.preset)
    if args.tp is not None and config.tp_size > 1:
        sys.exit(f"--tp shards a whole model; {args.preset} is already one rank of TP{config.tp_size} "
                 f"(use --preset real --tp {config.tp_size})")
    group = group_for_tp(args.tp, args.device)
    device = group.device if group else args.device
    rank = group.rank if group else 0
    if args.layers:
        config = config.first_layers(args.layers)
    sizes = [int(x) for x in args.decode.split(",")]
    max_seqs = max(sizes) + 1  # + the prefilling request of the mixed step
    ceiling = max(max(sizes) + args.chunk, args.chunk)
    buckets = tuple(sorted({*sizes, ceiling}))
    # The graphed runner's settings honour GRAPHCAP_* variables (GRAPHCAP_MODE, GRAPHCAP_VALIDATE, ...).
    graphs = CaptureConfig.from_env(CaptureConfig(enabled=True, max_tokens=ceiling, buckets=buckets,
                                                  debug_eager=not cuda))
    graphed = build_from_preset(
        config, device, dtype, backend="auto", max_tokens=max(ceiling, args.prefill_chunk), max_seqs=max_seqs,
        max_seq_len=args.context + args.chunk + 8, producer=args.producer, capture=graphs, group=group,
        routing=args.routing,
    )
    eager = graphed.with_capture(CaptureConfig(max_tokens=ceiling))
    # Eager through the same padded segment/splice path: the same kernels at the same shapes
    # as the replay, so graph vs this is the graph's own error.
    padded = graphed.with_capture(CaptureConfig(enabled=True, max_tokens=ceiling, buckets=buckets, debug_eager=True))
    console = Console(width=None if sys.stdout.isatty() else 130, quiet=rank != 0)
    c = graphed.model.config
    console.print(f"MiniMax-M3 {args.preset}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                  f"{c.num_attention_heads} q / {c.num_key_value_heads} kv heads, {c.num_experts_per_rank} of "
                  f"{c.num_local_experts} experts" + (f" per rank of TP{args.tp}/EP{args.tp}" if group else "")
                  + f"; {device} {dtype}; attention {graphed.backend.describe()}; ops {graphed.model.ops.name}")
    spread = measure_routing_spread(graphed, batch=32)
    if spread is not None:
        console.print(spread.describe())
    t0 = time.perf_counter()
    graphed.capture()
    failures = graphed.validate()
    capture_s = time.perf_counter() - t0

    vocab = graphed.vocab_size
    gen = torch.Generator().manual_seed(0)
    for i in range(max_seqs):  # admit requests and prefill their prompts eagerly
        eager.add_request(i)
        prompt = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
        for start in range(0, args.context, args.prefill_chunk):
            eager.step([TokenChunk(i, start, prompt[start:start + args.prefill_chunk])])
    steps = {f"decode {n}": [TokenChunk(i, args.context, [int(torch.randint(0, vocab, (1,), generator=gen))])
                             for i in range(n)] for n in sizes}
    mixed_prefill = TokenChunk(max_seqs - 1, args.context,
                               torch.randint(0, vocab, (args.chunk,), generator=gen).tolist())
    steps[f"mixed {max(sizes) - 1}+{args.chunk}"] = steps[f"decode {max(sizes)}"][:-1] + [mixed_prefill]

    rows = []
    for name, chunks in steps.items():
        ref = run_again(eager, chunks, all_logits=True).logits
        same_shapes = run_again(padded, chunks, all_logits=True).logits
        out = run_again(graphed, chunks, all_logits=True).logits
        err = relative_error(out.float(), same_shapes.float())
        err_unpadded = relative_error(out.float(), ref.float())
        e_ms = timed(lambda chunks=chunks: run_again(eager, chunks), args.iters, cuda)
        g_ms = timed(lambda chunks=chunks: run_again(graphed, chunks), args.iters, cuda)
        rows.append(dict(step=name, tokens=out.shape[0], eager_ms=e_ms, graphcap_ms=g_ms, speedup=e_ms / g_ms,
                         rel_err=err, rel_err_vs_unpadded=err_unpadded))

    title = "step time (median of {}, wall clock incl. plan and sampling)".format(args.iters)
    if not cuda:
        title += " - CPU: debug-eager wiring check, not a speed measurement"
    table = Table(title=title)
    cols = ["step", "tokens", "eager ms", "graphcap ms"] + (["speedup"] if cuda else [])
    for col in cols + ["err vs padded eager", "err vs unpadded eager"]:
        table.add_column(col, justify="left" if col == "step" else "right")
    for r in rows:
        speed = [f"{r['speedup']:.2f}x"] if cuda else []
        table.add_row(r["step"], str(r["tokens"]), f"{r['eager_ms']:.2f}", f"{r['graphcap_ms']:.2f}", *speed,
                      f"{r['rel_err']:.1e}", f"{r['rel_err_vs_unpadded']:.1e}")
    console.print(table)
    console.print("[dim]err vs padded eager: replay against the same kernels run eagerly at the bucket's shapes. "
                  "err vs unpadded eager also includes rounding differences of other GEMM shapes, which the "
                  "sparse top-k can amplify by flipping near-tied blocks.[/dim]")
    console.print(stats_table(graphed.manager))
    coverage = {}
    for name in (f"decode {max(sizes)}", list(steps)[-1]):
        step = graphed.make_step(steps[name])
        cov = measure_coverage(graphed.manager, step, layers=config.num_hidden_layers)
        for ch in steps[name]:
            graphed.rewind_request(ch.seq_id, ch.start_pos)
        coverage[name] = cov.as_dict()
        console.print(coverage_table(cov), f"[dim]{name}[/dim]")
        if cuda:
            console.print(kernel_table(cov, top=20), f"[dim]{name}: kernels inside graphs[/dim]")
    console.print(f"capture + validation {capture_s:.1f} s; validation failures: {failures or 'none'}"
                  + ("" if cuda else "  (CPU: debug-eager path, no graphs)"))
    every_rank = group.gather_object(rows) if group else [rows]
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(dict(
                preset=args.preset, layers=config.num_hidden_layers, device=args.device, tp=args.tp or 1,
                rows_by_rank=every_rank, expert_spread=spread.as_dict() if spread else None,
                gpu=torch.cuda.get_device_name() if cuda else None, dtype=str(dtype),
                backend=graphed.backend.describe(), ops=graphed.model.ops.name,
                context=args.context, chunk=args.chunk, rows=rows, coverage=coverage, capture_and_validate_s=capture_s,
                validation_failures={str(k): v for k, v in failures.items()},
                graphs={str(key): {k: v for k, v in vars(s).items() if k != "key"}
                        for key, s in graphed.manager.stats.buckets.items()},
            ), f, indent=2)
    worst = max(r["rel_err"] for rank_rows in every_rank for r in rank_rows)
    for runner in (graphed, eager, padded):
        runner.destroy()  # graphs hold NCCL work: free them before the process group
    if group:
        group.destroy()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    if worst > tol:
        raise SystemExit(f"graphed logits differ from eager at the same shapes (relative error {worst:.2e} > {tol})")


if __name__ == "__main__":
    main()
