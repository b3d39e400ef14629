"""One forward step of MiniMax-M3: model + paged cache + metadata + attention backend.

No scheduling policy: the caller decides which requests and chunks form a step. A step is
split the way ``graphcap.manager.CaptureManager`` wants it:

- ``make_step(chunks)`` (host): reserve pages, build metadata, collect the per-token inputs;
  returns a ``graphcap.splice.Step``;
- ``plan(step, rows)`` (host, the manager's ``prepare`` hook): plan the attention backend for
  a step padded to ``rows``;
- ``forward(inputs)``: a pure function of the per-token input dict (``input_ids``,
  ``positions``, ``slot_mapping``, optionally ``num_real_tokens``) returning hidden states;
  this is what the manager captures;
- ``sample(step, hidden)``: lm_head on each request's last token and greedy argmax;
- ``dummy_step(bucket, uniform_decode)``: a throw-away step for warm-up and capture.

``step(chunks)`` runs the four eagerly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from attention.base import AttentionBackend, make_backend
from kvcache.paged import PagedKVCache
from attention.metadata import MetadataBuilder, RequestChunk
from graphcap.splice import Step

from .config import MiniMaxM3Config
from .model import MiniMaxM3ForCausalLM
from .weights import load_checkpoint


@dataclass(frozen=True)
class TokenChunk:
    """A request's tokens for one step: ``token_ids`` at positions ``start_pos ...``."""

    seq_id: Hashable
    start_pos: int
    token_ids: Sequence[int]


@dataclass(frozen=True)
class StepOutput:
    """Greedy next token per chunk (in step order) and the logits they came from:
    ``[num_chunks, vocab]`` for each chunk's last token, or ``[T, vocab]`` for every token
    when ``all_logits`` was asked for."""

    next_tokens: list[int]
    logits: torch.Tensor


