"""Benchmark the Triton attention kernels (MiniMax-M3 shapes) against the torch references.

Per op and size: median GPU time (``triton.testing.do_bench``, L2 flushed before every run;
decode ops also as CUDA-graph replays, which drop the host launch gaps), bytes and FLOPs
counted from shapes, achieved TB/s or TFLOP/s, the floor ``max(bytes / 4.3 TB/s,
FLOPs / 790 TFLOP/s)`` (H200 datasheet ceilings; measure your own for a sharper floor) and
time / floor, and the speed-up over the torch reference where the reference is timed (it
loops over requests on the host and materialises [heads, tokens, keys] scores, so only the
smaller sizes).

Byte and FLOP formulas (bf16 = 2 B; B = 128-token block, K = 16 blocks):
- index top-k, decode: bytes = sum over rows of kv_len * Di * 2 (index-K, read once)
  + T * H * Di * 2 (iq) + H * T * K * 4 (selection); FLOPs = 2 * H * Di * sum(kv_len).
- sparse attention: keys = sum over (token, group) of the selected keys it sees (<= K * B
  each); decode bytes = keys * D * 2 * 2 (K and V of the selected blocks) + 2 * T * Hq * D * 2
  (q in, out); prefill bytes count each distinct block once, so min(keys, L * Hkv) in place
  of keys; FLOPs = 4 * (Hq / Hkv) * keys * D (QK^T and PV).
- index top-k, prefill (one chunk of T tokens ending at context L): FLOPs =
  2 * H * Di * sum_t (p_t + 1); bytes = L * Di * 2 + T * H * Di * 2.
- producer (norm + RoPE + cache write): bytes = T * W * 2 (read the fused projection)
  + T * (Hq + Hidx) * D * 2 (q, iq rewritten) + T * (2 * Hkv * D + Di) * 2 (cache rows).
- dense fallback, decode: bytes = T * L * Hkv * D * 2 * 2; FLOPs = 4 * T * Hq * L * D.

Usage (GPU): ``python benchmarks/bench_attention_kernels.py --out bench.json``.
``--smoke`` runs tiny shapes with host timing (the Triton interpreter works too) to check the
script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from timing import Timer

HBM_TBPS, BF16_TFLOPS = 4.3, 790.0


@dataclass(frozen=True)
class Dims:
    num_qo_heads: int = 64
    num_kv_heads: int = 4
    head_dim: int = 128
    index_dim: int = 128
    block: int = 128
    topk: int = 16
    rotary_dim: int = 64


SMOKE_DIMS = Dims(num_qo_heads=4, num_kv_heads=2, head_dim=32, index_dim=32, block=16, topk=4, rotary_dim=16)


@dataclass
class Row:
    op: str
    context: int
    tokens: int
    time_us: float
    bytes: float
    flops: float
    graph_us: float | None = None
    ref_us: float | None = None
    note: str = ""
    derived: dict = field(default_factory=dict)

    def finish(self) -> "Row":
        t = (self.graph_us or self.time_us) * 1e-6
        floor = max(self.bytes / (HBM_TBPS * 1e12), self.flops / (BF16_TFLOPS * 1e12))
        self.derived = dict(
            tbps=self.bytes / t / 1e12, tflops=self.flops / t / 1e12, floor_us=floor * 1e6,
            x_floor=t / floor if floor else float("nan"),
            speedup=(self.ref_us / self.time_us) if self.ref_us else None,
        )
        return self


def make_cache(dims: Dims, seq_lens: list[int], capacity_tokens: int, device: str):
    """A one-layer sparse cache (random contents) with one sequence per entry of seq_lens."""
    from kvcache.paged import KVCacheConfig, PagedKVCache

    bs = dims.block
    pages = [-(-n // bs) for n in seq_lens]
    cache = PagedKVCache(KVCacheConfig(
        num_layers=1, sparse_layers=(0,), num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
        index_dim=dims.index_dim, page_size=bs, num_pages=sum(pages) + 1, max_seqs=len(seq_lens),
        max_pages_per_seq=max(max(pages), -(-capacity_tokens // bs)), device=device))
    for i, n in enumerate(seq_lens):
        cache.add_sequence(i)
        cache.reserve(i, n)
    for t in (cache.k_cache, cache.v_cache, cache.index_k_cache):
        t.normal_()
    return cache


def rand(*shape, device):
    return torch.randn(shape, device=device, dtype=torch.bfloat16)


def selected_keys(sel: torch.Tensor, positions: torch.Tensor, bs: int) -> torch.Tensor:
    """Keys each (group, token) attends: per selected block, its keys <= p. -> float sum."""
    s = sel.long()
    n = torch.where(s >= 0, torch.clamp(positions[None, :, None] - s * bs + 1, 0, bs), 0)
    return n.sum().float()


def bench_decode(dims, ctx, batch, capacity, timer, ref_ok, device) -> list[Row]:
    from attention.kernels.indexer import index_topk_decode
    from attention.kernels.sparse import sparse_attention_decode
    from attention.metadata import MetadataBuilder
    from attention.reference.indexer import index_topk_ref
    from attention.reference.sparse import sparse_attention_ref
    from steps import TokenChunk

    d = dims
    cache = make_cache(d, [ctx] * batch, capacity, device)
    meta = MetadataBuilder(cache, max_tokens=batch, max_seqs=batch).build(
        [TokenChunk(i, ctx - 1, [0]) for i in range(batch)])
    q, iq = (rand(batch, d.num_qo_heads, d.head_dim, device=device),
             rand(batch, d.num_kv_heads, d.index_dim, device=device))
    topk = torch.full((d.num_kv_heads, batch, d.topk), -1, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    ik, kc, vc = cache.index_k_cache[0], cache.k_cache[0], cache.v_cache[0]
    scale = d.head_dim**-0.5

    def idx():
        index_topk_decode(iq, ik, meta, d.topk, topk)

    def attn():
        sparse_attention_decode(q, kc, vc, topk, meta, out, scale)

    def both():
        idx()
        attn()

    idx()
    keys = selected_keys(topk, meta.positions, d.block).item()
    H, Di, D = d.num_kv_heads, d.index_dim, d.head_dim
    idx_bytes = batch * ctx * Di * 2 + batch * H * Di * 2 + H * batch * d.topk * 4
    attn_bytes = keys * D * 2 * 2 + 2 * batch * d.num_qo_heads * D * 2
    attn_flops = 4 * keys * (d.num_qo_heads // H) * D
    note = f"capacity {capacity} tokens" if capacity != ctx else ""
    rows = [
        Row("index_topk decode", ctx, batch, timer(idx), idx_bytes, 2 * H * Di * batch * ctx, timer.graph(idx),
            note=note),
        Row("sparse_attn decode", ctx, batch, timer(attn), attn_bytes, attn_flops, timer.graph(attn), note=note),
        Row("decode idx+attn", ctx, batch, timer(both), idx_bytes + attn_bytes, 2 * H * Di * batch * ctx + attn_flops,
            timer.graph(both), note=note),
    ]
    if ref_ok:
        ref_topk = torch.empty_like(topk)
        ref_out = torch.empty_like(out)
        rows[0].ref_us = timer(lambda: index_topk_ref(iq, ik, meta, d.topk, d.block, ref_topk), rep_ms=20)
        rows[1].ref_us = timer(lambda: sparse_attention_ref(q, kc, vc, topk, meta, ref_out, scale, d.block), rep_ms=20)
        rows[2].ref_us = rows[0].ref_us + rows[1].ref_us
        # a benchmark that is fast and wrong is worse than none: check once
        sparse_attention_ref(q, kc, vc, topk, meta, ref_out, scale, d.block)
        attn()
        err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        rows[1].note = (rows[1].note + f" relerr {err:.1e}").strip()
    del cache
    return [r.finish() for r in rows]


def bench_prefill(dims, ctx, chunk, timer, ref_ok, device) -> list[Row]:
    from attention.kernels.indexer import index_topk_prefill
    from attention.kernels.sparse import sparse_attention_prefill
    from attention.metadata import MetadataBuilder
    from attention.reference.indexer import index_topk_ref
    from attention.reference.sparse import sparse_attention_ref
    from steps import TokenChunk

    d = dims
    cache = make_cache(d, [ctx], ctx, device)
    meta = MetadataBuilder(cache, max_tokens=chunk, max_seqs=1).build([TokenChunk(0, ctx - chunk, [0] * chunk)])
    q, iq = (rand(chunk, d.num_qo_heads, d.head_dim, device=device),
             rand(chunk, d.num_kv_heads, d.index_dim, device=device))
    topk = torch.full((d.num_kv_heads, chunk, d.topk), -1, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    ik, kc, vc = cache.index_k_cache[0], cache.k_cache[0], cache.v_cache[0]
    scale = d.head_dim**-0.5
    H, Di, D = d.num_kv_heads, d.index_dim, d.head_dim
    vis = float(chunk * (ctx - chunk) + chunk * (chunk + 1) / 2)  # sum_t (p_t + 1)

    def idx():
        index_topk_prefill(iq, ik, meta, d.topk, topk)

    idx()
    keys = selected_keys(topk, meta.positions, d.block).item()
    # each distinct block read once: at most the whole context's K/V
    attn_bytes = min(keys, ctx * H) * D * 2 * 2 + 2 * chunk * d.num_qo_heads * D * 2
    attn_flops = 4 * keys * (d.num_qo_heads // H) * D
    rows = [Row("index_topk prefill", ctx, chunk, timer(idx), ctx * Di * 2 + chunk * H * Di * 2, 2 * H * Di * vis)]
    # Random data makes neighbouring tokens pick unrelated blocks (the worst case for token
    # tiles); "shared4" gives runs of 4 tokens one selection, as locality in real text would.
    t = torch.arange(chunk, device=device)
    t0 = t - t % 4
    same = (meta.positions[t0] // d.block) == (meta.positions // d.block)
    shared = torch.where(same[None, :, None], topk[:, t0], topk)
    for sel, tag in ((topk, "indexer"), (shared, "shared4")):
        for bt in (None, 1):
            rows.append(Row(f"sparse_attn prefill bt={bt or 'auto'} {tag}", ctx, chunk,
                            timer(lambda sel=sel, bt=bt:
                                  sparse_attention_prefill(q, kc, vc, sel, meta, out, scale, bt)),
                            attn_bytes, attn_flops))
    if ref_ok:
        ref_topk = torch.empty_like(topk)
        ref_out = torch.empty_like(out)
        rows[0].ref_us = timer(lambda: index_topk_ref(iq, ik, meta, d.topk, d.block, ref_topk), rep_ms=20)
        ref_attn = timer(lambda: sparse_attention_ref(q, kc, vc, topk, meta, ref_out, scale, d.block), rep_ms=20)
        rows[1].ref_us = rows[2].ref_us = ref_attn
        sparse_attention_prefill(q, kc, vc, topk, meta, out, scale)
        err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        rows[1].note = f"relerr {err:.1e}"
    del cache
    return [r.finish() for r in rows]


def bench_dense_decode(dims, ctx, batch, timer, device) -> list[Row]:
    from attention.kernels.sparse import dense_attention_triton
    from attention.metadata import MetadataBuilder
    from steps import TokenChunk

    d = dims
    cache = make_cache(d, [ctx] * batch, ctx, device)
    meta = MetadataBuilder(cache, max_tokens=batch, max_seqs=batch).build(
        [TokenChunk(i, ctx - 1, [0]) for i in range(batch)])
    q = rand(batch, d.num_qo_heads, d.head_dim, device=device)
    out = torch.empty_like(q)

    def fn():
        dense_attention_triton(q, cache.k_cache[0], cache.v_cache[0], meta, out, d.head_dim**-0.5, graph_safe=True)

    byts = batch * ctx * d.num_kv_heads * d.head_dim * 4
    row = Row("dense_attn decode (fallback)", ctx, batch, timer(fn), byts,
              4 * batch * d.num_qo_heads * ctx * d.head_dim, timer.graph(fn))
    return [row.finish()]


def bench_producer(dims, T, timer, device) -> list[Row]:
    from attention.rope import rope_inv_freq
    from models.minimax_m3.kernels.producer import QKVLayout, norm_rope_cache_write, norm_rope_torch

    d = dims
    L = QKVLayout(d.num_qo_heads, d.num_kv_heads, d.head_dim, d.num_kv_heads, d.index_dim, d.rotary_dim)
    pages = -(-T // d.block) + 1
    kc = rand(pages, d.block, d.num_kv_heads, d.head_dim, device=device)
    vc, ic = torch.empty_like(kc), rand(pages, d.block, d.index_dim, device=device)
    qkv = rand(T, L.width, device=device)
    pos = torch.randint(0, 1 << 20, (T,), device=device)
    slots = torch.randperm(pages * d.block, device=device)[:T]
    w = [0.1 * rand(n, device=device) for n in (d.head_dim, d.head_dim, d.index_dim, d.index_dim)]
    inv = rope_inv_freq(5e6, d.rotary_dim, device)
    args = (qkv, pos, slots, L, inv, w[0], w[1], kc, vc)
    kw = dict(index_q_norm=w[2], index_k_norm=w[3], index_k_cache=ic)
    byts = T * L.width * 2 + T * (L.num_q_heads + L.num_index_heads) * d.head_dim * 2 \
        + T * (2 * L.num_kv_heads * d.head_dim + d.index_dim) * 2
    row = Row("norm+rope+cache_write", 0, T, timer(lambda: norm_rope_cache_write(*args, **kw)), byts, 0.0,
              timer.graph(lambda: norm_rope_cache_write(*args, **kw)))
    row.ref_us = timer(lambda: norm_rope_torch(qkv, pos, L, inv, *w), rep_ms=20)  # the maths, without the writes
    return [row.finish()]


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    cols = f"{'op':38s} {'ctx':>7s} {'T':>5s} {'us':>9s} {'graph us':>9s} {'TB/s':>6s} {'TFLOP/s':>8s} " \
           f"{'floor us':>9s} {'x floor':>7s} {'ref us':>9s} {'speedup':>8s}  note"
    print(cols)
    print("-" * len(cols))
    for r in rows:
        x = r.derived

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"

        print(f"{r.op:38s} {r.context:7d} {r.tokens:5d} {r.time_us:9.1f} {f(r.graph_us, '9.1f'):>9s} "
              f"{x['tbps']:6.2f} {x['tflops']:8.1f} {x['floor_us']:9.1f} {x['x_floor']:7.2f} "
              f"{f(r.ref_us, '9.1f'):>9s} {f(x['speedup'], '8.1f'):>8s}  {r.note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_attention_kernels.json", help="JSON output path")
    ap.add_argument("--contexts", default="1024,8192,32768,131072", help="context lengths (tokens)")
    ap.add_argument("--decode-batches", default="1,32,128")
    ap.add_argument("--prefill-chunks", default="1024,4096")
    ap.add_argument("--producer-tokens", default="1,32,128,1024,4096")
    ap.add_argument("--ops", default="producer,decode,prefill,dense", help="subset of producer,decode,prefill,dense")
    ap.add_argument("--ref-max-context", type=int, default=8192, help="time the torch reference up to this context")
    ap.add_argument("--ref-max-tokens", type=int, default=1024, help="... and up to this many query tokens")
    ap.add_argument("--capacity-check", type=int, default=1 << 20,
                    help="extra decode row at 8K context with this block-table capacity (tokens); 0 = skip")
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, host timing: checks the script runs")
    a = ap.parse_args(argv)

    if a.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        dims, device = SMOKE_DIMS, ("cuda" if torch.cuda.is_available() else "cpu")
        a.contexts, a.decode_batches, a.prefill_chunks, a.producer_tokens = "64,200", "1,3", "32", "1,8"
        a.capacity_check = 512
    else:
        if not torch.cuda.is_available():
            print("bench_attention_kernels: needs a CUDA GPU (use --smoke to check the script on CPU)", file=sys.stderr)
            return 2
        dims, device = Dims(), "cuda"
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ops = set(a.ops.split(","))
    timer = Timer(a.smoke, a.warmup_ms, a.rep_ms)
    torch.manual_seed(0)
    rows: list[Row] = []
    t0 = time.time()
    if "producer" in ops:
        for T in ints(a.producer_tokens):
            rows += bench_producer(dims, T, timer, device)
    for ctx in ints(a.contexts):
        if "decode" in ops:
            for b in ints(a.decode_batches):
                ref_ok = ctx <= a.ref_max_context and b <= 32
                rows += bench_decode(dims, ctx, b, ctx, timer, ref_ok, device)
        if "prefill" in ops:
            for chunk in ints(a.prefill_chunks):
                if chunk <= ctx:
                    ref_ok = ctx <= a.ref_max_context and chunk <= a.ref_max_tokens
                    rows += bench_prefill(dims, ctx, chunk, timer, ref_ok, device)
        if "dense" in ops and ctx <= 32768:
            for b in ints(a.decode_batches)[:2]:
                rows += bench_dense_decode(dims, ctx, b, timer, device)
        if device == "cuda":
            torch.cuda.empty_cache()
    if "decode" in ops and a.capacity_check:
        ctx = min(8192, max(ints(a.contexts)))
        rows += bench_decode(dims, ctx, 32 if not a.smoke else 2, a.capacity_check, timer, False, device)

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"
    import triton

    header = (f"{gpu} | torch {torch.__version__} | triton {triton.__version__} | dims {asdict(dims)} | "
              f"floor = max(bytes/{HBM_TBPS} TB/s, flops/{BF16_TFLOPS} TFLOP/s) | {time.time() - t0:.0f} s")
    print_table(rows, header)
    with open(a.out, "w") as f:
        json.dump(dict(header=header, rows=[asdict(r) for r in rows]), f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
