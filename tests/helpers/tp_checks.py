"""Per-rank bodies of the tensor-parallel tests (run by ``helpers.ranks.run_ranks``).

Each returns plain numbers and flags; the test asserts on them in the parent process, so a
failure names the rank and the figure."""

from __future__ import annotations

import torch

from distributed import ParallelGroup, vocab_parallel
from graphcap import CaptureConfig, GraphKey
from models.minimax_m3 import build_from_checkpoint
from models.runner import ModelRunner
from steps import TokenChunk

RUNNER = dict(backend="torch", max_tokens=48, max_seqs=4, max_seq_len=64)


def collectives(group: ParallelGroup) -> dict:
    """all_reduce_ with NaN in padded rows, all_gather_last order, the masked vocab lookup."""
    r, w = group.rank, group.world_size
    x = torch.full((5, 3), float(r + 1))
    x[3:] = float("nan")  # padding may hold anything
    group.all_reduce_(x, group.padded_rows(5, torch.tensor([3]), x.device))
    want = float(sum(range(1, w + 1)))
    parts = group.all_gather_last(torch.full((2, 4), float(r)))
    full = torch.randn(8 * w, 6, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(8 * w).flip(0)
    emb = vocab_parallel.embed(full[r * 8:(r + 1) * 8], ids, group)
    return dict(real_rows_summed=bool((x[:3] == want).all()), padded_rows_zero=bool((x[3:] == 0).all()),
                gathered_in_rank_order=parts[0].tolist() == [float(i) for i in range(w) for _ in range(4)],
                embed_equals_full=bool(torch.equal(emb, full[ids])))


def loader_slices(group: ParallelGroup, ckpt: str) -> dict:
    """Each rank's parameters against slices of the unsharded model, computed here by hand."""
    full = build_from_checkpoint(ckpt, **RUNNER).model
    mine = build_from_checkpoint(ckpt, **RUNNER, group=group).model
    fc, c = full.config, mine.config
    r, w = group.rank, group.world_size
    fp, p = dict(full.named_parameters()), dict(mine.named_parameters())
    checks = {}
    D, Di = fc.head_dim, fc.sparse_index_dim
    ql, kvl = fc.q_size // w, c.kv_size
    kv_head = r * fc.num_key_value_heads // w  # first kv head of this rank (shared above TP = kv heads)
    for i in (0, 1):  # a dense-attention and a sparse layer
        a = f"model.layers.{i}.self_attn."
        q, qf = p[a + "qkv_proj.weight"], fp[a + "qkv_proj.weight"]
        checks[f"L{i} q rows"] = torch.equal(q[:ql], qf[r * ql:(r + 1) * ql])
        k0, v0 = fc.q_size + kv_head * D, fc.q_size + fc.kv_size + kv_head * D
        checks[f"L{i} k rows"] = torch.equal(q[ql:ql + kvl], qf[k0:k0 + kvl])
        checks[f"L{i} v rows"] = torch.equal(q[ql + kvl:ql + 2 * kvl], qf[v0:v0 + kvl])
        if fc.is_sparse(i):
            iq0 = fc.q_size + 2 * fc.kv_size + kv_head * Di
            off = ql + 2 * kvl
            checks[f"L{i} index-q rows"] = torch.equal(q[off:off + c.index_q_size], qf[iq0:iq0 + c.index_q_size])
            checks[f"L{i} index-k rows (replicated)"] = torch.equal(q[-Di:], qf[-Di:])
        cols = slice(r * ql, (r + 1) * ql)
        checks[f"L{i} o_proj columns"] = torch.equal(p[a + "o_proj.weight"], fp[a + "o_proj.weight"][:, cols])
        checks[f"L{i} q_norm (replicated)"] = torch.equal(p[a + "q_norm.weight"], fp[a + "q_norm.weight"])
    mlp = "model.layers.0.mlp."
    il = fc.dense_intermediate_size // w
    gu, guf = p[mlp + "gate_up_proj.weight"], fp[mlp + "gate_up_proj.weight"]
    inter, part = fc.dense_intermediate_size, slice(r * il, (r + 1) * il)
    checks["dense gate rows"] = torch.equal(gu[:il], guf[part])
    checks["dense up rows"] = torch.equal(gu[il:], guf[inter + r * il:inter + (r + 1) * il])
    checks["dense down columns"] = torch.equal(p[mlp + "down_proj.weight"], fp[mlp + "down_proj.weight"][:, part])
    m = "model.layers.1.block_sparse_moe."
    el = fc.num_local_experts // w
    checks["experts held"] = torch.equal(p[m + "experts.w13"], fp[m + "experts.w13"][r * el:(r + 1) * el]) and \
        torch.equal(p[m + "experts.w2"], fp[m + "experts.w2"][r * el:(r + 1) * el])
    checks["router (replicated)"] = torch.equal(p[m + "gate.weight"], fp[m + "gate.weight"])
    sl = fc.shared_width // w
    checks["shared gate rows"] = torch.equal(p[m + "shared_experts.gate_up_proj.weight"][:sl],
                                             fp[m + "shared_experts.gate_up_proj.weight"][r * sl:(r + 1) * sl])
    vl = fc.vocab_size // w
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        checks[name + " vocab rows"] = torch.equal(p[name], fp[name][r * vl:(r + 1) * vl])
    from models.minimax_m3.weights import load_checkpoint

    rep_full, rep_mine = load_checkpoint(full, ckpt), load_checkpoint(mine, ckpt)
    held = sum(t.numel() * t.element_size() for t in mine.parameters())
    return dict(checks=checks, bytes_full=rep_full.bytes_read, bytes_rank=rep_mine.bytes_read, bytes_held=held,
                expert_offset=mine.model.layers[1].block_sparse_moe.expert_offset, experts_per_rank=el)


def _steps(vocab: int) -> list[list[TokenChunk]]:
    """Prefill (two requests, one past the sparse layers' dense range), a mixed step (decode +
    a new prompt's chunk), a uniform decode of three."""
    g = torch.Generator().manual_seed(7)

    def toks(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [[TokenChunk("a", 0, toks(21)), TokenChunk("b", 0, toks(6))],
            [TokenChunk("a", 21, toks(1)), TokenChunk("c", 0, toks(9))],
            [TokenChunk("a", 22, toks(1)), TokenChunk("b", 6, toks(1)), TokenChunk("c", 9, toks(1))]]


def _serve(runner: ModelRunner, steps: list[list[TokenChunk]]) -> list[torch.Tensor]:
    for sid in ("a", "b", "c"):
        runner.add_request(sid)
    return [runner.step(chunks, all_logits=True).logits for chunks in steps]


def sharded_logits(group: ParallelGroup, ckpt: str) -> dict:
    """Logits of every token, sharded vs unsharded fp32, eager and through the padded
    (debug-eager bucket) path, for prefill, mixed and decode steps."""
    out = {}
    padded = CaptureConfig(enabled=True, debug_eager=True, max_tokens=48, buckets=(4, 16, 48))
    for name, capture in (("eager", None), ("padded", padded)):
        ref = build_from_checkpoint(ckpt, **RUNNER, capture=capture)
        tp = build_from_checkpoint(ckpt, **RUNNER, capture=capture, group=group)
        steps = _steps(tp.vocab_size)
        want, got = _serve(ref, steps), _serve(tp, steps)
        for i, (x, y) in enumerate(zip(want, got)):
            out[f"{name} step {i}"] = dict(rel_err=float((x - y).abs().max() / x.abs().max()), shape=list(y.shape),
                                           same_argmax=bool(torch.equal(x.argmax(-1), y.argmax(-1))))
        stats = tp.manager.stats
        out[f"{name} padded rows"] = sum(b.padded_tokens for b in stats.buckets.values())
        tp.destroy()
    return out


def serving(group: ParallelGroup, ckpt: str) -> dict:
    """The engine on every rank (SPMD): the same requests, the same tokens as one process."""
    from engine import Engine, EngineConfig, SchedulerConfig, make_requests, serve

    capture = CaptureConfig(enabled=True, debug_eager=True, max_tokens=24)
    outs = {}
    for name, g in (("single", None), ("sharded", group)):
        runner = build_from_checkpoint(ckpt, **{**RUNNER, "max_tokens": 24}, capture=capture, group=g)
        eng = Engine(runner, EngineConfig(SchedulerConfig(token_budget=20, chunk_size=12)))
        requests = make_requests(6, (3, 30), (2, 8), runner.vocab_size, seed=4)
        serve(eng, requests, concurrency=3)
        outs[name] = {r.request_id: eng.states[r.request_id].output for r in requests}
        runner.destroy()
    return dict(same_tokens=outs["single"] == outs["sharded"], tokens=sum(len(v) for v in outs["sharded"].values()))


def agreement(group: ParallelGroup, ckpt: str) -> dict:
    """Dropped graphs are the union over ranks; differing bucket lists raise on every rank."""
    runner = build_from_checkpoint(ckpt, **RUNNER, group=group,
                                   capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=48))
    peers = runner.manager.peers
    mine = {GraphKey(16, False): "graph and eager differ"} if group.rank == 0 else {}
    union = peers.union(mine)
    ok_all = peers.all_ok(group.rank != 0)
    # Rank 0 asks for other buckets: capture must refuse on every rank, not hang.
    buckets = (4, 48) if group.rank == 0 else (4, 16, 48)
    odd = build_from_checkpoint(ckpt, **RUNNER, group=group,
                                capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=48, buckets=buckets))
    try:
        odd.capture()
        refused = ""
    except ValueError as e:
        refused = str(e)
    runner.destroy()
    odd.destroy()
    return dict(union=union, all_ok=ok_all, refused=refused)


