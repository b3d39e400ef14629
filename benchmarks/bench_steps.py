"""Step times at 60 layers: decode 1 / 8 / 32 and a mixed step of 30 decodes + a 1024-token chunk,
replayed (``full_and_piecewise``), wall clock and GPU-busy.

GPU only. ``rank-of-8`` (all 60 layers, random bf16 weights), flashinfer + Triton attention,
fused producers; every request holds ``--context`` positions (written straight into the cache
bookkeeping over pages filled with random values, so attention costs what it would over a
prompt and every request's hidden states differ, as the router would see them). Per step: the
median wall ms of ``runner.step`` (plan, copy-in, replay, lm_head and the greedy tokens read
on the host; ``--iters`` runs after 3 warm-ups, the requests rewound after each), the
GPU-busy us (the sum of every kernel's duration in one profiled step, ``graphcap.report.
measure_coverage``), per step and per layer, and the graph span (first in-graph kernel's start
to the last one's end, gaps included: a decode step's replay; the figure to compare where
kernels overlap under programmatic dependent launch, whose waits GPU-busy counts). With
``--top-kernels N`` it prints the N kernels with the most GPU time and the N that take the most of
the span (each kernel's time past the kernels that started before it).

It uses only the runner API that every release has (``build_from_preset``, ``capture``,
``step``, ``make_step``, ``rewind_request``, ``manager``), so the same file measures an older
checkout side by side (``PYTHONPATH=<checkout> python benchmarks/bench_steps.py``).

Routing (where the checkout has it): ``--routing model`` (the calibrated random router, the
default), ``uniform`` or ``balanced`` (the device-side simulation), ``--concentrated`` (the
router of uncalibrated random weights, which sends a batch to a few experts: what earlier
figures measured). The expert spread of a decode step of 32 is printed and stored; MoE GPU time
per MoE layer (the fused MoE kernels, ``_moe_*``) is reported beside the total.

The block tables are as wide as the longest sequence the step needs unless ``--max-seq-len``
widens them to a deployment's (e.g. 131072): a decode graph's indexer grid is sized by that
width, so a short context in a wide table is what a serving engine runs.
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


def pdl_mode() -> str:
    """The checkout's programmatic dependent launch mode (``off`` where it has none). Under
    ``early`` a kernel's duration includes its wait for the one before, so GPU-busy and the
    per-kernel sums overstate: compare graph spans, or kernel sums with ``GRAPHCAP_PDL=off``."""
    try:
        from attention.kernels.pdl import pdl_mode as mode
    except ImportError:
        return "off"
    return mode()


def top_kernels(cov, layers: int, n: int) -> dict[str, float]:
    """The ``n`` kernels with the most GPU time in one step (graphs and eager splices, names
    cut to 40 characters), in us per layer: where a step's time goes."""
    total: dict[str, float] = {}
    for k, us in list(cov.graph_us_by_name.items()) + [kv for site in cov.eager_us_by_site.values()
                                                      for kv in site.items()]:
        total[k[:40]] = total.get(k[:40], 0.0) + us
    return {k: round(us / layers, 1) for k, us in sorted(total.items(), key=lambda kv: -kv[1])[:n]}


def exposed_kernels(cov, layers: int, n: int) -> dict[str, float]:
    """The ``n`` kernels (and idle time) that take the most of the step's GPU span, us per
    layer (``Coverage.exposed_us_by_name``: a kernel's time past the kernels before it, so
    overlapped waits under programmatic dependent launch count once). Empty on checkouts
    without it."""
    if not n or not hasattr(cov, "exposed_us_by_name"):
        return {}
    return {k: round(us / layers, 1) for k, us in cov.exposed_us_by_name().most_common(n)}


