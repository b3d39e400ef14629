"""Time given ``MoEConfig`` s of the fused MoE on MXFP8 weights at one step size, with the time
per kernel: for tile sets the tuner is not offered (``bench_m3_moe.py`` times the candidates).

Same weights, routing (its expert spread printed) and timing as ``bench_m3_moe.py`` (rank-of-8
shapes, 8 calls per graph rotating over 2 routed weight sets). Each config is ``field=value`` pairs joined by commas,
configs joined by ``;`` (``default``: ``default_moe_config(T)``).

Usage (GPU): ``python benchmarks/bench_moe_configs.py --tokens 1054 --configs
"default;fp8_mma=1,mma_block_t=64,mma_num_stages=3" --kernels --json out.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from bench_m3_moe import ALPHA, LIMIT, Dims, Weights, reference_fp32, rel_err, step_inputs
from timing import graph_replay_us


def parse_config(spec: str):
    """``"default"`` -> None, else ``MoEConfig(**fields)`` (bool fields as 0/1)."""
    from models.minimax_m3.kernels.moe import MoEConfig

    if spec == "default":
        return None
    kinds = {f.name: f.type for f in dataclasses.fields(MoEConfig)}
    kw = {}
    for part in spec.split(","):
        name, value = part.split("=")
        kw[name] = value in ("1", "True") if kinds[name] in (bool, "bool") else int(value)
    return MoEConfig(**kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--kernels", action="store_true", help="also the GPU time per kernel (torch.profiler)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from models.minimax_m3.kernels.moe import fused_moe

    T, d, calls_n = args.tokens, Dims(), 8
    torch.manual_seed(0)
    wts = Weights(d, 2, calls_n, "cuda", torch.bfloat16)
    wts.quantize(calls_n)
    x, _, _, ids, w, _ = step_inputs(T, d, "cuda", torch.bfloat16)  # prints the expert spread
    ref = reference_fp32(x, ids, w, *wts.fp8[0][2])
    rows = []
    for spec in args.configs.split(";"):
        try:
            cfg = parse_config(spec)
        except (ValueError, KeyError, TypeError) as exc:
            rows.append(dict(T=T, spec=spec, error=repr(exc)))
            print(json.dumps(rows[-1]), flush=True)
            continue
        outs = [torch.empty(T, d.hidden, dtype=torch.bfloat16, device="cuda") for _ in range(calls_n)]
        calls = [lambda i=i, out=out, cfg=cfg: fused_moe(x, ids, w, *wts.fp8[i][0], ALPHA, LIMIT, out, config=cfg,
                                                         scales=wts.fp8[i][1]) for i, out in enumerate(outs)]
        try:  # a tile set that does not compile (registers, shared memory) is a row, not the end of the run
            for c in calls:
                c()
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(T=T, spec=spec, error=repr(exc)[:400]))
            print(json.dumps(rows[-1]), flush=True)
            continue
        row = dict(T=T, spec=spec, us=round(graph_replay_us(calls, 20), 1), rel_err=rel_err(outs[0], ref))
        if args.kernels:
            from torch.profiler import ProfilerActivity, profile

            reps = 3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    for c in calls:
                        c()
                torch.cuda.synchronize()
            per: dict[str, float] = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    per[e.name[:40]] = per.get(e.name[:40], 0.0) + e.device_time / (reps * calls_n)
            row["kernels_us"] = {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
