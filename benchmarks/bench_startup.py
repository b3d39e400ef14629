"""Start-up of graphcap on MiniMax-M3: capture phases, graph memory per bucket, validation,
replay speed, and (``--frozen``) frozen-value detection.

GPU only. One process is one start: build the runner (random weights), ``capture()``, then a
second capture in the same process, ``validate()``, and step times. Run it twice with the same
``GRAPHCAP_CACHE_DIR`` for a cold start (empty caches) and a warm start (the caches the first
run wrote)::

    GRAPHCAP_CACHE_DIR=/tmp/gc python benchmarks/bench_startup.py --json cold.json
    GRAPHCAP_CACHE_DIR=/tmp/gc python benchmarks/bench_startup.py --json warm.json

Shapes: ``rank-of-8`` (60 layers), step capacity ``--max-tokens`` (1054 = a 1024-token chunk
plus 30 decodes), ``--max-seqs`` requests, default buckets. Step times: every request has
``--context`` tokens of context written straight into the cache (zeros: timing only); each
step is run ``--iters`` times (rewound in between) and timed by wall clock (incl. plan,
copy-in and the host sync of reading the output) and by CUDA events (GPU span).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import time

import torch
from rich.console import Console
from timing import step_ms

from graphcap import CaptureConfig, GraphKey, Padding, Purpose
from graphcap.report import stats_table
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.routing import measure_routing_spread
from models.runner import ModelRunner
from steps import TokenChunk


class TritonCompiles:
    """Counts and times Triton's ``compile()`` calls: loads from the disk cache and real
    builds (told apart by Triton's compilation listener), in total and per kernel. Install
    before the first launch: each kernel binds ``compile`` on its first run. Compiles may run
    in threads (``graphcap.startup.compile_ahead``): their seconds add up to more than the wall time."""

    def __init__(self) -> None:
        import threading

        import triton
        import triton.compiler

        self.calls = {"build": [0, 0.0], "cache load": [0, 0.0]}
        self.builds: list[dict] = []  # one row per real build: kernel, constexprs, seconds
        self._local = threading.local()
        self._lock = threading.Lock()
        inner = triton.compiler.compile

        def listener(*, cache_hit: bool, **_: object) -> None:
            self._local.hit = cache_hit

        def compile(src, *args, **kwargs):
            self._local.hit = False
            t0 = time.perf_counter()
            out = inner(src, *args, **kwargs)
            dt = time.perf_counter() - t0
            hit = getattr(self._local, "hit", False)
            with self._lock:
                row = self.calls["cache load" if hit else "build"]
                row[0] += 1
                row[1] += dt
                if not hit:
                    fn = getattr(src, "fn", None)
                    consts = getattr(src, "constexprs", {}) or {}
                    self.builds.append(dict(kernel=getattr(fn, "__name__", str(src)), seconds=round(dt, 3),
                                            constexprs=" ".join(f"{k}={v}" for k, v in sorted(consts.items(), key=str)
                                                                if not callable(v))[:200]))
            return out

        triton.knobs.compilation.listener = listener
        triton.compiler.compile = compile

    def snapshot(self) -> dict:
        with self._lock:
            out = {k: dict(count=n, seconds=round(t, 2)) for k, (n, t) in self.calls.items()}
            out["_builds"] = len(self.builds)
        return out

    def since(self, before: dict) -> dict:
        now = self.snapshot()
        out = {k: dict(count=now[k]["count"] - before[k]["count"],
                       seconds=round(now[k]["seconds"] - before[k]["seconds"], 2)) for k in self.calls}
        per: dict[str, list] = {}
        for b in self.builds[before["_builds"]:now["_builds"]]:
            row = per.setdefault(b["kernel"], [0, 0.0])
            row[0] += 1
            row[1] += b["seconds"]
        out["by_kernel"] = {k: dict(count=n, seconds=round(t, 2)) for k, (n, t) in
                            sorted(per.items(), key=lambda kv: -kv[1][1])}
        return out


COMPILES: TritonCompiles | None = None


def phases(runner: ModelRunner) -> dict:
    """The manager's per-phase start-up times (seconds), with the prebuild's parts."""
    s = runner.manager.stats
    out = {k: round(getattr(s, k), 3) for k in ("jit_s", "warmup_s", "capture_s", "validate_s", "frozen_s")}
    out.update({k: round(v, 3) for k, v in runner.prebuild_s.items()})
    return out


def bucket_rows(runner: ModelRunner) -> list[dict]:
    return [dict(graph=str(key), status=s.status, capture_ms=round(s.capture_ms, 1),
                 memory_mib=round(s.memory_mib, 1), segments=s.segments, reason=s.reason)
            for key, s in sorted(runner.manager.stats.buckets.items(), key=lambda kv: (-kv[0].rows, kv[0].decode))]


def timed_capture(runner: ModelRunner, profile: bool = False) -> dict:
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    compiles = COMPILES.snapshot() if COMPILES else {}
    in_prebuild: dict = {}
    source = runner.source
    hook = source.prebuild

    @contextlib.contextmanager
    def prebuild(keys):  # Triton compiles of the prebuild alone (the rest: warm-up)
        before = COMPILES.snapshot()
        with hook(keys) as plan:
            yield plan
        in_prebuild.update(COMPILES.since(before))

    if COMPILES:
        source.prebuild = prebuild
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    try:
        if prof:
            prof.enable()
        runner.capture()
    finally:
        if prof:
            prof.disable()
        source.prebuild = hook
    total = time.perf_counter() - t0
    top = {}
    if prof:
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(25)
            top[order] = text.getvalue().splitlines()[-32:]
            print(f"capture() under cProfile, by {order}:\n" + "\n".join(top[order]), flush=True)
    torch.cuda.synchronize()
    graphs = sum(s.status == "captured" for s in runner.manager.stats.buckets.values())
    return dict(total_s=round(total, 2), phases=phases(runner), graphs=graphs,
                triton_compiles=COMPILES.since(compiles) if COMPILES else {}, triton_compiles_prebuild=in_prebuild,
                triton_builds=COMPILES.builds[compiles['_builds']:] if COMPILES else [],
                graph_memory_mib=round((free0 - torch.cuda.mem_get_info()[0]) / 2**20, 1),
                buckets=bucket_rows(runner), **({"cprofile": top} if top else {}))


def profile_capture_one(runner: ModelRunner, bucket: int, whole: bool) -> dict:
    """Where one graph's capture time goes: eager forward (plain, guarded) and the capture,
    the latter under cProfile (top functions by own time)."""
    m = runner.manager
    key = GraphKey(bucket, whole)
    step = runner.source.dummy_step(key, Purpose.CAPTURE)
    padding = Padding.for_graph(step.num_tokens, step.num_seqs, key)
    out: dict = {"graph": str(key)}
    for guard in (False, True):
        m.eager.padded(step, padding, guard=guard)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.eager.padded(step, padding, guard=guard)
        out[f"eager_{'guarded' if guard else 'plain'}_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        torch.cuda.synchronize()
        out[f"eager_{'guarded' if guard else 'plain'}_synced_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    runner.source.release_dummies()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    m.capturer.capture(key, Purpose.CAPTURE, torch.cuda.graph_pool_handle(), keep_graph=False)
    prof.disable()
    out["capture_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    runner.source.release_dummies()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    out["cprofile_top"] = s.getvalue().splitlines()[-30:]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="rank-of-8")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (default: all 60)")
    p.add_argument("--max-tokens", type=int, default=1054)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--frozen", action="store_true",
                   help="capture with detect_frozen: validate() also runs frozen-value detection on every graph")
    p.add_argument("--profile-bucket", type=int, default=64, help="bucket whose capture is profiled (0: skip)")
    p.add_argument("--profile-start", action="store_true", help="cProfile the first capture() (top functions)")
    p.add_argument("--compile-workers", type=int, default=None,
                   help="Triton compile threads before capture (0: each kernel compiles on its first launch)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    t_start = time.perf_counter()
    global COMPILES
    COMPILES = TritonCompiles()
    config = MiniMaxM3Config.preset(args.preset)
    if args.layers:
        config = config.first_layers(args.layers)
    page = config.sparse_block_size
    # Pages for the timed steps only (every request's context + one token, and the chunk).
    pages = args.max_seqs * -(-(args.context + 1) // page) + -(-args.max_tokens // page) + 2
    capture = CaptureConfig(enabled=True, max_tokens=args.max_tokens, detect_frozen=args.frozen)
    runner = build_from_preset(config, "cuda", torch.bfloat16, backend="auto", max_tokens=args.max_tokens,
                               max_seqs=args.max_seqs, max_seq_len=args.context + args.max_tokens + 8,
                               num_pages=pages, capture=capture)
    if args.compile_workers is not None:
        runner.compile_workers = args.compile_workers
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t_start
    res: dict = dict(gpu=torch.cuda.get_device_name(), preset=args.preset, layers=config.num_hidden_layers,
                     max_tokens=args.max_tokens, max_seqs=args.max_seqs, compile_workers=runner.compile_workers,
                     build_s=round(build_s, 2))
    print(f"built {config.num_hidden_layers} layers in {build_s:.1f} s; "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
    res["first_capture"] = timed_capture(runner, profile=args.profile_start)
    res["start_to_graphs_s"] = round(time.perf_counter() - t_start, 2)
    Console(width=160).print(stats_table(runner.manager))
    shown = {k: v for k, v in res["first_capture"].items() if k not in ("buckets", "cprofile", "triton_builds")}
    print("first capture", json.dumps(shown), flush=True)
    runner.manager.release()
    torch.cuda.empty_cache()
    res["second_capture"] = timed_capture(runner)
    print("second capture", json.dumps({k: v for k, v in res["second_capture"].items()
                                        if k not in ("buckets", "triton_builds")}),
          flush=True)
    t0 = time.perf_counter()
    failures = runner.validate()
    res["validate_s"] = round(time.perf_counter() - t0, 2)
    res["validation_failures"] = {str(k): v for k, v in failures.items()}
    res["validate_phases"] = phases(runner)  # validate_s (replay vs eager) and frozen_s (--frozen)
    print(f"validate {res['validate_s']} s {res['validate_phases']}, failures: {failures or 'none'}", flush=True)
    spread = measure_routing_spread(runner, batch=32)  # after the start-up figures: it runs eager steps
    res["expert_spread"] = spread.as_dict()
    print(spread.describe(), flush=True)
    res["memory_gib"] = dict(allocated=round(torch.cuda.memory_allocated() / 2**30, 2),
                             reserved=round(torch.cuda.memory_reserved() / 2**30, 2))

    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    n_req = args.max_seqs
    for i in range(n_req):
        runner.add_request(i)
        runner.cache.reserve(i, args.context)
        runner.cache.set_written(i, args.context)

    def decode(n: int) -> list[TokenChunk]:
        return [TokenChunk(i, args.context, [int(torch.randint(0, vocab, (1,), generator=gen))]) for i in range(n)]

    chunk = args.max_tokens - (n_req - 2)
    steps = {f"decode {n}": decode(n) for n in (1, 8, 32) if n <= n_req}
    steps[f"mixed {n_req - 2}+{chunk}"] = decode(n_req - 2) + [
        TokenChunk(n_req - 1, args.context, torch.randint(0, vocab, (chunk,), generator=gen).tolist())]
    res["steps"] = {}
    for name, chunks in steps.items():
        res["steps"][name] = step_ms(runner, chunks, args.iters)
        print(name, res["steps"][name], flush=True)
    for i in range(n_req):
        runner.free_request(i)
    if args.profile_bucket:
        res["capture_profile"] = profile_capture_one(runner, args.profile_bucket, False)
        print("\n".join(str(x) for x in res["capture_profile"].pop("cprofile_top")))
        print("capture profile", res["capture_profile"], flush=True)
    res["total_s"] = round(time.perf_counter() - t_start, 2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
