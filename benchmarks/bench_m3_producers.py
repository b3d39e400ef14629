"""MiniMax-M3 producers at the per-GPU shapes of TP8/EP8: eager vs graphcap with torch
producers vs graphcap with fused producers vs graphcap capturing torch.compile'd producers.

GPU only. One model (``rank-of-8``, 60 layers by default, random bf16 weights) and one paged
cache; every request has ``--context`` tokens of (random) context, written straight into the
cache. Per mode the same steps run:

- ``eager``: no graphs, torch producers (``producer=torch``);
- ``torch``: graphcap (decode graphs, piecewise graphs for mixed steps), torch producers;
- ``fused``: graphcap, the fused op table (Triton norms, router, MoE, SwiGLU, norm+RoPE+cache);
- ``compile``: graphcap capturing ``torch.compile``d torch producers (Inductor, default mode: no
  CUDA graphs of its own; the norms, dense MLP and MoE, each a function of tensors so one
  compile per shape serves every layer) with the fused norm+RoPE+cache-write kernel.

Columns per step: GPU-busy us per layer (sum of kernel durations in one profiled step / layers),
kernels per layer, wall ms per step (median of ``--iters``, incl. plan, copy-in and sampling),
and capture seconds per mode. Correctness: every mode's logits against the ``torch`` mode's on
the same step, and a ``--decode-steps`` greedy decode (teacher-forced on the torch mode's
tokens) where every step whose top-2 logit gap exceeds the bf16 error bound must agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from graphcap import CaptureConfig
from graphcap.report import choices_table, kernel_table, measure_coverage
from graphcap.verify.compare import relative_error
from models.minimax_m3 import build_from_preset
from models.minimax_m3 import ops as m3ops
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.layers import gemma_rmsnorm, route, routed_grouped, swiglu_oai
from models.minimax_m3.routing import measure_routing_spread
from models.runner import ModelRunner
from steps import TokenChunk


def compiled_ops() -> m3ops.M3Ops:
    """The torch op table with its norms, dense MLP and MoE compiled by Inductor."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 64

    @torch.compile(dynamic=False)
    def rms(x, w, eps: float):
        return gemma_rmsnorm(x, w, eps)

    @torch.compile(dynamic=False)
    def add_rms(x, r, w, eps: float):
        return m3ops.add_rmsnorm_torch(x, r, w, eps)

    @torch.compile(dynamic=False)
    def mlp_fn(x, gu_w, down_w, alpha: float, limit: float):
        inter = down_w.shape[1]
        gu = torch.nn.functional.linear(x, gu_w)
        return torch.nn.functional.linear(swiglu_oai(gu[:, :inter], gu[:, inter:], alpha, limit), down_w)

    @torch.compile(dynamic=False)
    def moe_fn(x, n, gate_w, bias, w13, w2, sh_gu, sh_down, top_k: int, scale: float, alpha: float, limit: float,
               offset: int):
        ids, w = route(x, gate_w, bias, top_k, scale, n)
        routed = routed_grouped(x, ids, w, w13, w2, alpha, limit, offset)
        inter = sh_down.shape[1]
        gu = torch.nn.functional.linear(x, sh_gu)
        shared = torch.nn.functional.linear(swiglu_oai(gu[:, :inter], gu[:, inter:], alpha, limit), sh_down)
        return (routed + shared.float()).to(x.dtype)

    def mlp(m, x):
        return mlp_fn(x, m.gate_up_proj.weight, m.down_proj.weight, m.alpha, m.limit)

    def moe(m, x, n):
        sh = m.shared_experts
        return moe_fn(x, n, m.gate.weight, m.e_score_correction_bias, m.experts.w13, m.experts.w2,
                      sh.gate_up_proj.weight, sh.down_proj.weight, m.top_k, m.scale, m.alpha, m.limit, m.expert_offset)

    return m3ops.M3Ops("compile", m3ops.norm_rope_write_triton, rms, add_rms, mlp, moe)


def run_again(runner: ModelRunner, chunks: list[TokenChunk]):
    out = runner.step(chunks)
    for ch in chunks:
        runner.rewind_request(ch.seq_id, ch.start_pos)
    return out


