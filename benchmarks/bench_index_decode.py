"""Benchmark the sparse kernels of a decode step at long context, bf16 vs fp8 KV (GPU).

The step: ``--requests`` decode rows (one token each, context ``--contexts``) over one sparse
layer at rank-of-8 shapes (1 kv head = 1 index head, head_dim 128, index dim 128, block 128,
top-16), every cache slot random, the block table as wide as the context or, with
``--capacity``, as a deployment's (its longest sequence: a decode graph's grid and merge are
sized by it, whatever the context). Timed, GPU only
(``triton.testing.do_bench`` of a CUDA graph of the op, L2 flushed before each replay, median):
- ``index``: ``index_topk_decode`` (partial kernel + merge), with the index-K bytes it streams
  (every block before each row's local one) and the bandwidth that makes;
- ``attention``: ``sparse_attention_decode`` on those selections;
- ``sparse``: both, one graph (the figure of issue 21's fp8 / bf16 target).
With ``--prefill``, the indexer of a 1024-token chunk ending at each context (3 decodes beside
it, request-aligned tiles, as the Triton backend runs a mixed step), per kernel from the
profiler. With ``--sweep``, the one-token partial kernel's chunk, warps and stages at the
largest step. Each decode selection is checked against ``index_topk_ref`` (on the fp8 kernels'
split queries for an fp8 cache): the rows that differ are printed (near-ties of fp8 wgmma's
accumulation may flip a few).

Usage (GPU): ``python benchmarks/bench_index_decode.py --json index_decode.json``; run it on
an earlier checkout too (``PYTHONPATH=.baseline``) for the side by side (``scripts/gpu_suite.sh
indexdecode``). ``--smoke`` runs tiny shapes on CPU (Triton interpreter) to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
from timing import Timer, kernel_times

DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Dims:
    head_dim: int = 128
    index_dim: int = 128
    block: int = 128
    topk: int = 16
    num_qo_heads: int = 8


SMOKE_DIMS = Dims(head_dim=32, index_dim=32, block=16, topk=4, num_qo_heads=4)


class DecodeStep:
    """``rows`` decode requests at context ``ctx`` (plus ``prefill`` tokens of one more request
    ending at ``ctx`` when asked), one sparse layer, caches in ``kv``."""

    def __init__(self, d: Dims, rows: int, ctx: int, kv: torch.dtype, device: str, prefill: int = 0,
                 capacity: int = 0) -> None:
        from attention import metadata as md
        from kvcache.paged import KVCacheConfig, PagedKVCache
        from steps import TokenChunk

        specs = [(ctx, 1)] * rows + ([(ctx, prefill)] if prefill else [])
        pages = -(-ctx // d.block)
        self.cache = c = PagedKVCache(KVCacheConfig(
            num_layers=1, sparse_layers=(0,), num_kv_heads=1, head_dim=d.head_dim, index_dim=d.index_dim,
            page_size=d.block, num_pages=pages * len(specs) + 1, max_seqs=len(specs),
            max_pages_per_seq=max(pages, -(-capacity // d.block)),
            dtype=kv, index_dtype=kv, device=device))
        for i, (n, q) in enumerate(specs):
            c.add_sequence(i)
            c.reserve(i, n)
            c.set_written(i, n - q)
        g = torch.Generator(device=device).manual_seed(rows * 7 + ctx)
        for t in (c.k_cache, c.v_cache, c.index_k_cache):
            for p in range(0, t.shape[1], 4096):  # in slices: a bf16 copy of the whole cache need not fit
                sl = t[:, p : p + 4096]
                sl.copy_(torch.randn(sl.shape, generator=g, device=device).to(t.dtype))
        self.builder = md.MetadataBuilder(c, max_tokens=sum(q for _, q in specs), max_seqs=len(specs))
        chunks = [TokenChunk(i, n - q, [0] * q) for i, (n, q) in enumerate(specs)]
        self.meta = self.builder.build(chunks)
        self.T = self.meta.num_tokens
        self.q = torch.randn(self.T, d.num_qo_heads, d.head_dim, generator=g, device=device).to(torch.bfloat16)
        self.iq = torch.randn(self.T, 1, d.index_dim, generator=g, device=device).to(torch.bfloat16)
        self.ik, self.k, self.v = c.index_k_cache[0], c.k_cache[0], c.v_cache[0]
        self.sel = torch.full((1, self.T, d.topk), -1, dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.q)
        self.index_bytes = rows * (ctx - 1) // d.block * d.block * d.index_dim * self.ik.element_size()


def selection_mismatch(st: DecodeStep, d: Dims) -> float:
    """Fraction of rows whose selected set differs from the reference's."""
    from attention.reference.indexer import fp8_query_split, index_topk_ref

    iq = fp8_query_split(st.iq) if st.ik.dtype == torch.float8_e4m3fn else st.iq
    ref = torch.full_like(st.sel, -7)
    index_topk_ref(iq, st.ik.to(torch.bfloat16), st.meta, d.topk, d.block, ref)
    return (st.sel.sort(-1).values != ref.sort(-1).values).any(-1).float().mean().item()


