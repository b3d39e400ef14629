"""graphcap on a bare model: the toy transformer with its own cache and attention, driven by
a ``CaptureManager`` directly (no runner, no paged cache): the graphcap core tests, the toy
benchmark and the README's "graphcap on any model" example.

Per layer: RMSNorm -> fused QKV -> cache write (producer, slot -1 skipped) -> attention
(splice point, planned per step) -> o_proj -> RMSNorm -> GELU MLP. The KV cache is one
contiguous row of ``max_len`` slots per sequence; slot ``seq * max_len + pos``. The same model
on the paged cache and the generic runner is ``models.toy.model``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcap import CaptureSource, GraphKey, InputSpec, Padding, Purpose, StaticInputs, Step, splice

from .config import ToyConfig, ToyWeights


def toy_static_inputs(cfg: ToyConfig, device: torch.device | str) -> StaticInputs:
    return StaticInputs(
        [
            InputSpec("input_ids", torch.int64, 0),
            InputSpec("positions", torch.int64, 0),
            InputSpec("slot_mapping", torch.int64, -1),
        ],
        cfg.max_tokens,
        device,
    )


class ToyAttention:
    """Causal attention over each token's sequence row, planned once per step.

    ``plan`` writes per-token sequence ids and visible lengths into persistent device buffers
    (padded rows: length 0), so the splice reads only fixed-size device state and is
    graph-safe for decode.
    """

    def __init__(self, cfg: ToyConfig, device: torch.device | str) -> None:
        self.cfg = cfg
        self.seq_buf = torch.zeros(cfg.max_tokens, dtype=torch.int64, device=device)
        self.len_buf = torch.zeros(cfg.max_tokens, dtype=torch.int64, device=device)
        self.calls: list[tuple[int, int]] = []  # (layer, real tokens), when recording is on
        self.record = False

    def plan(self, token_seq: torch.Tensor, token_len: torch.Tensor, rows: int) -> None:
        """token_seq, token_len: int64 [n] host tensors; rows >= n (the padded bucket)."""
        if rows > self.cfg.max_tokens:
            raise ValueError(f"step of {rows} rows exceeds ToyAttention capacity {self.cfg.max_tokens}")
        n = token_seq.shape[0]
        self.seq_buf[:n].copy_(token_seq, non_blocking=True)
        self.len_buf[:n].copy_(token_len, non_blocking=True)
        self.seq_buf[n:rows].fill_(0)
        self.len_buf[n:rows].fill_(0)
        self.real_tokens = n

    @splice("toy.attention", graph_safe_decode=True)
    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor) -> None:
        """q, out: [T, H, Dh]; k_cache, v_cache: [max_seqs + 1, max_len, H, Dh] of this layer."""
        if self.record:
            self.calls.append((layer, self.real_tokens))
        t = q.shape[0]
        seq, length = self.seq_buf[:t], self.len_buf[:t]
        k, v = k_cache[seq], v_cache[seq]  # [T, L, H, Dh]
        scores = torch.einsum("thd,tlhd->thl", q.float(), k.float()) / q.shape[-1] ** 0.5
        visible = torch.arange(k.shape[1], device=q.device)[None, :] < length[:, None]  # [T, L]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing visible -> 0
        out.copy_(torch.einsum("thl,tlhd->thd", probs, v.float()).to(out.dtype))


class ToyTransformer(ToyWeights):
    """The toy with a contiguous cache row of ``max_len`` slots per sequence (plus a sink row)."""

    def __init__(self, cfg: ToyConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, device, dtype)
        shape = (cfg.num_layers, cfg.max_seqs + 1, cfg.max_len, cfg.num_heads, cfg.head_dim)  # +1: sink row
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.attention = ToyAttention(cfg, device)

    def cache_tensors(self) -> dict[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def _write_cache(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # Padded rows carry slot -1; they land in the sink row, which no sequence owns.
        sink = self.cfg.max_seqs * self.cfg.max_len
        idx = torch.where(slots >= 0, slots, torch.full_like(slots, sink))
        h, d = self.cfg.num_heads, self.cfg.head_dim
        self.k_cache[layer].view(-1, h, d).index_copy_(0, idx, k)
        self.v_cache[layer].view(-1, h, d).index_copy_(0, idx, v)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """inputs: input_ids, positions, slot_mapping [T] int64 -> logits [T, vocab]."""
        cfg = self.cfg
        x = self.embed(inputs["input_ids"])
        t = x.shape[0]
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            q, k, v = layer.qkv_proj(h).view(t, 3, cfg.num_heads, cfg.head_dim).unbind(1)
            self._write_cache(i, inputs["slot_mapping"], k, v)
            attn = torch.empty_like(q)
            self.attention(i, q, self.k_cache[i], self.v_cache[i], attn)
            x = x + layer.o_proj(attn.reshape(t, cfg.hidden))
            x = x + layer.down_proj(torch.nn.functional.gelu(layer.up_proj(layer.post_norm(x))))
        return self.lm_head(self.norm(x))


@dataclass
class ToyBatch:
    """Host-side description of a step: per-token sequence ids and positions."""

    token_seq: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]


def make_step(cfg: ToyConfig, chunks: list[tuple[int, int, int]], generator: torch.Generator | None = None) -> Step:
    """A step from ``(seq, start_pos, num_tokens)`` chunks with random token ids."""
    seqs, pos = [], []
    for seq, start, n in chunks:
        if not 0 <= seq < cfg.max_seqs or start + n > cfg.max_len:
            raise ValueError(f"chunk {(seq, start, n)} does not fit max_seqs={cfg.max_seqs}, max_len={cfg.max_len}")
        seqs += [seq] * n
        pos += list(range(start, start + n))
    token_seq = torch.tensor(seqs, dtype=torch.int64)
    positions = torch.tensor(pos, dtype=torch.int64)
    ids = torch.randint(0, cfg.vocab, (len(seqs),), generator=generator)
    return Step(
        num_tokens=len(seqs),
        num_seqs=len(chunks),
        inputs={"input_ids": ids, "positions": positions, "slot_mapping": token_seq * cfg.max_len + positions},
        uniform_decode=all(n == 1 for _, _, n in chunks),
        metadata=ToyBatch(token_seq, positions),
    )


class ToySource(CaptureSource):
    """The capture source of the bare toy: plans the attention once per step; dummy steps of
    ``key.rows`` tokens (one token per request for a decode graph; the toy's cache rows may
    repeat, its attention is planned per token). Validation and frozen-value checks run on
    random tokens of the same layout."""

    def __init__(self, model: ToyTransformer) -> None:
        self.model = model

    def plan(self, step: Step, padding: Padding) -> None:
        meta: ToyBatch = step.metadata
        self.model.attention.plan(meta.token_seq, meta.positions + 1, padding.rows)

    def dummy_step(self, key: GraphKey, purpose: Purpose) -> Step:
        cfg = self.model.cfg
        if key.decode:
            chunks = [(i % cfg.max_seqs, (i // cfg.max_seqs) % cfg.max_len, 1) for i in range(key.rows)]
        else:
            chunks, left = [], key.rows
            while left:
                n = min(left, cfg.max_len)
                chunks.append((len(chunks) % cfg.max_seqs, 0, n))
                left -= n
        return make_step(cfg, chunks, torch.Generator().manual_seed(key.rows * 3 + list(Purpose).index(purpose)))


__all__ = ["ToyAttention", "ToyBatch", "ToySource", "ToyTransformer", "make_step", "toy_static_inputs"]
