"""Benchmark the fused MoE kernels at MiniMax-M3 rank-of-8 shapes against the torch paths.

Shapes: H=6144, I=3072 per routed expert, shared expert Is=384 (3072 / TP8), E=16 local experts
of 128, top-4. Routing is drawn as a real router would: sigmoid scores over 128 experts, global
top-4 per token, weights renormalised x2; only ids < 16 are local (the rest -1). At T=1 the draw
is repeated until at least one expert is local (the case that costs).

Per T and path: CUDA-graph replay time (median over replays, us per call), the bytes floor
(distinct routed experts' w13 + w2, the shared expert, x in and out: nothing is read twice in
the floor), achieved TB/s against it, time / (floor at 4.3 TB/s), and the relative error
against an fp32 computation. Weights are not L2-resident: each graph replays 8 calls that
rotate over 2 routed weight sets (1.8 GB each) and 8 shared-expert sets.

Paths: ``fused_moe`` for every ``moe_config_candidates(T)`` entry; with ``--mxfp8`` (on by
default) also ``fused_moe`` on the same weights quantized to MXFP8 for every
``moe_config_candidates(T, f16=True, fp8_mma=True)`` entry (the bf16 shapes, then each with
the f16 dequantise-and-dot math, "mxfp8 f16", then the fp8 tensor-core tile sets, "mxfp8 mma",
and at up to four tokens the weight-row sets, "mxfp8 gemv"),
its floor counting
fp8 bytes plus a scale byte per 32 and its error taken against fp32 on the dequantised weights;
the torch reference
``BlockSparseMoE.routed_grouped`` (sorted pairs + ``torch._grouped_mm``) + the shared MLP;
``torch.compile`` of that torch path (skipped with ``--no-compile`` or once the time budget
is tight).

Usage (GPU): ``python benchmarks/bench_m3_moe.py --json moe.json``; ``--budget-s`` bounds the
whole run (default 90 s). ``--smoke`` runs tiny shapes with host timing (CPU + interpreter too)
to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from timing import graph_replay_us

HBM_TBPS = 4.3
ALPHA, LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class Dims:
    hidden: int = 6144
    inter: int = 3072
    shared_inter: int = 384
    num_local: int = 16
    num_global: int = 128
    top_k: int = 4


SMOKE_DIMS = Dims(hidden=64, inter=32, shared_inter=64, num_local=4, num_global=16, top_k=2)


@dataclass
class Row:
    tokens: int
    path: str
    config: str
    time_us: float | None
    bytes: float
    experts: int
    rel_err: float | None
    note: str = ""
    derived: dict = field(default_factory=dict)

    def finish(self) -> Row:
        floor_us = self.bytes / (HBM_TBPS * 1e12) * 1e6
        t = self.time_us
        self.derived = {"floor_us": floor_us, "tbps": self.bytes / (t * 1e-6) / 1e12 if t else None,
                            "x_floor": t / floor_us if t else None}
        return self


class Weights:
    """Routed sets ``[(w13, w2)]`` and shared sets ``[(gate_up, down)]`` of random bf16 weights
    (std 1/sqrt(fan_in)); calls rotate over them so the timed reads come from HBM."""

    def __init__(self, d: Dims, routed_sets: int, shared_sets: int, device: str, dtype: torch.dtype) -> None:
        def r(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, device=device, dtype=dtype) * shape[-1] ** -0.5)

        H, inter, Is, E = d.hidden, d.inter, d.shared_inter, d.num_local
        self.routed = [(r(E, 2 * inter, H), r(E, H, inter)) for _ in range(routed_sets)]
        self.shared = [(r(2 * Is, H), r(H, Is)) for _ in range(shared_sets)]
        self.fp8: list[tuple] = []  # per call set: (fp8 weights, MoEScales, dequantised weights)

    def call_sets(self, n_calls: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [self.routed[i % len(self.routed)] + self.shared[i % len(self.shared)] for i in range(n_calls)]

    def quantize(self, n_calls: int) -> None:
        """MXFP8 copies of the call sets (the routed ones shared between calls as above)."""
        from models.minimax_m3.kernels.moe import MoEScales
        from models.minimax_m3.mxfp8 import dequantize_mxfp8, quantize_mxfp8

        q: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for s in self.call_sets(n_calls):
            for w in s:
                if id(w) not in q:
                    q[id(w)] = quantize_mxfp8(w)
        for s in self.call_sets(n_calls):
            pairs = [q[id(w)] for w in s]
            self.fp8.append((tuple(a for a, _ in pairs), MoEScales(*(b for _, b in pairs)),
                             tuple(dequantize_mxfp8(a, b, w.dtype) for (a, b), w in zip(pairs, s))))


def router_routing(T: int, d: Dims, gen: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids int64 [T, K] and weights fp32 [T, K] from sigmoid scores over all experts."""
    while True:
        scores = torch.sigmoid(torch.randn(T, d.num_global, generator=gen, device=device))
        w, ids = scores.topk(d.top_k, dim=-1)
        if T > 1 or bool((ids < d.num_local).any()):
            return ids, (w / w.sum(-1, keepdim=True) * 2.0).float()


