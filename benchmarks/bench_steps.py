"""Step times at 60 layers: decode 1 / 8 / 32 and a mixed step of 30 decodes + a 1024-token chunk,
replayed (``full_and_piecewise``), wall clock and GPU-busy.

GPU only. ``rank-of-8`` (all 60 layers, random bf16 weights), flashinfer + Triton attention,
fused producers; every request holds ``--context`` positions (written straight into the cache
bookkeeping: attention reads whatever the pages hold, which costs the same). Per step: the
median wall ms of ``runner.step`` (plan, copy-in, replay, lm_head and the greedy tokens read
on the host; ``--iters`` runs after 3 warm-ups, the requests rewound after each) and the
GPU-busy us (the sum of every kernel's duration in one profiled step, ``graphcap.report.
measure_coverage``), per step and per layer.

It uses only the runner API that every release has (``build_from_preset``, ``capture``,
``step``, ``make_step``, ``rewind_request``, ``manager``), so the same file measures an older
checkout side by side (``PYTHONPATH=<checkout> python benchmarks/bench_steps.py``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from timing import step_ms

from graphcap import CaptureConfig
from graphcap.report import measure_coverage
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config

try:
    from steps import TokenChunk
except ImportError:  # a checkout before the step vocabulary moved
    from attention.metadata import TokenChunk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="rank-of-8")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--context", type=int, default=3000)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--label", default="", help="names the checkout in the JSON (e.g. before / after)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    config = MiniMaxM3Config.preset(args.preset)
    if args.layers:
        config = config.first_layers(args.layers)
    n_req, max_tokens = 32, 1054
    page = config.sparse_block_size
    pages = n_req * -(-(args.context + 1) // page) + -(-max_tokens // page) + 2
    runner = build_from_preset(config, "cuda", torch.bfloat16, backend="auto", max_tokens=max_tokens, max_seqs=n_req,
                               max_seq_len=args.context + max_tokens + 8, num_pages=pages,
                               capture=CaptureConfig(enabled=True, max_tokens=max_tokens))
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    for i in range(n_req):
        runner.add_request(i)
        runner.cache.reserve(i, args.context)
        runner.cache.set_written(i, args.context)

    def decode(n: int) -> list:
        return [TokenChunk(i, args.context, [int(torch.randint(0, vocab, (1,), generator=gen))]) for i in range(n)]

    chunk = max_tokens - (n_req - 2)
    steps = {f"decode {n}": decode(n) for n in (1, 8, 32)}
    steps[f"mixed {n_req - 2}+{chunk}"] = decode(n_req - 2) + [
        TokenChunk(n_req - 1, args.context, torch.randint(0, vocab, (chunk,), generator=gen).tolist())]
    layers = config.num_hidden_layers
    rows = {}
    for name, chunks in steps.items():
        ms = step_ms(runner, chunks, args.iters)["wall_ms"]
        cov = measure_coverage(runner.manager, runner.make_step(chunks), layers=layers)
        for ch in chunks:
            runner.rewind_request(ch.seq_id, ch.start_pos)
        rows[name] = dict(wall_ms=round(ms, 3), gpu_busy_us=round(cov.busy_us, 1),
                          gpu_us_per_layer=round(cov.busy_us / layers, 1),
                          kernels_in_graphs=cov.in_graphs, kernels_eager=cov.eager)
        print(f"{args.label:>8} {name:>14}: wall {ms:8.2f} ms, GPU-busy {cov.busy_us / 1e3:8.2f} ms "
              f"({cov.busy_us / layers:6.1f} us/layer), kernels {cov.in_graphs} in graphs + {cov.eager} eager",
              flush=True)
    res = dict(label=args.label, gpu=torch.cuda.get_device_name(), preset=args.preset, layers=layers,
               context=args.context, iters=args.iters, capture_s=round(capture_s, 2), steps=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
