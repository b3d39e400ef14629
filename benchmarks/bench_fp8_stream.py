"""How fast a plain Triton kernel streams fp8 weights on this GPU, row-major or tiled.

A yardstick for the MXFP8 decode kernels: each program reads ``BN`` weight rows ``BK`` columns
per step (one e4m3 ``tl.dot`` against 16 columns, the decode shape) over a ``[10 x 6144,
6144]`` matrix (ten experts' gate/up rows at rank-of-8), three such matrices per graph so that
the reads come from HBM. ``--tiled``-style rows store each program's ``[BN, BK]`` steps as
contiguous blocks (what a repacked weight layout would give) instead of ``BK`` bytes of each
row ``K`` bytes apart. No scales, no per-block scaling: the bandwidth left once those are gone.

Usage (GPU): ``python benchmarks/bench_fp8_stream.py --json stream.json``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_kernel(w_ptr, b_ptr, out_ptr, K, TILED: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                   BT: tl.constexpr):
    """``out[rows, :BT] = W[rows, :] @ B^T`` for this program's ``BN`` rows, ``BK`` per step."""
    pid = tl.program_id(0)
    r = tl.arange(0, BN)
    c = tl.arange(0, BK)
    t = tl.arange(0, BT)
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    if TILED:  # program pid's steps are consecutive [BN, BK] blocks
        base = w_ptr + pid.to(tl.int64) * BN * K + r[:, None] * BK + c[None, :]
        step = BN * BK
    else:
        base = w_ptr + (pid * BN + r[:, None]).to(tl.int64) * K + c[None, :]
        step = BK
    bb = b_ptr + c[:, None] + t[None, :] * K
    for i in range(K // BK):
        acc = tl.dot(tl.load(base + i * step), tl.load(bb + i * BK), acc)
    tl.store(out_ptr + (pid * BN + r[:, None]) * BT + t[None, :], acc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    N, K, BT = 10 * 6144, 6144, 16
    ws = [torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn) for _ in range(3)]
    b = torch.randn(BT, K, device="cuda").to(torch.float8_e4m3fn)
    out = torch.empty(N, BT, device="cuda")
    rows = []
    for tiled in (False, True):
        for bk in (128, 256):
            for bn in (64, 128):
                for stages in (3, 4, 6):
                    if bn * bk * stages > 160 * 1024:
                        continue

                    def calls(tiled=tiled, bk=bk, bn=bn, stages=stages) -> None:
                        for w in ws:
                            _stream_kernel[(N // bn,)](w, b, out, K, TILED=tiled, BK=bk, BN=bn, BT=BT, num_warps=4,
                                                       num_stages=stages)

                    calls()
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        calls()
                    us = 1e3 * triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median") / len(ws)
                    row = dict(tiled=tiled, bk=bk, bn=bn, stages=stages, us=round(us, 1),
                               tbps=round(N * K / (us * 1e-6) / 1e12, 2))
                    print(row, flush=True)
                    rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "N": N, "K": K, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