class M3Runner:
    """Runs steps of a MiniMax-M3 model.

    Args:
        model: with weights; ``cache`` and ``backend`` are attached to it here.
        cache: the paged KV cache (built from ``config.kv_cache_config``).
        backend: attention backend on that cache.
        max_tokens, max_seqs: capacity of one step (metadata buffers).
    """

    def __init__(self, model: MiniMaxM3ForCausalLM, cache: PagedKVCache, backend: AttentionBackend,
                 max_tokens: int, max_seqs: int) -> None:
        model.attach(cache, backend)
        self.model, self.cache, self.backend = model, cache, backend
        self.device = cache.block_tables.device
        self.builder = MetadataBuilder(cache, max_tokens, max_seqs, self.device)
        self.max_tokens = max_tokens
        self._dummies: list[Hashable] = []

    def add_request(self, seq_id: Hashable) -> None:
        self.cache.add_sequence(seq_id)

    def free_request(self, seq_id: Hashable) -> None:
        self.cache.free(seq_id)

    def make_step(self, chunks: Sequence[TokenChunk]) -> Step:
        """Reserve pages and build this step's metadata and inputs.

        Raises:
            RuntimeError: the chunks need more free pages than the cache has; no page is
                reserved in that case.
            ValueError: too many chunks or tokens (nothing reserved), or see
                ``MetadataBuilder.build``.
        """
        cache, ps = self.cache, self.cache.page_size
        total = sum(len(ch.token_ids) for ch in chunks)
        if not chunks or total > self.builder.max_tokens or len(chunks) > self.builder.max_seqs:
            # checked before reserving, so a rejected step leaves the cache as it was
            raise ValueError(
                f"a step needs 1..{self.builder.max_seqs} chunks and at most {self.builder.max_tokens} tokens; "
                f"got {len(chunks)} chunks, {total} tokens"
            )
        need = 0
        for ch in chunks:
            end = ch.start_pos + len(ch.token_ids)
            need += max(0, -(-end // ps) - cache.num_reserved_tokens(ch.seq_id) // ps)
        if need > cache.num_free_pages:
            raise RuntimeError(
                f"step needs {need} new KV pages but {cache.num_free_pages} are free; run fewer chunks or free requests"
            )
        for ch in chunks:
            cache.reserve(ch.seq_id, ch.start_pos + len(ch.token_ids))
        meta = self.builder.build([RequestChunk(ch.seq_id, ch.start_pos, len(ch.token_ids)) for ch in chunks])
        ids = [t for ch in chunks for t in ch.token_ids]
        inputs = {
            "input_ids": torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True),
            "positions": meta.positions,
            "slot_mapping": meta.slot_mapping,
        }
        return Step(num_tokens=meta.num_tokens, inputs=inputs, uniform_decode=meta.uniform_decode, metadata=meta)

    def plan(self, step: Step, rows: int) -> None:
        """Plan the backend for ``step`` run as ``rows`` rows (its bucket, or its own size)."""
        meta = step.metadata
        self.backend.plan(meta if rows == meta.num_tokens else meta.pad_to(rows))

    def dummy_step(self, bucket: int, uniform_decode: bool) -> Step:
        """A step of ``bucket`` tokens over private sequences (freed by the next call or by
        ``release_dummies``): ``bucket`` one-token requests for uniform decode, else prefill
        chunks of token 0. Call it before real requests are admitted (capture time).

        Raises:
            ValueError: a uniform-decode bucket above ``max_seqs`` (no decode step can be
                that large: cap full-graph decode buckets at ``max_seqs``).
        """
        self.release_dummies()
        if uniform_decode and bucket > self.builder.max_seqs:
            raise ValueError(
                f"a uniform-decode step of {bucket} tokens needs {bucket} requests but max_seqs="
                f"{self.builder.max_seqs}; keep full-graph decode buckets <= max_seqs"
            )
        max_len = self.cache.config.max_seq_len
        sizes = [1] * bucket if uniform_decode else [min(max_len, bucket - i) for i in range(0, bucket, max_len)]
        chunks = []
        for i, n in enumerate(sizes):
            sid = ("__graphcap_dummy__", i)
            self.cache.add_sequence(sid)
            self._dummies.append(sid)
            chunks.append(TokenChunk(sid, 0, [0] * n))
        return self.make_step(chunks)

    @property
    def has_dummies(self) -> bool:
        """Whether sequences made by ``dummy_step`` are still in the cache."""
        return bool(self._dummies)

    def release_dummies(self) -> None:
        """Free the sequences ``dummy_step`` made."""
        for sid in self._dummies:
            self.cache.free(sid)
        self._dummies = []

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states ``[T, H]`` from the per-token inputs (the capturable function)."""
        return self.model.forward_inputs(inputs)

    def sample(self, step: Step, hidden: torch.Tensor, all_logits: bool = False) -> StepOutput:
        """lm_head on each chunk's last real token (or every token) and greedy argmax."""
        meta = step.metadata
        last = (meta.qo_indptr_host[1:].long() - 1).to(hidden.device)
        h = hidden[: meta.num_tokens] if all_logits else hidden.index_select(0, last)
        logits = self.model.compute_logits(h)
        rows = logits.index_select(0, last) if all_logits else logits
        return StepOutput(rows.argmax(-1).tolist(), logits)

    @torch.inference_mode()
    def step(self, chunks: Sequence[TokenChunk], all_logits: bool = False) -> StepOutput:
        """make_step -> plan -> forward -> sample, eagerly and unpadded."""
        s = self.make_step(chunks)
        self.plan(s, s.num_tokens)
        return self.sample(s, self.forward(dict(s.inputs)), all_logits)


def _build(model: MiniMaxM3ForCausalLM, device: torch.device | str, backend: str, max_tokens: int, max_seqs: int,
           max_seq_len: int, num_pages: int | None) -> M3Runner:
    c = model.config
    pages_per_seq = -(-max_seq_len // c.sparse_block_size)
    kv = c.kv_cache_config(num_pages=num_pages or pages_per_seq * max_seqs, max_seqs=max_seqs,
                           max_pages_per_seq=pages_per_seq, dtype=model.dtype, device=device)
    cache = PagedKVCache(kv)
    attn = make_backend(backend, cache, num_qo_heads=c.num_attention_heads, topk=c.sparse_topk_blocks,
                        max_tokens=max_tokens)
    return M3Runner(model, cache, attn, max_tokens, max_seqs)


def build_from_preset(name: str | MiniMaxM3Config, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                      *, seed: int = 0, backend: str = "torch", max_tokens: int = 512, max_seqs: int = 8,
                      max_seq_len: int = 4096, num_pages: int | None = None, moe_impl: str = "auto",
                      producer: str = "auto") -> M3Runner:
    """A runner over a preset (``tiny``, ``slice``, ``rank_of_8``, ``real``) or a config, with
    random weights (``init_random_(seed)``)."""
    config = name if isinstance(name, MiniMaxM3Config) else MiniMaxM3Config.preset(name)
    model = MiniMaxM3ForCausalLM(config, dtype=dtype, device=device, moe_impl=moe_impl, producer=producer)
    model.init_random_(seed)
    return _build(model, device, backend, max_tokens, max_seqs, max_seq_len, num_pages)


def build_from_checkpoint(folder: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                          *, num_layers: int | None = None, backend: str = "torch", max_tokens: int = 512,
                          max_seqs: int = 8, max_seq_len: int = 4096, num_pages: int | None = None,
                          moe_impl: str = "auto", producer: str = "auto") -> M3Runner:
    """A runner over a checkpoint folder; ``num_layers`` keeps only the first layers."""
    config = MiniMaxM3Config.from_hf(folder)
    truncate = num_layers is not None and num_layers != config.num_hidden_layers
    if truncate:
        config = config.first_layers(num_layers)  # type: ignore[arg-type]
    model = MiniMaxM3ForCausalLM(config, dtype=dtype, device=device, moe_impl=moe_impl, producer=producer)
    load_checkpoint(model, folder, truncate_layers=truncate)
    return _build(model, device, backend, max_tokens, max_seqs, max_seq_len, num_pages)
