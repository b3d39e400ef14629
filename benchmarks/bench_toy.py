"""Toy transformer: eager vs graphcap (piecewise and decode graphs) per token count.

GPU only. Each step is a batch of ``n`` decode tokens (one per sequence, 64 tokens of context)
run through ``CaptureManager.run``: eager = graphs disabled; piecewise = graph segments with
the attention splice eager between them; decode = one graph through the graph-safe splice.
Times are medians of CUDA-event timed steps after warm-up, each step including the host work
(plan, input copy-in, replay).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from graphcap import CaptureConfig, CaptureManager, GraphKey
from graphcap.report import measure_coverage
from models.toy.bare import ToySource, ToyTransformer, make_step, toy_static_inputs
from models.toy.config import ToyConfig


def time_steps(manager: CaptureManager, step, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        manager.run(step)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        manager.run(step)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default="bench_toy.json")
    args = parser.parse_args()
    counts = [int(x) for x in args.tokens.split(",")]
    ceiling = max(counts)
    cfg = ToyConfig(num_layers=args.layers, hidden=args.hidden, num_heads=16, vocab=32000, max_seqs=ceiling,
                    max_len=128, max_tokens=ceiling)
    torch.manual_seed(0)
    model = ToyTransformer(cfg, "cuda", torch.bfloat16)
    model.k_cache.normal_(), model.v_cache.normal_()
    static = toy_static_inputs(cfg, "cuda")

    def manager_for(config: CaptureConfig) -> CaptureManager:
        m = CaptureManager(model.forward, static, config, ToySource(model))
        m.register("model", model)
        m.register("kv_cache", model.cache_tensors, mutable=True)
        return m

    eager = manager_for(CaptureConfig(enabled=False, max_tokens=ceiling))
    graphs = manager_for(CaptureConfig(enabled=True, max_tokens=ceiling, buckets=tuple(counts), validate=True))
    graphs.capture()
    rows = []
    for n in counts:
        decode = make_step(cfg, [(i, 64, 1) for i in range(n)])
        mixed = dataclasses.replace(decode, uniform_decode=False)  # the piecewise graph of the same bucket
        e = time_steps(eager, decode, args.iters)
        s = time_steps(graphs, mixed, args.iters)
        w = time_steps(graphs, decode, args.iters)
        piece_stats, decode_stats = graphs.stats.graph(GraphKey(n, False)), graphs.stats.graph(GraphKey(n, True))
        rows.append(dict(
            tokens=n, eager_ms=e, piecewise_ms=s, decode_ms=w, speedup_piecewise=e / s, speedup_decode=e / w,
            capture_ms_piecewise=piece_stats.capture_ms, capture_ms_decode=decode_stats.capture_ms,
            mib_piecewise=piece_stats.memory_mib, mib_decode=decode_stats.memory_mib, segments=piece_stats.segments,
        ))
    cov = measure_coverage(graphs, make_step(cfg, [(i, 64, 1) for i in range(8)]))
    result = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__,
        model=dict(layers=cfg.num_layers, hidden=cfg.hidden, heads=cfg.num_heads, vocab=cfg.vocab, context=64,
                   dtype="bf16"),
        validation_failures={str(k): v for k, v in graphs.failures.items()},
        total_capture_ms=graphs.stats.capture_ms, total_graph_mib=graphs.stats.memory_mib,
        coverage_decode8=cov.as_dict(), rows=rows,
    )
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"GPU {result['gpu']}, toy {cfg.num_layers} layers x hidden {cfg.hidden}, bf16, decode batches, context 64")
    print(f"{'tokens':>6} {'eager ms':>9} {'piece ms':>8} {'decode ms':>9} {'x piece':>7} {'x decode':>8} "
          f"{'cap ms s/w':>12} {'MiB s/w':>12}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['eager_ms']:>9.3f} {r['piecewise_ms']:>8.3f} {r['decode_ms']:>9.3f} "
              f"{r['speedup_piecewise']:>7.2f} {r['speedup_decode']:>8.2f} {r['capture_ms_piecewise']:>5.0f}/"
              f"{r['capture_ms_decode']:<6.0f} {r['mib_piecewise']:>5.1f}/{r['mib_decode']:<6.1f}")
    print(f"capture total {graphs.stats.capture_ms:.0f} ms, {graphs.stats.memory_mib:.1f} MiB; "
          f"validation failures: {graphs.failures or 'none'}")


if __name__ == "__main__":
    main()
