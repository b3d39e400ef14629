"""How fast plain Triton kernels stream fp8 weights on this GPU: the yardstick for the MXFP8
decode kernels, and what each part of their per-step work costs.

Each program reads ``BN`` weight rows ``BK`` columns per step of a ``[10 x 6144, 6144]`` matrix
(ten experts' gate/up rows at rank-of-8) against 16 columns (the decode shape), three such
matrices per graph so that the reads come from HBM. Rows (``--part``):

- ``stream``: one e4m3 ``tl.dot`` per step, no scales, row-major or ``tiled`` (each program's
  ``[BN, BK]`` steps stored as contiguous blocks, what a repacked weight layout would give).
- ``scaled``: the MXFP8 work on top, 128 columns per step: ``f16`` dequantises the weights to
  f16 in registers (the ``mma_f16`` MoE's inner loop) with no scales, with the E8M0 scale
  words row-major (``[rows, K/128]``, the checkpoint's layout read as int32 words: one word
  of each of the program's rows per step) or step-major (``[K/128, rows]``: a step's words
  contiguous); ``e4m3`` scales a fresh product per 32-column block (the ``fp8_mma`` MoE's
  inner loop) against one B part or two (``hi + lo``).

Bandwidth counts the weight bytes plus a scale byte per 32 (``33/32``) for every row.

Usage (GPU): ``python benchmarks/bench_fp8_stream.py --json stream.json`` (``--part stream`` or
``--part scaled`` for one half).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from timing import Timer

from models.minimax_m3.kernels.fp8_tiles import scale_factor


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


@triton.jit
def _f16_kernel(w_ptr, s_ptr, b_ptr, out_ptr, K, stride_sr, stride_sk, SCALES: tl.constexpr, BN: tl.constexpr,
                BT: tl.constexpr):
    """``out = dequant(W) @ B^T`` with the weights dequantised to f16 in registers, 128 columns
    per step, as ``moe_fp8_mma._dequant_rows`` (``SCALES``: times each block's E8M0 factor, the
    words at ``s_ptr + row * stride_sr + step * stride_sk``; else the raw e4m3 values)."""
    pid = tl.program_id(0)
    r = pid * BN + tl.arange(0, BN)
    c = tl.arange(0, 128)
    t = tl.arange(0, BT)
    blk = tl.arange(0, 4)[None, :]
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    base = w_ptr + r[:, None].to(tl.int64) * K + c[None, :]
    sb = s_ptr + r[:, None].to(tl.int64) * stride_sr
    bb = b_ptr + c[:, None] + t[None, :] * K
    for i in range(K // 128):
        w = tl.load(base + i * 128).to(tl.float16)
        if SCALES:
            words = tl.load(sb + i * stride_sk + blk // 4)
            f = scale_factor((words >> (8 * blk)) & 0xFF, True)
            w = w * tl.reshape(tl.broadcast_to(f[:, :, None], (BN, 4, 32)), (BN, 128))
        acc = tl.dot(w, tl.load(bb + i * 128), acc)
    tl.store(out_ptr + r[:, None] * BT + t[None, :], acc)


@triton.jit
def _e4m3_blocks_kernel(w_ptr, s_ptr, b_ptr, out_ptr, K, stride_sr, stride_sk, TWO: tl.constexpr,
                        BN: tl.constexpr, BT: tl.constexpr):
    """``out = sum_blocks factor * (W_block @ B_block^T)``: one e4m3 dot per 32-column block (two,
    ``TWO``: against B's ``hi`` and ``lo`` parts), the fresh product scaled into fp32, as
    ``moe_fp8_mma._mma_rows``."""
    pid = tl.program_id(0)
    r = pid * BN + tl.arange(0, BN)
    c = tl.arange(0, 32)
    t = tl.arange(0, BT)
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    base = w_ptr + r[:, None].to(tl.int64) * K + c[None, :]
    sb = s_ptr + r[:, None].to(tl.int64) * stride_sr
    bb = b_ptr + c[:, None] + t[None, :] * K
    for i in range(K // 128):
        words = tl.load(sb + i * stride_sk)
        for j in tl.static_range(4):
            w = tl.load(base + i * 128 + 32 * j)
            if TWO:
                p = tl.dot(w, tl.load(bb + i * 128 + 32 * j), tl.dot(w, tl.load(bb + K * BT + i * 128 + 32 * j)))
            else:
                p = tl.dot(w, tl.load(bb + i * 128 + 32 * j))
            acc += p * scale_factor((words >> (8 * j)) & 0xFF, False)
    tl.store(out_ptr + r[:, None] * BT + t[None, :], acc)


def graph_us(calls, n: int) -> float:
    """Median microseconds per launch of ``calls`` (``n`` launches) replayed as one CUDA graph."""
    return Timer(False, 50, 300).graph(calls) / n


def stream_rows(N: int, K: int, BT: int, ws: list[torch.Tensor]) -> list[dict]:
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

                    us = graph_us(calls, len(ws))
                    row = dict(part="stream", tiled=tiled, bk=bk, bn=bn, stages=stages, us=round(us, 1),
                               tbps=round(N * K / (us * 1e-6) / 1e12, 2))
                    print(row, flush=True)
                    rows.append(row)
    return rows


def scaled_rows(N: int, K: int, BT: int, ws: list[torch.Tensor]) -> list[dict]:
    # E8M0 bytes near a real checkpoint's (2**-17 .. 2**-3), four to an int32 word
    by_row = [torch.randint(110, 125, (N, K // 128), device="cuda", dtype=torch.int32) * 0x01010101 for _ in ws]
    by_step = [s.t().contiguous() for s in by_row]
    b16 = torch.randn(2, BT, K, device="cuda").to(torch.float16)
    b8 = b16.to(torch.float8_e4m3fn)
    out = torch.empty(N, BT, device="cuda")
    variants = [("f16", "none"), ("f16", "row-major"), ("f16", "step-major"),
                ("e4m3 1 part", "row-major"), ("e4m3 1 part", "step-major"),
                ("e4m3 2 parts", "row-major"), ("e4m3 2 parts", "step-major")]
    rows = []
    for math, layout in variants:
        for bn, stages in ((64, 3), (64, 4), (128, 3), (128, 4)):
            def calls(math=math, layout=layout, bn=bn, stages=stages) -> None:
                for w, sr, ss in zip(ws, by_row, by_step):
                    s, a, c = (ss, 1, ss.stride(0)) if layout == "step-major" else (sr, sr.stride(0), 1)
                    if math == "f16":
                        _f16_kernel[(N // bn,)](w, s, b16, out, K, a, c, SCALES=layout != "none", BN=bn, BT=BT,
                                                num_warps=4, num_stages=stages)
                    else:
                        _e4m3_blocks_kernel[(N // bn,)](w, s, b8, out, K, a, c, TWO=math.startswith("e4m3 2"), BN=bn,
                                                        BT=BT, num_warps=4, num_stages=stages)

            us = graph_us(calls, len(ws))
            row = dict(part="scaled", math=math, scales=layout, bn=bn, stages=stages, us=round(us, 1),
                       tbps=round(N * K * 33 / 32 / (us * 1e-6) / 1e12, 2))
            print(row, flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--part", choices=("stream", "scaled", "both"), default="both")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    N, K, BT = 10 * 6144, 6144, 16
    ws = [torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn) for _ in range(3)]
    rows = []
    if args.part in ("stream", "both"):
        rows += stream_rows(N, K, BT, ws)
    if args.part in ("scaled", "both"):
        rows += scaled_rows(N, K, BT, ws)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "N": N, "K": K, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