def step_inputs(T: int, d: Dims, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One step's MoE inputs, the same for a given T in every run: ``x [T, H]``, the router's
    global ids and weights ``[T, K]``, this rank's local ids (``-1`` elsewhere, int32) and
    weights, and the number of distinct local experts routed to; prints the expert spread."""
    from models.minimax_m3.routing import RoutingSpread

    gen = torch.Generator(device=device).manual_seed(1000 + T)
    x = torch.randn(T, d.hidden, generator=gen, device=device).to(dtype)
    gids, gw = router_routing(T, d, gen, device)
    local = gids < d.num_local
    ids = torch.where(local, gids, -1).to(torch.int32)
    w = torch.where(local, gw, 0.0).contiguous()
    n_exp = int(torch.unique(ids[ids >= 0]).numel())
    spread = RoutingSpread("random-score", T, d.top_k, d.num_global, d.num_local, (n_exp,),
                           (int((ids >= 0).sum()),))
    print(f"T={T}: {spread.describe()}", flush=True)
    return x, gids, gw, ids, w, n_exp


def reference_fp32(x: torch.Tensor, local_ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   sgu: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    """fp32 everywhere (no intermediate rounding), only the routed rows of each expert."""
    xf = x.float()

    def ffn(gu: torch.Tensor, down: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        h = rows @ gu.float().T
        n = h.shape[1] // 2
        g, u = h[:, :n].clamp(max=LIMIT), h[:, n:].clamp(-LIMIT, LIMIT)
        return (g * torch.sigmoid(ALPHA * g) * (u + 1.0)) @ down.float().T

    out = ffn(sgu, sd, xf)
    for e in torch.unique(local_ids[local_ids >= 0]).tolist():
        t, k = torch.nonzero(local_ids == e, as_tuple=True)
        out.index_add_(0, t, w[t, k][:, None] * ffn(w13[e], w2[e], xf[t]))
    return out


def torch_grouped(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  sgu: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    """The model's torch path: ``layers.routed_grouped`` (what ``BlockSparseMoE.routed_grouped``
    runs) on these weights (global ids, expert offset 0) + the shared SwiGLU-OAI MLP, summed in
    fp32, cast to x.dtype. A function of tensors: torch.compile sees the weights as inputs."""
    import torch.nn.functional as F

    from models.minimax_m3.layers import routed_grouped, swiglu_oai

    routed = routed_grouped(x, ids, w, w13, w2, ALPHA, LIMIT)
    n = sd.shape[1]
    gu = F.linear(x, sgu)
    shared = F.linear(swiglu_oai(gu[:, :n], gu[:, n:], ALPHA, LIMIT), sd)
    return (routed + shared.float()).to(x.dtype)


def time_calls(calls: list[Callable[[], None]], smoke: bool, reps: int) -> float:
    """Median us per call: the calls captured as one CUDA graph, replayed ``reps`` times."""
    for c in calls:
        c()
    if smoke:
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    return graph_replay_us(calls, reps)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bench_tokens(T: int, d: Dims, wts: Weights, args: argparse.Namespace, deadline: float, device: str,
                 compiled: Callable | None) -> list[Row]:
    from models.minimax_m3.kernels.moe import fused_moe, moe_config_candidates, scales_fit_f16
    from models.minimax_m3.kernels.moe_fp8_mma import fits_fp8_mma

    dtype = wts.routed[0][0].dtype
    x, gids, gw, ids, w, n_exp = step_inputs(T, d, device, dtype)
    H, inter, Is = d.hidden, d.inter, d.shared_inter
    nbytes = float((n_exp * 3 * inter * H + 3 * Is * H) * 2 + 2 * T * H * 2 + T * d.top_k * 8)
    sets = wts.call_sets(args.calls)
    ref = reference_fp32(x, ids, w, *sets[0])
    rows: list[Row] = []

    def run(path: str, cfg_name: str, make: Callable[[int, torch.Tensor], Callable[[], None]],
            want: torch.Tensor = ref, nbytes: float = nbytes) -> None:
        """Check ``make``'s first call against ``want``, time the calls, one row (floor: ``nbytes``)."""
        if time.perf_counter() > deadline:
            rows.append(Row(T, path, cfg_name, None, nbytes, n_exp, None, note="skipped: time budget").finish())
            return
        outs = [torch.empty(T, H, dtype=dtype, device=device) for _ in sets]
        try:
            calls = [make(i, outs[i]) for i in range(len(sets))]
            calls[0]()
            err = rel_err(outs[0], want)
            us = time_calls(calls, args.smoke, args.reps)
            rows.append(Row(T, path, cfg_name, us, nbytes, n_exp, err).finish())
        except Exception as exc:  # noqa: BLE001  (a failing path, e.g. torch.compile, is reported, not fatal)
            rows.append(Row(T, path, cfg_name, None, nbytes, n_exp, None, note=f"failed: {exc!r}"[:300]).finish())

    for ci, cfg in enumerate(moe_config_candidates(T)):
        def make(i: int, out: torch.Tensor, cfg=cfg) -> Callable[[], None]:
            return lambda: fused_moe(x, ids, w, *sets[i], ALPHA, LIMIT, out, config=cfg)

        run("fused_moe", f"cand{ci}" + (" (default)" if ci == 0 else ""), make)
    if wts.fp8:
        ref8 = reference_fp32(x, ids, w, *wts.fp8[0][2])  # the dequantised weights
        nbytes8 = float((n_exp * 3 * inter * H + 3 * Is * H) * 33 / 32 + 2 * T * H * 2 + T * d.top_k * 8)
        f16 = all(scales_fit_f16(sc) for _, sc, _ in wts.fp8)
        mma = all(fits_fp8_mma(H, inter, Is, tuple(sc)) for _, sc, _ in wts.fp8)
        for ci, cfg in enumerate(moe_config_candidates(T, f16=f16, fp8_mma=mma)):
            def make8(i: int, out: torch.Tensor, cfg=cfg) -> Callable[[], None]:
                q, sc, _ = wts.fp8[i]
                return lambda: fused_moe(x, ids, w, *q, ALPHA, LIMIT, out, config=cfg, scales=sc)

            kind = (" f16" if cfg.fp8_f16 else " mma f16" if cfg.mma_f16 else " mma" if cfg.fp8_mma
                    else " gemv" if cfg.gemv else "")
            run("fused_moe mxfp8" + kind, f"cand{ci}" + (" (default)" if ci == 0 else ""),
                make8, ref8, nbytes8)

    def make_torch(fn: Callable) -> Callable[[int, torch.Tensor], Callable[[], None]]:
        return lambda i, out: (lambda: out.copy_(fn(x, gids, gw, *sets[i])))

    run("torch grouped", "BlockSparseMoE.routed_grouped", make_torch(torch_grouped))
    if compiled is not None:
        if time.perf_counter() > deadline - args.compile_reserve_s:
            rows.append(Row(T, "torch.compile", "routed_grouped", None, nbytes, n_exp, None,
                            note="skipped: time budget").finish())
        else:
            run("torch.compile", "routed_grouped", make_torch(compiled))
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"{'T':>5} {'path':15} {'config':30} {'exp':>3} {'us':>9} {'floor us':>9} {'x floor':>7} {'TB/s':>6} "
          f"{'rel err':>8}  note")
    for r in rows:
        dv = r.derived

        def f(v: float | None, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-"

        print(f"{r.tokens:>5} {r.path:15} {r.config:30} {r.experts:>3} {f(r.time_us, '9.1f')} {dv['floor_us']:9.1f} "
              f"{f(dv['x_floor'], '7.2f')} {f(dv['tbps'], '6.2f')} {f(r.rel_err, '8.1e')}  {r.note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--tokens", default=None, help="token counts T (default 1,8,32,64,256,1054; smoke 1,8,100)")
    ap.add_argument("--budget-s", type=float, default=90.0, help="stop starting new paths after this long")
    ap.add_argument("--compile-reserve-s", type=float, default=25.0,
                    help="skip torch.compile when less than this is left of the budget")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile path")
    ap.add_argument("--calls", type=int, default=8, help="calls per graph (rotating weight sets)")
    ap.add_argument("--routed-sets", type=int, default=2, help="routed weight sets (1.8 GB each)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, host timing: checks the script runs")
    ap.add_argument("--no-mxfp8", dest="mxfp8", action="store_false", help="leave out the MXFP8 paths")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    if args.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        d, device, args.calls, args.reps = SMOKE_DIMS, ("cuda" if torch.cuda.is_available() else "cpu"), 2, 1
        args.no_compile = True
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (use --smoke to check the script on CPU)", file=sys.stderr)
            return 2
        d, device = Dims(), "cuda"
    torch.manual_seed(0)
    wts = Weights(d, args.routed_sets, args.calls, device, torch.bfloat16)
    if args.mxfp8:
        wts.quantize(args.calls)
    compiled = None
    if not args.no_compile:
        compiled = torch.compile(torch_grouped, dynamic=None)
    rows: list[Row] = []
    tokens = args.tokens or ("1,8,100" if args.smoke else "1,8,32,64,256,1054")
    for T in [int(t) for t in tokens.split(",") if t]:
        rows += bench_tokens(T, d, wts, args, deadline, device, compiled)
        print_table([r for r in rows if r.tokens == T])
    elapsed = time.perf_counter() - t_start
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    import triton

    header = (f"{name} | torch {torch.__version__} | triton {triton.__version__} | dims {asdict(d)} | "
              f"floor = bytes / {HBM_TBPS} TB/s | {args.calls} calls per graph over {args.routed_sets} routed sets | "
              f"{elapsed:.0f} s")
    print(header)
    print("\nall rows:")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
