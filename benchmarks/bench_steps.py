"""Step times at 60 layers: decode 1 / 8 / 32 and a mixed step of 30 decodes + a 1024-token chunk,
replayed (``full_and_piecewise``), wall clock and GPU-busy.

GPU only. ``rank-of-8`` (all 60 layers, random bf16 weights), flashinfer + Triton attention,
fused producers; every request holds ``--context`` positions (written straight into the cache
bookkeeping over pages filled with random values, so attention costs what it would over a
prompt and every request's hidden states differ, as the router would see them). Per step: the
median wall ms of ``runner.step`` (plan, copy-in, replay, lm_head and the greedy tokens read
on the host; ``--iters`` runs after 3 warm-ups, the requests rewound after each) and the
GPU-busy us (the sum of every kernel's duration in one profiled step, ``graphcap.report.
measure_coverage``), per step and per layer.

It uses only the runner API that every release has (``build_from_preset``, ``capture``,
``step``, ``make_step``, ``rewind_request``, ``manager``), so the same file measures an older
checkout side by side (``PYTHONPATH=<checkout> python benchmarks/bench_steps.py``).

Routing (where the checkout has it): ``--routing model`` (the calibrated random router, the
default), ``uniform`` or ``balanced`` (the device-side simulation), ``--concentrated`` (the
router of uncalibrated random weights, which sends a batch to a few experts: what earlier
figures measured). The expert spread of a decode step of 32 is printed and stored; MoE GPU time
per MoE layer (the fused MoE kernels, ``_moe_*``) is reported beside the total.
"""

from __future__ import annotations

import argparse
import inspect
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
    p.add_argument("--routing", default="model", help="model | uniform | balanced")
    p.add_argument("--concentrated", action="store_true", help="uncalibrated random router (earlier figures)")
    p.add_argument("--decode", default="1,8,32", help="decode batch sizes")
    p.add_argument("--quantization", default=None, help="mxfp8: fp8 weights with E8M0 scales (random, quantized)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    config = MiniMaxM3Config.preset(args.preset)
    if args.quantization:
        config = config.with_quantization(args.quantization)
    if args.layers:
        config = config.first_layers(args.layers)
    sizes = sorted({32, *(int(n) for n in args.decode.split(","))})
    n_req, max_tokens = max(32, *sizes), 1054
    page = config.sparse_block_size
    pages = n_req * -(-(args.context + 1) // page) + -(-max_tokens // page) + 2 + 3 * 32
    routing = {}
    if args.routing != "model" or args.concentrated:  # an older checkout has neither argument
        routing = dict(routing=args.routing, balance_routing=not args.concentrated)
    t0 = time.perf_counter()
    runner = build_from_preset(config, "cuda", torch.bfloat16, backend="auto", max_tokens=max_tokens, max_seqs=n_req,
                               max_seq_len=args.context + max_tokens + 8, num_pages=pages,
                               capture=CaptureConfig(enabled=True, max_tokens=max_tokens), **routing)
    build_s = time.perf_counter() - t0
    weights_gib = sum(t.numel() * t.element_size() for t in runner.model.parameters()) / 2**30
    print(f"{args.label:>8} built in {build_s:.1f} s, weights {weights_gib:.2f} GiB"
          + (f" ({args.quantization})" if args.quantization else ""), flush=True)
    spread = None
    if "balance_routing" in inspect.signature(build_from_preset).parameters:
        from models.minimax_m3.routing import measure_routing_spread

        spread = measure_routing_spread(runner, batch=32)
        print(f"{args.label:>8} {spread.describe()}", flush=True)
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    # Random context: every request's pages hold different keys, so attention (and the hidden
    # states the router sees) differ per request, as over real prompts; zeroed pages would make
    # every decode token alike and route a batch to fewer experts.
    for t in (runner.cache.k_cache, runner.cache.v_cache, runner.cache.index_k_cache):
        t.normal_()
    for i in range(n_req):
        runner.add_request(i)
        runner.cache.reserve(i, args.context)
        runner.cache.set_written(i, args.context)

    def decode(n: int) -> list:
        return [TokenChunk(i, args.context, [int(torch.randint(0, vocab, (1,), generator=gen))]) for i in range(n)]

    chunk = max_tokens - 30
    steps = {f"decode {n}": decode(n) for n in sizes}
    steps[f"mixed 30+{chunk}"] = decode(30) + [
        TokenChunk(n_req - 1, args.context, torch.randint(0, vocab, (chunk,), generator=gen).tolist())]
    layers = config.num_hidden_layers
    moe_layers = sum(config.is_moe(i) for i in range(layers))
    step_spread = None
    if spread is not None:  # the spread of the measured decode step itself, on its real context
        step_spread = measure_routing_spread(runner, step=steps["decode 32"])
        print(f"{args.label:>8} this benchmark's decode 32: {step_spread.describe()}", flush=True)
    rows = {}
    for name, chunks in steps.items():
        ms = step_ms(runner, chunks, args.iters)["wall_ms"]
        cov = measure_coverage(runner.manager, runner.make_step(chunks), layers=layers)
        for ch in chunks:
            runner.rewind_request(ch.seq_id, ch.start_pos)
        moe_us = sum(us for k, us in cov.graph_us_by_name.items() if "_moe_" in k)
        moe_us += sum(us for site in cov.eager_us_by_site.values() for k, us in site.items() if "_moe_" in k)
        rows[name] = dict(wall_ms=round(ms, 3), gpu_busy_us=round(cov.busy_us, 1),
                          gpu_us_per_layer=round(cov.busy_us / layers, 1),
                          moe_us_per_moe_layer=round(moe_us / max(moe_layers, 1), 1),
                          kernels_in_graphs=cov.in_graphs, kernels_eager=cov.eager)
        print(f"{args.label:>8} {name:>14}: wall {ms:8.2f} ms, GPU-busy {cov.busy_us / 1e3:8.2f} ms "
              f"({cov.busy_us / layers:6.1f} us/layer, MoE {moe_us / max(moe_layers, 1):6.1f} us/MoE layer), "
              f"kernels {cov.in_graphs} in graphs + {cov.eager} eager", flush=True)
    res = dict(label=args.label, gpu=torch.cuda.get_device_name(), preset=args.preset, layers=layers,
               context=args.context, iters=args.iters, build_s=round(build_s, 2), capture_s=round(capture_s, 2),
               routing=args.routing, concentrated=args.concentrated, quantization=args.quantization,
               weights_gib=round(weights_gib, 2),
               expert_spread=spread.as_dict() if spread else None,
               step_expert_spread=step_spread.as_dict() if step_spread else None, steps=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