def wall_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--context", type=int, default=3000)
    p.add_argument("--decode", default="1,8,32,64")
    p.add_argument("--mixed", default="30,1024", help="decodes,prefill chunk of the mixed step")
    p.add_argument("--modes", default="eager,torch,fused,compile")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--decode-steps", type=int, default=200, help="greedy agreement check, fused vs torch")
    p.add_argument("--accuracy-layers", type=int, default=4,
                   help="layers of the fp32-reference check (fp32 weights of 60 layers do not fit one GPU)")
    p.add_argument("--json", default="bench_m3_producers.json")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny preset, tiny steps")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.context, args.decode, args.mixed, args.iters, args.decode_steps = 4, 40, "1,2", "2,8", 1, 3
    elif not torch.cuda.is_available():
        raise SystemExit("bench_m3_producers needs a CUDA GPU (use --smoke to check the script on CPU)")
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    sizes = [int(x) for x in args.decode.split(",")]
    n_dec, chunk = (int(x) for x in args.mixed.split(","))
    max_seqs = max(max(sizes), n_dec) + 1  # the last request is the mixed step's prefill, in no decode batch
    ceiling = n_dec + chunk
    buckets = tuple(sorted({*sizes, ceiling}))
    config = (MiniMaxM3Config.tiny() if args.smoke else MiniMaxM3Config.rank_of_8()).first_layers(args.layers)
    t0 = time.perf_counter()
    base = build_from_preset(config, device, dtype, backend="auto", max_tokens=ceiling, max_seqs=max_seqs,
                             max_seq_len=args.context + chunk + args.decode_steps + 8, producer="torch")
    build_s = time.perf_counter() - t0
    spread = measure_routing_spread(base, batch=32)
    print(spread.describe(), flush=True)
    model, cache = base.model, base.cache
    for t in (cache.k_cache, cache.v_cache, cache.index_k_cache):
        t.normal_()  # random context: attention reads as much as it would over a real prompt
    prefill_seq = max_seqs - 1
    for i in range(max_seqs):
        ctx = args.context - chunk if i == prefill_seq else args.context
        base.add_request(i)
        cache.reserve(i, ctx)
        cache.set_written(i, ctx)
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(1)

    def tok() -> list[int]:
        return [int(torch.randint(0, vocab, (1,), generator=gen))]

    steps = {f"decode {n}": [TokenChunk(i, args.context, tok()) for i in range(n)] for n in sizes}
    prompt = torch.randint(0, vocab, (chunk,), generator=gen).tolist()
    steps[f"mixed {n_dec}+{chunk}"] = ([TokenChunk(i, args.context, tok()) for i in range(n_dec)]
                                       + [TokenChunk(prefill_seq, args.context - chunk, prompt)])
    tables = {"torch": model.ops, "eager": model.ops, "fused": m3ops.make_ops("triton", device, dtype),
              "compile": None}
    results: dict = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
                         torch=torch.__version__, layers=args.layers,
                         context=args.context, buckets=buckets, build_s=build_s, modes={},
                         expert_spread=spread.as_dict())
    ref_logits: dict[str, torch.Tensor] = {}
    trace: dict | None = None
    print(f"MiniMax-M3 rank-of-8, {args.layers} layers, bf16, context {args.context}, buckets {buckets}; "
          f"built in {build_s:.1f} s; attention {base.backend.describe()}")
    for mode in args.modes.split(","):
        model.ops = tables[mode] if tables[mode] is not None else compiled_ops()
        capture = CaptureConfig(enabled=mode != "eager", max_tokens=ceiling, buckets=buckets,
                                guard_producers=mode != "compile", debug_eager=device == "cpu")
        runner = base.with_capture(capture)
        t0 = time.perf_counter()
        runner.capture()
        capture_s = time.perf_counter() - t0
        rows = []
        for name, chunks in steps.items():
            out = run_again(runner, chunks).logits.float()
            err = relative_error(out, ref_logits.setdefault(name, out))  # against the first mode's logits
            ms = wall_ms(lambda r=runner, c=chunks: run_again(r, c), args.iters)
            step = runner.make_step(chunks)
            cov = measure_coverage(runner.manager, step, layers=args.layers)
            kernels = cov.in_graphs + cov.eager
            rows.append(dict(step=name, wall_ms=ms, busy_us=cov.busy_us, busy_us_per_layer=cov.busy_us / args.layers,
                             kernels_per_layer=kernels / args.layers, in_graphs=cov.in_graphs, eager_kernels=cov.eager,
                             rel_err_vs_first_mode=err, coverage=cov.as_dict()))
            print(f"{mode:8s} {name:14s} busy {cov.busy_us / 1e3:8.2f} ms ({cov.busy_us / args.layers:7.1f} us/layer, "
                  f"{kernels / args.layers:5.1f} kernels/layer)  wall {ms:7.2f} ms  err vs first mode {err:.1e}")
            if mode == "fused" and name in ("decode 1", f"mixed {n_dec}+{chunk}"):
                from rich.console import Console

                Console(width=150).print(kernel_table(cov, top=15))
        stats = runner.manager.stats
        results["modes"][mode] = dict(capture_s=capture_s, capture_ms_graphs=stats.capture_ms,
                                      graph_mib=stats.memory_mib, rows=rows)
        if model.ops.tuner is not None:
            from rich.console import Console

            Console(width=150).print(choices_table(model.ops.tuner.choices))
            results["modes"][mode]["kernel_choices"] = [
                dict(op=c.op, key=c.key, chosen=c.chosen, timings_us=c.timings_us, rejected=c.rejected)
                for c in model.ops.tuner.choices.values()]
        if mode in ("torch", "fused") and args.decode_steps:
            trace = decode_trace(runner, args.decode_steps, args.context, trace if mode == "fused" else None)
            if mode == "fused":
                results["greedy_agreement"] = trace
                print("greedy agreement (fused vs torch producers):", trace)
        runner.manager.release()
        torch.cuda.empty_cache()
        with open(args.json, "w") as f:  # after every mode: a time box cutting the run short keeps what ran
            json.dump(results, f, indent=1, default=str)
    if args.accuracy_layers:
        results["fp32_reference"] = fp32_reference_check(base, args.accuracy_layers, args.decode_steps, device)
        print("fp32 reference check:", results["fp32_reference"])
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print_table(results, args.layers)