def prefill_kernels(st: DecodeStep, d: Dims, reps: int) -> dict[str, float]:
    """GPU us per kernel of the tiled indexer over the step (profiler, ``reps`` runs)."""
    from attention.kernels import indexer
    from attention.kernels.tiles import TilePlanner

    tiles = TilePlanner(st.builder.max_tokens, st.iq.device).plan(st.meta.qo_indptr_host,
                                                                  indexer.tile_block_t(1))

    def fn() -> None:
        indexer.index_topk_prefill_tiled(st.iq, st.ik, st.meta, d.topk, st.sel, tiles)

    return kernel_times({"tiled indexer": fn}, reps)["tiled indexer"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench_index_decode.json")
    ap.add_argument("--label", default="")
    ap.add_argument("--requests", default="1,8,32", help="decode rows, comma-separated")
    ap.add_argument("--contexts", default="65536,131072", help="contexts, comma-separated")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--capacity", type=int, default=0,
                    help="block-table width in tokens (default: each context's own)")
    ap.add_argument("--prefill", action="store_true", help="also the tiled prefill indexer, per kernel")
    ap.add_argument("--sweep", action="store_true", help="also sweep the decode partial kernel's chunk and launch")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, host timing (CPU: the interpreter)")
    a = ap.parse_args(argv)
    if a.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        dims, device = SMOKE_DIMS, ("cuda" if torch.cuda.is_available() else "cpu")
        a.requests, a.contexts, a.kv = "2", "70", "bf16"
    elif not torch.cuda.is_available():
        print("bench_index_decode: needs a CUDA GPU (use --smoke to check the script)", file=sys.stderr)
        return 2
    else:
        dims, device = Dims(), "cuda"
    from attention.kernels import indexer, sparse

    timer = Timer(a.smoke, 25, 100)
    rows_out, t0 = [], time.time()
    for ctx in [int(x) for x in a.contexts.split(",")]:
        for kv_name in a.kv.split(","):
            kv = DTYPES[kv_name]
            for R in [int(x) for x in a.requests.split(",")]:
                st = DecodeStep(dims, R, ctx, kv, device, capacity=a.capacity)

                def index(st=st) -> None:
                    indexer.index_topk_decode(st.iq, st.ik, st.meta, dims.topk, st.sel)

                def attention(st=st) -> None:
                    sparse.sparse_attention_decode(st.q, st.k, st.v, st.sel, st.meta, st.out, dims.head_dim**-0.5)

                def both() -> None:
                    index()
                    attention()

                index()
                mismatch = selection_mismatch(st, dims)
                time_of = timer if a.smoke else timer.graph
                t_index, t_attn, t_both = (time_of(f) for f in (index, attention, both))
                row = dict(ctx=ctx, capacity=max(ctx, a.capacity), kv=kv_name, requests=R, index_us=round(t_index, 1),
                           attention_us=round(t_attn, 1), sparse_us=round(t_both, 1),
                           index_mb=round(st.index_bytes / 1e6, 1),
                           index_tb_s=round(st.index_bytes / t_index / 1e6, 2), rows_differing=mismatch)
                rows_out.append(row)
                print(f"ctx {ctx:7d} cap {row['capacity']:7d} {kv_name:4s} decode {R:3d}: index {t_index:7.1f} us "
                      f"({row['index_tb_s']:.2f} TB/s over {row['index_mb']:.0f} MB)  attention {t_attn:6.1f}  "
                      f"both {t_both:7.1f} us  rows differing {mismatch:.1e}", flush=True)
                del st
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
    sweep_out = []
    if a.sweep and not a.smoke:  # the one-token partial kernel's chunk and launch, at the largest step
        ctx, R = max(int(x) for x in a.contexts.split(",")), max(int(x) for x in a.requests.split(","))
        for kv_name in a.kv.split(","):
            st = DecodeStep(dims, R, ctx, DTYPES[kv_name], device)
            default = dict(indexer.ROW_CONFIG)
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                indexer.ROW_CONFIG.update(num_warps=warps, num_stages=stages)
                for chunk in (32, 64, 128):
                    def index(st=st, chunk=chunk) -> None:
                        indexer.index_topk_decode(st.iq, st.ik, st.meta, dims.topk, st.sel, chunk)

                    try:
                        index()
                    except Exception as e:  # e.g. more shared memory than an SM has
                        print(f"sweep {kv_name}: warps {warps} stages {stages} chunk {chunk}: failed "
                              f"({type(e).__name__}: {str(e)[:120]})", flush=True)
                        continue
                    t = timer.graph(index)
                    sweep_out.append(dict(kv=kv_name, warps=warps, stages=stages, chunk=chunk, index_us=round(t, 1)))
                    print(f"sweep {kv_name} ctx {ctx} decode {R}: warps {warps} stages {stages} chunk {chunk:3d}: "
                          f"{t:7.1f} us", flush=True)
            indexer.ROW_CONFIG.clear()
            indexer.ROW_CONFIG.update(default)
            del st
            torch.cuda.empty_cache()
    prefill_out = []
    if a.prefill and not a.smoke:
        for ctx in [int(x) for x in a.contexts.split(",")]:
            for kv_name in a.kv.split(","):
                st = DecodeStep(dims, 3, ctx, DTYPES[kv_name], device, prefill=1024)
                k = prefill_kernels(st, dims, 20)
                prefill_out.append(dict(ctx=ctx, kv=kv_name, kernels_us=k, total_us=round(sum(k.values()), 1)))
                print(f"prefill chunk 1024 + 3 decodes at {ctx} {kv_name}: {sum(k.values()):.1f} us  {k}", flush=True)
                del st
                torch.cuda.empty_cache()
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"
    header = (f"{a.label} | {gpu} | torch {torch.__version__} | triton {triton.__version__} | dims {asdict(dims)} | "
              f"{time.time() - t0:.0f} s")
    print(header)
    with open(a.json, "w") as f:
        json.dump({"header": header, "decode": rows_out, "sweep": sweep_out, "prefill": prefill_out}, f, indent=1)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