def kernel_choices(runner, sizes: list[int] | None) -> list[str]:
    """The tuner's choices for the MoE and the MXFP8 projections at ``sizes`` rows (None: every
    size it chose for) (names as the tuner lists them; the MoE's configs by candidate index,
    with the config itself), so a run says which kernels its figures measured. Empty on
    checkouts without a tuner."""
    ops = getattr(runner.model, "ops", None)
    tuner = getattr(ops, "tuner", None)
    moe_configs = getattr(getattr(ops, "moe", None), "_configs", {})
    out = []
    for (op, key), choice in sorted(getattr(tuner, "choices", {}).items(), key=lambda kv: str(kv[0])):
        rows = key if op == "moe" else key[-1] if isinstance(key, tuple) else None
        if op in ("moe", "mxfp8_linear") and (sizes is None or rows in sizes):
            what = choice.chosen
            if op == "moe" and key in moe_configs:
                what += f" {moe_configs[key]}"
            out.append(f"{op} {key}: {what}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="rank-of-8")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--context", type=int, default=3000)
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="block-table width in tokens, as a deployment's longest sequence (a decode graph's sparse "
                        "attention grids are sized by it); default: the context plus the mixed step's tokens")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--label", default="", help="names the checkout in the JSON (e.g. before / after)")
    p.add_argument("--routing", default="model", help="model | uniform | balanced")
    p.add_argument("--concentrated", action="store_true", help="uncalibrated random router (earlier figures)")
    p.add_argument("--decode", default="1,8,32", help="decode batch sizes")
    p.add_argument("--mixed-decodes", type=int, default=30, help="decode requests beside the mixed step's chunk")
    p.add_argument("--chunk", type=int, default=1024, help="prompt tokens of the mixed step's chunk")
    p.add_argument("--requests", type=int, default=32,
                   help="requests holding --context (at least the largest decode batch); fewer at long context")
    p.add_argument("--quantization", default=None, help="mxfp8: fp8 weights with E8M0 scales (random, quantized)")
    p.add_argument("--backend", default="auto",
                   help="attention backend kind (attention.registry), e.g. flashinfer_tiles")
    p.add_argument("--kv-dtype", default=None, help="KV and index-K cache dtype: bf16 (default) or fp8")
    p.add_argument("--top-kernels", type=int, default=0, help="print the N kernels with the most GPU time per step")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    config = MiniMaxM3Config.preset(args.preset)
    if args.quantization:
        config = config.with_quantization(args.quantization)
    if args.layers:
        config = config.first_layers(args.layers)
    sizes = sorted({int(n) for n in args.decode.split(",")})
    # every decode batch and the mixed step's decodes hold --context; the chunk is one more request
    n_req = max(args.requests, *sizes, args.mixed_decodes + 1)
    max_tokens = max(1054, args.mixed_decodes + args.chunk)
    page = config.sparse_block_size
    pages = n_req * -(-(args.context + 1) // page) + -(-max_tokens // page) + 2 + 3 * 32
    routing = {}
    if args.kv_dtype:  # an older checkout has no kv_dtype
        routing["kv_dtype"] = args.kv_dtype
    if args.routing != "model" or args.concentrated:  # an older checkout has neither argument
        routing.update(routing=args.routing, balance_routing=not args.concentrated)
    t0 = time.perf_counter()
    max_seq_len = max(args.max_seq_len or 0, args.context + max_tokens + 8)
    runner = build_from_preset(config, "cuda", torch.bfloat16, backend=args.backend, max_tokens=max_tokens,
                               max_seqs=n_req, max_seq_len=max_seq_len, num_pages=pages,
                               capture=CaptureConfig(enabled=True, max_tokens=max_tokens), **routing)
    build_s = time.perf_counter() - t0
    weights_gib = sum(t.numel() * t.element_size() for t in runner.model.parameters()) / 2**30
    print(f"{args.label:>8} built in {build_s:.1f} s, weights {weights_gib:.2f} GiB"
          + (f" ({args.quantization})" if args.quantization else ""), flush=True)
    spread = None
    if "balance_routing" in inspect.signature(build_from_preset).parameters:
        from models.minimax_m3.routing import measure_routing_spread

        spread = measure_routing_spread(runner, batch=min(32, n_req))
        print(f"{args.label:>8} {spread.describe()}", flush=True)
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    chosen = kernel_choices(runner, sizes)
    for line in chosen:
        print(f"{args.label:>8} chose {line}", flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    # Random context: every request's pages hold different keys, so attention (and the hidden
    # states the router sees) differ per request, as over real prompts; zeroed pages would make
    # every decode token alike and route a batch to fewer experts.
    for t in (runner.cache.k_cache, runner.cache.v_cache, runner.cache.index_k_cache):
        if t.dtype.itemsize == 1:  # fp8 e4m3 (no normal_ kernel): bf16 draws, cast a layer at a time
            for layer in t:
                layer.copy_(torch.randn(layer.shape, dtype=torch.bfloat16, device=layer.device))
        else:
            t.normal_()
    for i in range(n_req):
        runner.add_request(i)
        runner.cache.reserve(i, args.context)
        runner.cache.set_written(i, args.context)

    def decode(n: int) -> list:
        return [TokenChunk(i, args.context, [int(torch.randint(0, vocab, (1,), generator=gen))]) for i in range(n)]

    chunk, md = args.chunk, args.mixed_decodes
    steps = {f"decode {n}": decode(n) for n in sizes}
    steps[f"mixed {md}+{chunk}"] = decode(md) + [
        TokenChunk(n_req - 1, args.context, torch.randint(0, vocab, (chunk,), generator=gen).tolist())]
    layers = config.num_hidden_layers
    moe_layers = sum(config.is_moe(i) for i in range(layers))
    step_spread = None
    if spread is not None and 32 in sizes:  # the spread of the measured decode step itself, on its real context
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
        # GPU us per step of each eager splice site (sparse attention: indexer + top-k + attention)
        sites = {site: round(sum(c.values()), 1) for site, c in cov.eager_us_by_site.items()}
        # the sparse layers' Triton kernels (indexer partial + merge, attention + split merge),
        # in graphs or eager: the figure fp8 and bf16 caches are compared by
        n_sparse = sum(config.is_sparse(i) for i in range(layers))
        sparse_us = sum(us for k, us in cov.graph_us_by_name.items() if _is_sparse_kernel(k))
        sparse_us += sum(us for site in cov.eager_us_by_site.values() for k, us in site.items() if _is_sparse_kernel(k))
        span = getattr(cov, "graph_span_us", 0.0)  # an older checkout's Coverage may lack it
        rows[name] = dict(wall_ms=round(ms, 3), gpu_busy_us=round(cov.busy_us, 1), graph_span_us=round(span, 1),
                          eager_us_by_site=sites,
                          sparse_kernels_us_per_sparse_layer=round(sparse_us / max(n_sparse, 1), 1),
                          gpu_us_per_layer=round(cov.busy_us / layers, 1),
                          moe_us_per_moe_layer=round(moe_us / max(moe_layers, 1), 1),
                          kernels_in_graphs=cov.in_graphs, kernels_eager=cov.eager,
                          kernel_us_per_layer=top_kernels(cov, layers, args.top_kernels),
                          exposed_us_per_layer=exposed_kernels(cov, layers, args.top_kernels))
        print(f"{args.label:>8} {name:>14}: wall {ms:8.2f} ms, GPU-busy {cov.busy_us / 1e3:8.2f} ms "
              f"({cov.busy_us / layers:6.1f} us/layer, MoE {moe_us / max(moe_layers, 1):6.1f} us/MoE layer), "
              f"graph span {span / 1e3:6.2f} ms ({span / layers:6.1f} us/layer), "
              f"kernels {cov.in_graphs} in graphs + {cov.eager} eager; sparse attention kernels "
              f"{sparse_us / max(n_sparse, 1):6.1f} us/sparse layer", flush=True)
        if args.top_kernels:
            print(f"{args.label:>8} {name:>14}: largest kernels, GPU us per layer: "
                  + ", ".join(f"{k} {v}" for k, v in rows[name]["kernel_us_per_layer"].items()), flush=True)
        if args.top_kernels and rows[name]["exposed_us_per_layer"]:
            print(f"{args.label:>8} {name:>14}: span by kernel (time past the kernels before it), us per layer: "
                  + ", ".join(f"{k} {v}" for k, v in rows[name]["exposed_us_per_layer"].items()), flush=True)
        if sites:
            per = {site: round(us / max(n_sparse, 1), 1) for site, us in sites.items()}
            print(f"{args.label:>8} {name:>14}: eager GPU us per step by site {sites}; / {n_sparse} sparse layers "
                  f"{per}", flush=True)
    # the other sizes' choices too (the mixed step's padded size among them), now that all have run
    chosen_rest = [c for c in kernel_choices(runner, None) if c not in chosen]
    for line in chosen_rest:
        print(f"{args.label:>8} chose {line}", flush=True)
    chosen += chosen_rest
    res = dict(label=args.label, gpu=torch.cuda.get_device_name(), pdl=pdl_mode(), preset=args.preset, layers=layers,
               context=args.context, max_seq_len=max_seq_len, requests=n_req, mixed_decodes=md, chunk=chunk,
               iters=args.iters,
               build_s=round(build_s, 2), capture_s=round(capture_s, 2), kernel_choices=chosen,
               backend=args.backend, kv_dtype=args.kv_dtype or "bf16",
               routing=args.routing, concentrated=args.concentrated, quantization=args.quantization,
               weights_gib=round(weights_gib, 2),
               expert_spread=spread.as_dict() if spread else None,
               step_expert_spread=step_spread.as_dict() if step_spread else None, steps=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def _is_sparse_kernel(name: str) -> bool:
    """The Triton sparse-attention kernels (``attention.kernels.indexer``, ``.sparse`` and
    ``.sparse_blocks``)."""
    return any(k in name for k in ("_partial_kernel", "_merge_kernel", "_attn_kernel", "_bucket_pairs_kernel"))


if __name__ == "__main__":
    main()