# ---- GPU (NCCL) ---------------------------------------------------------------------------

def _rewound(runner: ModelRunner, chunks: list[TokenChunk]) -> torch.Tensor:
    """All-token logits of ``chunks``, then the requests rewound (the step can run again on any
    runner over the same cache)."""
    out = runner.step(chunks, all_logits=True).logits.float()
    for ch in chunks:
        runner.rewind_request(ch.seq_id, ch.start_pos)
    return out


def nccl_captured(group: ParallelGroup, ckpt: str | None = None) -> dict:
    """Capture with the all-reduces inside the segments, validate (replay vs eager) and look
    for frozen values; then replayed logits against the same path run eagerly (debug-eager,
    the same kernels) and against the unsharded model. ``ckpt``: load it (sharded per rank),
    else the tiny preset's random weights (world size 1: identical to the unsharded model's)."""
    from models.minimax_m3 import build_from_preset

    kw = dict(device=group.device, dtype=torch.bfloat16, backend="triton", max_tokens=32, max_seqs=4, max_seq_len=64)
    buckets = dict(max_tokens=32, buckets=(4, 16, 32))

    def build(g: ParallelGroup | None, capture: CaptureConfig | None) -> ModelRunner:
        if ckpt is None:
            return build_from_preset("tiny", **kw, capture=capture, group=g)
        return build_from_checkpoint(ckpt, **kw, capture=capture, group=g)

    tp = build(group, CaptureConfig(enabled=True, detect_frozen=True, **buckets))
    padded = tp.with_capture(CaptureConfig(enabled=True, debug_eager=True, **buckets))
    single = build(None, None)
    # Count the all-reduces issued while a graph is being captured. (At world size 1 NCCL runs
    # an in-place all-reduce as no kernel at all, so the graph's nodes cannot show it.)
    issued = {"captured": 0}
    all_reduce = torch.distributed.all_reduce

    def counting(*args, **kwargs):
        issued["captured"] += torch.cuda.is_current_stream_capturing()
        return all_reduce(*args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        tp.capture()
    finally:
        torch.distributed.all_reduce = all_reduce
    failures = tp.validate()
    names = [n.name for key in tp.manager.keys() if (g := tp.manager.graph(key)) is not None
             for seg in g.segment_nodes() for n in seg if n.kind == "kernel"]
    steps = _steps(tp.vocab_size)
    for sid in ("a", "b", "c"):
        tp.add_request(sid)
        single.add_request(sid)
    out = {}
    for i, chunks in enumerate(steps):
        g, e = _rewound(tp, chunks), _rewound(padded, chunks)
        tp.step(chunks)  # advance
        s = single.step(chunks, all_logits=True).logits.float()
        out[f"step {i}"] = dict(vs_padded_eager=float((g - e).abs().max() / e.abs().max()),
                                vs_unsharded=float((g - s).abs().max() / s.abs().max()))
    hits = sum(b.hits for b in tp.manager.stats.buckets.values())
    graphs = sum(1 for k in tp.manager.keys() if tp.manager.graph(k) is not None)
    for r in (tp, padded, single):
        r.destroy()
    return dict(steps=out, failures={str(k): v for k, v in failures.items()}, graphs=graphs, hits=hits,
                captured_all_reduces=issued["captured"], layers=tp.model.config.num_hidden_layers,
                nccl_kernels=sum("nccl" in n.lower() for n in names), kernels=len(names))


def nccl_serving_with_recapture(group: ParallelGroup, ckpt: str) -> dict:
    """The engine on every rank with graphs, a forced recapture mid-serving (collective)."""
    from engine import Engine, EngineConfig, SchedulerConfig, make_requests, serve

    capture = CaptureConfig(enabled=True, max_tokens=24)
    runner = build_from_checkpoint(ckpt, device=group.device, dtype=torch.bfloat16, backend="triton", max_tokens=24,
                                   max_seqs=4, max_seq_len=64, capture=capture, group=group)
    eng = Engine(runner, EngineConfig(SchedulerConfig(token_budget=20, chunk_size=12)))
    requests = make_requests(8, (3, 30), (4, 12), runner.vocab_size, seed=4)
    seen = {"steps": 0}

    def on_step(engine: Engine, ended) -> None:
        seen["steps"] += 1
        if seen["steps"] == 6:
            runner.manager.release()  # every rank at the same step: the next step recaptures
    serve(eng, requests, concurrency=3, on_step=on_step)
    tokens = {r.request_id: eng.states[r.request_id].output for r in requests}
    captures = runner.manager.stats.capture_s
    runner.destroy()
    return dict(tokens=tokens, steps=seen["steps"], captured=captures > 0)