def fp32_reference_check(big: ModelRunner, layers: int, n_steps: int, device: str) -> dict:
    """The first ``layers`` layers of the model three times over identical weights and caches:
    fp32 with the torch producers and the reference attention (the reference), bf16 with the
    torch producers, bf16 with the fused producers (both on the production attention backend).
    A ``n_steps`` greedy decode of 4 requests, teacher-forced on the fp32 tokens: per step the
    logits' relative error against fp32, and the greedy agreement of fused with torch wherever
    the torch logits' top-2 gap exceeds twice that step's bf16 error bound (the largest logit
    error of the bf16 torch path against fp32)."""
    cfg = big.model.config.first_layers(layers)
    context, n_req = 600, 4
    params = dict(big.model.named_parameters())
    runs = {}
    for name, dtype, producer, backend in (("fp32", torch.float32, "torch", "torch"),
                                           ("bf16 torch", torch.bfloat16, "torch", "auto"),
                                           ("bf16 fused", torch.bfloat16, "triton", "auto")):
        r = build_from_preset(cfg, device, dtype, backend=backend, max_tokens=64, max_seqs=n_req,
                              max_seq_len=context + n_steps + 8, producer=producer,
                              moe_impl="loop" if dtype == torch.float32 else "auto")
        with torch.no_grad():
            for n, p in r.model.named_parameters():
                p.copy_(params[n])
        gen = torch.Generator(device=device).manual_seed(5)
        for t in (r.cache.k_cache, r.cache.v_cache, r.cache.index_k_cache):
            t.copy_(torch.randn(t.shape, generator=gen, device=device))
        for q in range(n_req):
            r.add_request(q)
            r.cache.reserve(q, context)
            r.cache.set_written(q, context)
        runs[name] = r
    tokens, errs, checked, agree, same_as_fp32 = [11] * n_req, {"bf16 torch": [], "bf16 fused": []}, 0, 0, {}
    for s in range(n_steps):
        chunks = [TokenChunk(q, context + s, [t]) for q, t in enumerate(tokens)]
        out = {name: r.step(chunks) for name, r in runs.items()}
        ref = out["fp32"].logits.float()
        for name in errs:
            errs[name].append(relative_error(out[name].logits.float(), ref))
            same_as_fp32[name] = same_as_fp32.get(name, 0) + sum(
                a == b for a, b in zip(out[name].next_tokens, out["fp32"].next_tokens))
        lt = out["bf16 torch"].logits.float()
        bound = (lt - ref).abs().amax(-1)
        top2 = lt.topk(2, dim=-1).values
        for r_ in range(n_req):
            if top2[r_, 0] - top2[r_, 1] > 2 * bound[r_]:
                checked += 1
                agree += out["bf16 fused"].next_tokens[r_] == out["bf16 torch"].next_tokens[r_]
        tokens = out["fp32"].next_tokens
    total = n_steps * n_req
    return dict(layers=layers, steps=n_steps, requests=n_req, context=context,
                rel_err_median={k: statistics.median(v) for k, v in errs.items()},
                rel_err_max={k: max(v) for k, v in errs.items()},
                greedy_checked=checked, greedy_agree=agree,
                tokens_equal_to_fp32={k: f"{v}/{total}" for k, v in same_as_fp32.items()})


