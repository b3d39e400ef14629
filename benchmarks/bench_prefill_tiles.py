"""Benchmark request-aligned token tiles on a mixed serving step (GPU).

The step: ``--decodes`` decode requests (1 token, context ``--decode-ctx``) and one prefill
chunk of ``--chunk`` tokens starting at ``--chunk-start`` of its prompt, at rank-of-8 shapes
(8 q heads, 1 kv head = 1 index head, head_dim 128, index dim 128, block 128, top-16); the
prefill chunk sits in the middle of the batch, as a scheduler may place it.

Rows, indexer and attention separately, median of ``triton.testing.do_bench`` (L2 flushed,
eager launches, so host launch gaps count) and the same ops replayed as one CUDA graph
(``graph us``: GPU time only; the tiled ops are capturable for a fixed step):
- ``untiled bt=1``: today's backend for a step of several requests (one token per program);
- ``tiled``: ``index_topk_prefill_tiled`` / ``sparse_attention_prefill_tiled`` with the
  default tile sizes (the attention: every tile in ``TILE_SPLITS`` programs of one launch,
  and their merge; ``nsplit=1``: one program per tile);
- ``block-major``: ``sparse_blocks.sparse_attention_prefill_blocks`` (the queries that selected a
  key block in programs of up to four tiles), and on the first selection with fp32 partials,
  with 1-8 tiles a program, with the bucketing in programs of 64 tokens and with the split
  merge loading 16 KB a program;
- ``sparse splice``: the indexer and block-major attention together, as the Triton backend runs
  them (the indexer's merge buckets the pairs) and with the bucketing launch of their own;
- sweeps: other tile sizes (``bt=``) and the indexer's chunk and pipeline stages;
- with ``--kernels``, the GPU time per kernel of the defaults (profiler); ``--ncu`` only runs
  the defaults, for Nsight Compute.
The attention runs on four selections: the indexer's on random data (neighbouring tokens
pick unrelated blocks: the worst case for tiles) and ``shared8/32/128`` (runs of 8, 32 or 128
prefill tokens share the run's first token's selection where it sees the same local block,
as locality in real text would; runs that straddle a key block keep part of their own).
Each tiled result is checked once against the untiled one (selection mismatch rate,
attention relative error), and the host cost of planning the tiles is timed.

Usage (GPU): ``python benchmarks/bench_prefill_tiles.py --json prefill_tiles.json``;
``--smoke`` runs tiny shapes with host timing (the Triton interpreter works too) to check the
script itself. About 30 s on an H200 (``--budget-s`` stops the sweeps early).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from timing import Timer, kernel_times


@dataclass(frozen=True)
class Dims:
    num_qo_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 128
    index_dim: int = 128
    block: int = 128
    topk: int = 16


SMOKE_DIMS = Dims(num_qo_heads=4, num_kv_heads=1, head_dim=32, index_dim=32, block=16, topk=4)


@dataclass
class Row:
    op: str
    variant: str
    time_us: float
    graph_us: float | None
    launches: int
    check: str = ""


class Step:
    """The mixed step: a paged cache with random contents, metadata, q / iq, outputs."""

    def __init__(self, d: Dims, decodes: int, decode_ctx: int, chunk: int, chunk_start: int, device: str) -> None:
        from attention import metadata as md
        from kvcache.paged import KVCacheConfig, PagedKVCache
        from steps import TokenChunk

        bs = d.block
        specs = [(decode_ctx, 1)] * (decodes // 2) + [(chunk_start + chunk, chunk)] + [(decode_ctx, 1)] * (
            decodes - decodes // 2)
        pages = [-(-n // bs) for n, _ in specs]
        self.cache = c = PagedKVCache(KVCacheConfig(
            num_layers=1, sparse_layers=(0,), num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
            index_dim=d.index_dim, page_size=bs, num_pages=sum(pages) + 1, max_seqs=len(specs),
            max_pages_per_seq=max(pages), device=device))
        for i, (n, _) in enumerate(specs):
            c.add_sequence(i)
            c.reserve(i, n)
        for t in (c.k_cache, c.v_cache, c.index_k_cache):
            t.normal_()
        self.T = sum(n for _, n in specs)
        self.builder = md.MetadataBuilder(c, max_tokens=self.T, max_seqs=len(specs))
        for i, (n, q) in enumerate(specs):
            c.set_written(i, n - q)
        chunks = [TokenChunk(i, n - q, [0] * q) for i, (n, q) in enumerate(specs)]
        self.builder.check(chunks)
        self.meta = self.builder.build(chunks)
        self.chunk_rows = (decodes // 2, decodes // 2 + chunk)
        self.q = torch.randn(self.T, d.num_qo_heads, d.head_dim, device=device, dtype=torch.bfloat16)
        self.iq = torch.randn(self.T, d.num_kv_heads, d.index_dim, device=device, dtype=torch.bfloat16)
        self.ik, self.k, self.v = c.index_k_cache[0], c.k_cache[0], c.v_cache[0]
        self.sel = torch.full((d.num_kv_heads, self.T, d.topk), -1, dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.q)
        self.scale = d.head_dim**-0.5

    def shared_selection(self, run: int, bs: int) -> torch.Tensor:
        """The chunk's tokens in runs of ``run`` take the run's first token's selection where
        that token's local block is theirs too (the local block must stay last and visible)."""
        pos = self.meta.positions
        t = torch.arange(self.T, device=pos.device)
        lo, hi = self.chunk_rows
        t0 = torch.where((t >= lo) & (t < hi), lo + (t - lo) // run * run, t)
        same = (pos[t0] // bs) == (pos // bs)
        return torch.where(same[None, :, None], self.sel[:, t0], self.sel)


@contextlib.contextmanager
def module_settings(module: types.ModuleType, settings: dict[str, object]) -> Iterator[None]:
    """``module``'s attributes set to ``settings`` inside the block, restored after."""
    saved = {name: getattr(module, name) for name in settings}
    for name, value in settings.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def run(a: argparse.Namespace, dims: Dims, device: str) -> tuple[list[Row], dict]:
    from attention.kernels import indexer, sparse, sparse_blocks
    from attention.kernels.tiles import TilePlanner

    timer = Timer(a.smoke, a.warmup_ms, a.rep_ms)
    st = Step(dims, a.decodes, a.decode_ctx, a.chunk, a.chunk_start, device)
    meta, d, t_start = st.meta, dims, time.time()
    rows: list[Row] = []
    planners: dict[int, TilePlanner] = {}

    def tiles(bt: int):
        planner = planners.setdefault(bt, TilePlanner(st.builder.max_tokens, device))
        return planner.plan(meta.qo_indptr_host, bt)

    def over_budget() -> bool:
        return time.time() - t_start > a.budget_s

    # host cost of the per-step plan (prefill_tiles + staging + async copy)
    tiles(16)
    h0 = time.perf_counter()
    for _ in range(50):
        tiles(16)
    plan_us = (time.perf_counter() - h0) / 50 * 1e6

    # ---- indexer
    ref_sel = torch.empty_like(st.sel)
    indexer.index_topk_prefill(st.iq, st.ik, meta, d.topk, ref_sel, block_t=1)

    def idx_row(variant: str, fn: Callable[[], None], launches: int) -> None:
        st.sel.fill_(-7)
        fn()
        diff = (st.sel.sort(-1).values != ref_sel.sort(-1).values).any(-1).float().mean().item()
        rows.append(Row("index_topk", variant, timer(fn), timer.graph(fn), launches, f"rows differing {diff:.1e}"))

    idx_row("untiled bt=1", lambda: indexer.index_topk_prefill(st.iq, st.ik, meta, d.topk, st.sel, block_t=1), 2)
    bt_small = indexer.default_block_t(d.num_kv_heads)
    idx_row(f"untiled bt={bt_small} (fixed grid)",
            lambda: indexer.index_topk_prefill(st.iq, st.ik, meta, d.topk, st.sel, block_t=bt_small), 2)
    bt_idx = indexer.tile_block_t(d.num_kv_heads)
    t_idx = tiles(bt_idx)
    idx_row(f"tiled (bt={bt_idx}, chunk {indexer.TILED_CHUNK}, default)",
            lambda: indexer.index_topk_prefill_tiled(st.iq, st.ik, meta, d.topk, st.sel, t_idx), 2)
    # (tokens a tile, key blocks a program, settings of the indexer module; the chunk None: the default)
    sweeps = [(bt_idx, 4, {}), (bt_idx, 2, {}), (bt_idx, 16, {}), (bt_idx, 32, {}), (bt_idx // 2, None, {}),
              (bt_idx * 2, None, {}), (bt_idx * 2, 16, {}), (bt_idx, None, {"TILE_STAGES": 2}),
              (bt_idx, None, {"TILE_STAGES": 4})]
    for bt, chunk, settings in sweeps:
        if over_budget() or bt < 1:
            continue
        tt = tiles(bt)
        with module_settings(indexer, settings):
            label = " ".join(f"{k.removeprefix('TILE_').lower()}={v}" for k, v in settings.items())
            idx_row(f"tiled bt={bt} chunk={chunk or indexer.TILED_CHUNK} {label}".rstrip(),
                    lambda tt=tt, chunk=chunk: indexer.index_topk_prefill_tiled(st.iq, st.ik, meta, d.topk, st.sel,
                                                                                tt, chunk), 2)
    indexer.index_topk_prefill_tiled(st.iq, st.ik, meta, d.topk, st.sel, t_idx)
    patterns = [(st.sel, "indexer")] + [(st.shared_selection(r, d.block), f"shared{r}") for r in (8, 32, 128)]

    # ---- sparse attention
    bt_att = sparse.default_block_t(d.num_qo_heads // d.num_kv_heads)
    block_planner = sparse_blocks.BlockPlanner(st.builder.max_seqs, st.cache.block_tables.numel(), device)
    blocks = sparse_blocks.sparse_attention_prefill_blocks
    for sel, tag in patterns if not a.indexer_only else []:
        ref_out = torch.empty_like(st.out)
        sparse.sparse_attention_prefill(st.q, st.k, st.v, sel, meta, ref_out, st.scale, block_t=1)

        def att_row(variant: str, fn: Callable[[], None], launches: int, sel=sel, tag=tag, ref_out=ref_out) -> None:
            st.out.fill_(float("nan"))
            fn()
            err = ((st.out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            rows.append(Row(f"sparse_attn {tag}", variant, timer(fn), timer.graph(fn), launches, f"relerr {err:.1e}"))

        att_row("untiled bt=1", lambda sel=sel: sparse.sparse_attention_prefill(st.q, st.k, st.v, sel, meta, st.out,
                                                                                st.scale, block_t=1), 1)
        block_plan = block_planner.plan(meta)
        # the default (bf16 partial outputs for bf16 queries); fp32 partials (more traffic through
        # the merge, less rounding); 1-8 tiles a program (the default: 4, two stages; each block's
        # K and V loaded once for them)
        variants = [("", sparse_blocks, {}), (" fp32 partials", sparse_blocks, {"PARTIALS": {}})] + [
            (f" {n} tiles a program, {stages} stage{'s' * (stages > 1)}", sparse_blocks,
             {"TILES_PER_PROGRAM": n, "ATTN_CONFIG": {"num_warps": 4, "num_stages": stages}})
            for n, stages in ((1, 1), (2, 1), (4, 1), (8, 2))]
        variants.append((" 64 tokens a bucketing program", sparse_blocks, {"BUCKET_TOKENS": 64}))
        # the split merge loading 16 KB a program (half the splits of a row; the default before)
        variants.append((" merge 16 KB a program", sparse, {"MERGE_BYTES": 16384}))
        for label, module, settings in variants:
            if label and (over_budget() or tag != "indexer"):
                continue
            with module_settings(module, settings):
                att_row("block-major" + label, lambda sel=sel, plan=block_plan: blocks(
                    st.q, st.k, st.v, sel, meta, st.out, st.scale, plan), 4)  # zeroed counts, buckets, blocks, merge
        if tag == "indexer":
            # the whole sparse splice as the backend runs it (the indexer's merge buckets the pairs)
            # beside the indexer, then block-major attention with its own bucketing launch
            ref_sel = st.sel.clone()
            for label, fused in (("indexer, then block-major", False), ("indexer buckets (the backend)", True)):
                def splice(fused=fused, plan=block_plan) -> None:
                    space = sparse_blocks.bucket_space(st.q, d.num_kv_heads, d.topk, plan) if fused else None
                    b = indexer.index_topk_prefill_tiled(st.iq, st.ik, meta, d.topk, st.sel, t_idx, buckets=space)
                    blocks(st.q, st.k, st.v, st.sel, meta, st.out, st.scale, plan, b)

                st.out.fill_(float("nan"))
                splice()
                err = ((st.out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
                same = bool(torch.equal(st.sel, ref_sel))
                rows.append(Row("sparse splice", label, timer(splice), timer.graph(splice), 5 if not fused else 4,
                                f"relerr {err:.1e}, selections {'equal' if same else 'DIFFER'}"))
        for bt in (bt_att, bt_att // 2, bt_att * 2):
            if bt < 2 or (bt != bt_att and over_budget()):
                continue
            tt = tiles(bt)
            label = f"tiled bt={bt}" + (" (default)" if bt == bt_att else "")
            att_row(label, lambda tt=tt, sel=sel: sparse.sparse_attention_prefill_tiled(
                st.q, st.k, st.v, sel, meta, st.out, st.scale, tt), 2)  # the splits, then their merge
            if bt == bt_att:
                att_row(f"tiled bt={bt} nsplit=1", lambda tt=tt, sel=sel: sparse.sparse_attention_prefill_tiled(
                    st.q, st.k, st.v, sel, meta, st.out, st.scale, tt, 1), 1)
    info = {"tokens": st.T, "decodes": a.decodes, "decode_ctx": a.decode_ctx, "chunk": a.chunk,
            "chunk_start": a.chunk_start, "plan_host_us": plan_us, "tiles_indexer": len(t_idx.rows),
            "tiles_attention": len(tiles(bt_att).rows), "block_t_indexer": bt_idx, "block_t_attention": bt_att}
    return rows, info


def default_ops(st: Step, d: Dims, device: str) -> dict[str, Callable[[], None]]:
    """The step's default sparse ops: the tiled indexer (which also fills ``st.sel``),
    block-major attention on its selection and on ``shared8``, and the whole splice as the
    Triton backend runs it (the indexer's merge bucketing the pairs)."""
    from attention.kernels import indexer, sparse_blocks
    from attention.kernels.tiles import TilePlanner

    bt = indexer.tile_block_t(d.num_kv_heads)
    t_idx = TilePlanner(st.builder.max_tokens, device).plan(st.meta.qo_indptr_host, bt)
    planner = sparse_blocks.BlockPlanner(st.builder.max_seqs, st.cache.block_tables.numel(), device)
    plan = planner.plan(st.meta)

    def index() -> None:
        indexer.index_topk_prefill_tiled(st.iq, st.ik, st.meta, d.topk, st.sel, t_idx)

    index()
    shared = st.shared_selection(8, d.block)

    def attention(sel: torch.Tensor) -> Callable[[], None]:
        return lambda: sparse_blocks.sparse_attention_prefill_blocks(st.q, st.k, st.v, sel, st.meta, st.out,
                                                                      st.scale, plan)

    def splice() -> None:
        space = sparse_blocks.bucket_space(st.q, d.num_kv_heads, d.topk, plan)
        b = indexer.index_topk_prefill_tiled(st.iq, st.ik, st.meta, d.topk, st.sel, t_idx, buckets=space)
        sparse_blocks.sparse_attention_prefill_blocks(st.q, st.k, st.v, st.sel, st.meta, st.out, st.scale, plan, b)

    return {"indexer": index, "block-major indexer": attention(st.sel.clone()),
            "block-major shared8": attention(shared), "splice (indexer buckets)": splice}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench_prefill_tiles.json", help="JSON output path")
    ap.add_argument("--decodes", type=int, default=30)
    ap.add_argument("--decode-ctx", type=int, default=3000)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--chunk-start", type=int, default=2000)
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--indexer-only", action="store_true", help="skip the attention rows")
    ap.add_argument("--budget-s", type=float, default=25.0, help="skip the remaining sweeps after this long")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, host timing: checks the script runs")
    ap.add_argument("--kernels", action="store_true",
                    help="also the GPU time per kernel of the default indexer and block-major attention (profiler)")
    ap.add_argument("--ncu", action="store_true",
                    help="only run the default ops three times each, no timing (for a run under Nsight Compute)")
    a = ap.parse_args(argv)
    if a.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        dims, device = SMOKE_DIMS, ("cuda" if torch.cuda.is_available() else "cpu")
        a.decodes, a.decode_ctx, a.chunk, a.chunk_start = 3, 70, 20, 30
    else:
        if not torch.cuda.is_available():
            print("bench_prefill_tiles: needs a CUDA GPU (use --smoke to check the script on CPU)", file=sys.stderr)
            return 2
        dims, device = Dims(), "cuda"
    torch.manual_seed(0)
    t0 = time.time()
    if a.ncu:
        st = Step(dims, a.decodes, a.decode_ctx, a.chunk, a.chunk_start, device)
        for fn in default_ops(st, dims, device).values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        return 0
    rows, info = run(a, dims, device)
    if a.kernels and torch.cuda.is_available():
        st = Step(dims, a.decodes, a.decode_ctx, a.chunk, a.chunk_start, device)
        info["kernels_us"] = kernel_times(default_ops(st, dims, device))
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"
    header = (f"{gpu} | torch {torch.__version__} | triton {triton.__version__} | dims {asdict(dims)} | "
              f"{info['decodes']} decodes at ctx {info['decode_ctx']} + a {info['chunk']}-token chunk at "
              f"{info['chunk_start']} ({info['tokens']} tokens) | plan {info['plan_host_us']:.0f} us host | "
              f"{time.time() - t0:.0f} s")
    print(header)
    print(f"{'op':22s} {'variant':34s} {'us':>8s} {'graph us':>9s} {'launch':>6s} {'x untiled':>9s}  check")
    base: dict[str, float] = {}
    for r in rows:
        base.setdefault(r.op, r.time_us)
        g = f"{r.graph_us:9.1f}" if r.graph_us is not None else f"{'-':>9s}"
        print(f"{r.op:22s} {r.variant:34s} {r.time_us:8.1f} {g} {r.launches:6d} {base[r.op] / r.time_us:9.2f}  "
              f"{r.check}")
    with open(a.json, "w") as f:
        json.dump({"header": header, "info": info, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
