"""Benchmark the MiniMax-M3 router and Gemma RMSNorm kernels (Triton) against torch and flashinfer.

Per op, implementation and token count T (H = 6144, E = 128, K = 4, bf16 activations, fp32
router weight), both as CUDA-graph replays, so host launch gaps do not count:
- ``graph_us``: one call per graph, median of ``triton.testing.do_bench`` over replays, L2
  flushed before each replay (cold weights, as in a real layer, where the router weight has
  left L2 since the previous layer);
- ``graph20_us``: 20 calls captured in one graph, replay time / 20 (warm L2, launch cost
  amortised: the number to compare with flashinfer's 20-per-graph table in the notes).

Implementations: router ``route_triton`` vs ``route_torch`` vs ``torch.compile(route_torch)``;
norms ``gemma_fused_add_rmsnorm`` (and ``gemma_rmsnorm``) Triton vs torch vs flashinfer's
``flashinfer.norm`` ops when ``import flashinfer`` works (its first call JIT-builds the norm
module, ~1 min on a fresh machine: that is timed and reported apart, outside the time box).

Bytes (floor = bytes / 4.8 TB/s, the H200 datasheet HBM bandwidth): router E*H*4 (weight) +
T*H*2 (x) + T*K*12 (three outputs); fused add+norm T*H*2*4 (x, residual in; both out) + H*2;
norm T*H*2*2 + H*2. Each row also says how well the implementation agrees with the torch
twin (router: share of rows with the same expert set, max weight error; norms: max error).

Usage (GPU): ``python benchmarks/bench_m3_router_norm.py --json bench_router_norm.json``.
``--smoke`` runs tiny shapes with host timing and no graphs (the Triton interpreter works
too) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from timing import Timer, graph_replay_us

HBM_TBPS = 4.8
GRAPH_CALLS = 20


@dataclass
class Row:
    op: str
    impl: str
    tokens: int
    graph_us: float | None
    graph20_us: float | None
    bytes: float
    floor_us: float
    agreement: str = ""
    note: str = ""


class GraphTimer(Timer):
    """CUDA-graph replay timings in microseconds, or host timing of one call for ``--smoke``."""

    def graphs(self, fn: Callable[[], None]) -> tuple[float | None, float | None]:
        """(one call per graph, per call of a 20-call graph); ``fn`` has run once already."""
        if self.smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6, None
        return self.graph(fn), graph_replay_us([fn] * GRAPH_CALLS, reps=max(5, self.rep_ms // 5))


def routing_agreement(got, want) -> str:
    """Share of rows with the same expert set, and the max weight error where the sets match."""
    (_, gw, gg), (_, ww, wg) = got, want
    gs, gi = gg.long().sort(1)
    ws, wi = wg.long().sort(1)
    same = (gs == ws).all(1)
    err = (gw.gather(1, gi) - ww.gather(1, wi)).abs()[same].max().item() if same.any() else float("nan")
    return f"same sets {100.0 * same.float().mean().item():.1f}%, max w err {err:.1e}"


def bench_router(T: int, H: int, E: int, K: int, timer: GraphTimer, device: str, compiled) -> list[Row]:
    from models.minimax_m3.kernels.router import CUBLAS_MIN_TOKENS, RouterConfig, route_torch, route_triton

    g = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
    w = torch.randn(E, H, generator=g, device=device) * H**-0.5
    b = 0.1 * torch.randn(E, generator=g, device=device)
    nrt = torch.tensor([T], dtype=torch.int64, device=device)
    bytes_ = E * H * 4 + T * H * 2 + T * K * 12
    impls = [("triton", route_triton), ("torch", route_torch)]
    if T >= CUBLAS_MIN_TOKENS:  # the logits from cuBLAS SGEMM (the earlier path), then the top-k kernel
        sgemm = RouterConfig(block_t=16, block_e=16, block_h=16, h_per_split=H, splits=1, gemv_warps=4, topk_warps=1,
                             cublas=True)
        impls.insert(1, ("triton sgemm", lambda *a: route_triton(*a, config=sgemm)))
    if compiled is not None:
        impls.append(("torch.compile", compiled))
    outs, rows = {}, []
    for name, fn in impls:
        local = torch.empty(T, K, dtype=torch.int32, device=device)
        wts = torch.empty(T, K, dtype=torch.float32, device=device)
        glob = torch.empty(T, K, dtype=torch.int32, device=device)

        def call(fn=fn, local=local, wts=wts, glob=glob):
            fn(x, w, b, K, 2.0, nrt, 0, E, local, wts, glob)

        note = ""
        try:
            call()  # compile / autotune outside the capture
            outs[name] = (local.clone(), wts.clone(), glob.clone())
            one, twenty = timer.graphs(call)
        except Exception as exc:  # noqa: BLE001 - one broken implementation must not lose the other rows
            one = twenty = None
            note = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        rows.append(Row("route", name, T, one, twenty, bytes_, bytes_ / HBM_TBPS / 1e6, "", note))
    for row in rows:
        if row.impl in outs and "torch" in outs:
            row.agreement = routing_agreement(outs[row.impl], outs["torch"])
    return rows


def bench_norms(T: int, H: int, timer: GraphTimer, device: str, flashinfer) -> list[Row]:
    from models.minimax_m3.kernels import norm as nk

    g = torch.Generator(device=device).manual_seed(T)
    x0 = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
    r0 = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
    wt = (0.1 * torch.randn(H, generator=g, device=device)).to(torch.bfloat16)
    eps = 1e-6
    fused = {"triton": nk.gemma_fused_add_rmsnorm, "torch": nk.gemma_fused_add_rmsnorm_torch}
    plain = {"triton": lambda x, w, e, o: nk.gemma_rmsnorm(x, w, e, o),
             "torch": lambda x, w, e, o: nk.gemma_rmsnorm_torch(x, w, e, o)}
    if flashinfer is not None:
        fused["flashinfer"] = lambda x, r, w, e: flashinfer.norm.gemma_fused_add_rmsnorm(x, r, w, e)
        plain["flashinfer"] = lambda x, w, e, o: flashinfer.norm.gemma_rmsnorm(x, w, e, out=o)
    rows = []
    for op, table, bytes_ in (("gemma_fused_add_rmsnorm", fused, T * H * 8 + H * 2),
                              ("gemma_rmsnorm", plain, T * H * 4 + H * 2)):
        results = {}
        for name, fn in table.items():
            x, r, out = x0.clone(), r0.clone(), torch.empty_like(x0)
            call = (lambda fn=fn, x=x, r=r: fn(x, r, wt, eps)) if op.startswith("gemma_fused") else \
                (lambda fn=fn, x=x, out=out: fn(x, wt, eps, out))
            note = ""
            try:
                call()  # the first call builds (Triton compile, flashinfer JIT): outside the timing
                results[name] = (x.clone(), r.clone()) if op.startswith("gemma_fused") else (out.clone(),)
                one, twenty = timer.graphs(call)  # in place: the values drift, the cost does not
            except Exception as exc:  # noqa: BLE001 - as in bench_router
                one = twenty = None
                note = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            rows.append(Row(op, name, T, one, twenty, bytes_, bytes_ / HBM_TBPS / 1e6, "", note))
        for row in rows[-len(table):]:
            if row.impl in results and "torch" in results:
                errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(results[row.impl], results["torch"])]
                row.agreement = "max err vs torch " + ", ".join(f"{e:.1e}" for e in errs)
    return rows


def load_flashinfer(skip: bool, device: str):
    """flashinfer with its CUDA norm module built (the first norm call JIT-builds it), or None."""
    if skip or device != "cuda":
        return None, "skipped"
    os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")  # the CUDA norm kernels, not a fallback
    try:
        import flashinfer
        import flashinfer.norm
    except Exception as exc:  # noqa: BLE001 - any failure means: no flashinfer rows
        return None, f"import failed: {type(exc).__name__}: {exc}"
    t0 = time.time()
    try:
        x = torch.randn(2, 6144, device=device, dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.zeros(6144, device=device, dtype=torch.bfloat16)
        flashinfer.norm.gemma_fused_add_rmsnorm(x, r, w, 1e-6)
        flashinfer.norm.gemma_rmsnorm(x, w, 1e-6)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a failed JIT build means: no flashinfer rows
        return None, f"first call failed: {type(exc).__name__}: {exc}"
    return flashinfer, (f"flashinfer {getattr(flashinfer, '__version__', '?')}, "
                        f"build/first call {time.time() - t0:.1f} s")


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    cols = f"{'op':24s} {'impl':14s} {'T':>5s} {'graph us':>9s} {'graph20 us':>10s} {'floor us':>8s} " \
           f"{'x floor':>7s}  agreement / note"
    print(cols)
    print("-" * len(cols))
    for r in rows:
        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"

        best = r.graph20_us or r.graph_us
        print(f"{r.op:24s} {r.impl:14s} {r.tokens:5d} {f(r.graph_us, '9.2f'):>9s} {f(r.graph20_us, '10.2f'):>10s} "
              f"{r.floor_us:8.2f} {f(best / r.floor_us if best else None, '7.1f'):>7s}  {r.agreement} {r.note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench_m3_router_norm.json", help="JSON output path")
    ap.add_argument("--tokens", default="1,8,32,64,1054")
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--time-box", type=float, default=60.0, help="seconds; later token counts are skipped past it")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile(route_torch)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, host timing: checks the script runs")
    a = ap.parse_args(argv)

    if a.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        a.tokens, a.hidden, a.experts, a.no_compile, a.no_flashinfer = "1,5", 64, 16, True, True
    else:
        if not torch.cuda.is_available():
            print("bench_m3_router_norm: needs a CUDA GPU (use --smoke to check the script on CPU)", file=sys.stderr)
            return 2
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False  # route_torch: a true fp32 GEMM, like the kernel
    tokens = [int(t) for t in a.tokens.split(",") if t]
    timer = GraphTimer(a.smoke, a.warmup_ms, a.rep_ms)
    flashinfer, fi_note = load_flashinfer(a.no_flashinfer, device)
    compiled = None
    if not a.no_compile:
        from models.minimax_m3.kernels.router import route_torch

        compiled = torch.compile(route_torch, dynamic=True)  # one build for every T
    rows: list[Row] = []
    t0 = time.time()
    skipped = []
    for T in tokens:
        if time.time() - t0 > a.time_box:
            skipped.append(T)
            continue
        rows += bench_router(T, a.hidden, a.experts, a.top_k, timer, device, compiled)
        rows += bench_norms(T, a.hidden, timer, device, flashinfer)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"
    import triton

    header = (f"{gpu} | torch {torch.__version__} | triton {triton.__version__} | H={a.hidden} E={a.experts} "
              f"K={a.top_k} | {fi_note} | floor = bytes / {HBM_TBPS} TB/s | {time.time() - t0:.0f} s"
              + (f" | skipped T={skipped} (time box)" if skipped else ""))
    print_table(rows, header)
    with open(a.json, "w") as f:
        json.dump({"header": header, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
