"""The projections of an MXFP8 rank-of-8 model: bf16 ``F.linear`` (cuBLAS) vs what
``mxfp8.MXFP8Linear`` runs today (dequantise the whole weight, then ``F.linear``) vs the Triton
kernel that reads fp8 and dequantises in registers (``kernels/fp8_linear.py``, every
``linear_config_candidates`` entry and at one or two rows every weight-row form
``gemv_config_candidates``, the best reported) vs the Triton dequantise kernel + F.linear.

GPU only. Shapes (N, K): qkv of a sparse layer (about 1536 x 6144), o_proj 6144 x 1024, dense MLP
gate_up 3072 x 6144 and down 6144 x 1536, at T = 1, 8, 32, 64, 1054 rows. Each path is timed by
graph replay (``timing.graph_replay_us``: 16 calls per graph, over 8 weight sets so the weights
come from HBM, not the 50 MB L2), median of 20 replays. Floors: weight bytes (fp8 + one scale
byte per 32, or bf16) / 4.3 TB/s. Every Triton result is checked against ``F.linear`` on the
dequantised weight first (relative error < 1e-2).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from timing import graph_replay_us

HBM_BYTES_PER_US = 4.3e6
SHAPES = {"qkv": (1536, 6144), "o_proj": (6144, 1024), "mlp.gate_up": (3072, 6144), "mlp.down": (6144, 1536)}
SETS, CALLS, REPS = 8, 16, 20


def measure(name: str, n: int, k: int, t: int, sets: list) -> dict:
    """One projection at ``t`` rows: every path's graph-replay us, after the checks."""
    from models.minimax_m3.kernels.fp8_linear import (
        dequantized_linear,
        gemv_config_candidates,
        linear_config_candidates,
        mxfp8_linear,
    )
    from models.minimax_m3.mxfp8 import dequantize_mxfp8

    x = torch.randn(t, k, device="cuda").bfloat16()
    q, s, wb = sets[0]
    got, ref = mxfp8_linear(x, q, s), F.linear(x, wb)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    if err > 1e-2:
        raise SystemExit(f"{name} T={t}: the Triton kernel differs from F.linear by {err:.2e}")
    outs = [torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    paths = {
        "bf16 F.linear": lambda i: torch.matmul(x, sets[i % SETS][2].t(), out=outs[i]),
        "dequant + F.linear": lambda i: torch.matmul(
            x, dequantize_mxfp8(sets[i % SETS][0], sets[i % SETS][1], torch.bfloat16).t(), out=outs[i]),
        "triton dequant + F.linear": lambda i: outs[i].copy_(dequantized_linear(x, sets[i % SETS][0],
                                                                                 sets[i % SETS][1])),
    }
    cands = linear_config_candidates(t, n, k) + gemv_config_candidates(t, k)
    for ci, cfg in enumerate(cands):
        err_c = ((mxfp8_linear(x, q, s, config=cfg).float() - ref.float()).norm() / ref.float().norm()).item()
        if err_c > 1e-2:
            raise SystemExit(f"{name} T={t}: candidate {cfg} differs from F.linear by {err_c:.2e}")
        paths[f"triton fp8 c{ci}"] = lambda i, cfg=cfg: mxfp8_linear(x, sets[i % SETS][0], sets[i % SETS][1],
                                                                      out=outs[i], config=cfg)
    row = {"proj": name, "N": n, "K": k, "T": t, "rel_err": err, "configs": [str(c) for c in cands],
           "floor_us": {"bf16": 2 * n * k / HBM_BYTES_PER_US, "fp8": n * k * 33 / 32 / HBM_BYTES_PER_US}}
    for label, fn in paths.items():
        calls = [lambda i=i, fn=fn: fn(i) for i in range(CALLS)]
        for c in calls:
            c()  # build and allocate outside the capture
        row[label] = graph_replay_us(calls, REPS)
    best = min(range(len(cands)), key=lambda ci: row[f"triton fp8 c{ci}"])
    row["triton fp8"], row["triton fp8 best"] = row[f"triton fp8 c{best}"], best
    print(f"{name:>12} T={t:5d}: bf16 {row['bf16 F.linear']:7.1f} us (floor {row['floor_us']['bf16']:6.1f}), "
          f"dequant+linear {row['dequant + F.linear']:7.1f}, triton fp8 {row['triton fp8']:7.1f} "
          f"(c{best}; floor {row['floor_us']['fp8']:6.1f}), "
          f"triton dequant+linear {row['triton dequant + F.linear']:7.1f}, err {err:.1e}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,32,64,1054")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mxfp8_linear needs a CUDA GPU")
    from models.minimax_m3.mxfp8 import dequantize_mxfp8, quantize_mxfp8

    rows = []
    for name, (n, k) in SHAPES.items():
        sets = []
        for i in range(SETS):
            g = torch.Generator(device="cuda").manual_seed(i)
            q, s = quantize_mxfp8(torch.randn(n, k, generator=g, device="cuda") * k**-0.5)
            sets.append((q, s, dequantize_mxfp8(q, s, torch.bfloat16)))
        rows += [measure(name, n, k, int(t), sets) for t in args.tokens.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