def decode_trace(runner: ModelRunner, n_steps: int, context: int, reference: dict | None = None) -> dict:
    """``n_steps`` greedy decode steps of (up to) 4 requests. Without ``reference``: record the inputs,
    greedy tokens, top-2 logit gaps and bf16 error bounds (2e-2 of the logits' rms, the bf16
    tolerance used elsewhere). With it: run the reference's inputs (teacher forcing) and count,
    over the steps whose reference gap exceeds the bound, the greedy tokens that agree."""
    seqs = list(range(min(4, runner.max_seqs - 1)))  # the last request is the mixed step's prefill
    tokens = [7] * len(seqs)
    rec: dict = dict(inputs=[], next=[], gap=[], bound=[])
    checked = agree = 0
    for s in range(n_steps):
        if reference is not None:
            tokens = reference["inputs"][s]
        out = runner.step([TokenChunk(q, context + s, [t]) for q, t in zip(seqs, tokens)])
        logits = out.logits.float()
        top2 = logits.topk(2, dim=-1).values
        rec["inputs"].append(tokens)
        rec["next"].append(out.next_tokens)
        rec["gap"].append((top2[:, 0] - top2[:, 1]).tolist())
        rec["bound"].append((2e-2 * logits.pow(2).mean(-1).sqrt()).tolist())
        if reference is not None:
            for r in range(len(seqs)):
                if reference["gap"][s][r] > reference["bound"][s][r]:
                    checked += 1
                    agree += out.next_tokens[r] == reference["next"][s][r]
        tokens = out.next_tokens
    for q in seqs:
        runner.rewind_request(q, context)
    if reference is None:
        return rec
    return dict(steps=n_steps, requests=len(seqs), checked=checked, agree=agree,
                identical_tokens=sum(a == b for a, b in zip(rec["next"], reference["next"])))


def print_table(results: dict, layers: int) -> None:
    modes = results["modes"]
    names = [r["step"] for r in next(iter(modes.values()))["rows"]]
    print(f"\n{'step':14s} " + " ".join(f"{m + ' us/layer':>18s} {'krn/l':>6s} {'wall ms':>8s}" for m in modes))
    for i, name in enumerate(names):
        cells = []
        for m in modes.values():
            r = m["rows"][i]
            cells.append(f"{r['busy_us_per_layer']:>18.1f} {r['kernels_per_layer']:>6.1f} {r['wall_ms']:>8.2f}")
        print(f"{name:14s} " + " ".join(cells))
    print("capture s: " + ", ".join(f"{m} {v['capture_s']:.1f}" for m, v in modes.items()))


if __name__ == "__main__":
    main()
