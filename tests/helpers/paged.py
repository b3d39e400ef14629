"""Shared attention test scaffolding: a paged cache with scattered pages and random contents
(stale slots too), one step's metadata over it, queries, and a planned step context.

Used by the reference, Triton and flashinfer attention tests.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from attention.metadata import AttentionMetadata, MetadataBuilder
from attention.reference.dense import paged_gather
from graphcap import Padding, Step, step_context
from kvcache.paged import KVCacheConfig, PagedKVCache
from steps import TokenChunk

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def chunks_for(specs: Sequence[tuple[int, int]]) -> list[TokenChunk]:
    """One chunk per ``(context length incl. this step, query tokens)``: the tail positions of
    sequence ``i`` (token ids 0: attention tests never read them)."""
    return [TokenChunk(i, length - n, [0] * n) for i, (length, n) in enumerate(specs)]


class PagedScenario:
    """Sequences ``0..len(specs)-1`` in a paged cache whose pages are interleaved across
    sequences, every cache slot random, and one step over the specs' query tokens.

    Args:
        specs: ``[(context length incl. this step, query tokens this step)]``.
        hq, hkv, d, di, bs: q heads, kv heads, head dim, index dim, page (= block) size.
        layers: cache layers; ``sparse_layers`` of them hold index-K (default: the last).
        spare_pages: pages beyond what the sequences need (free pages hold stale data too).
        max_tokens: metadata capacity (default: the step's tokens + 3).
    """

    def __init__(self, specs, *, hq: int, hkv: int, d: int, di: int | None = None, bs: int, seed: int,
                 dtype: torch.dtype = torch.bfloat16, device: str = DEV, layers: int = 2,
                 sparse_layers: tuple[int, ...] | None = None, spare_pages: int = 2, max_tokens: int | None = None,
                 max_pages_per_seq: int | None = None) -> None:
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.specs, self.dtype, self.device = specs, dtype, device
        self.hq, self.hkv, self.d, self.bs = hq, hkv, d, bs
        self.scale = d ** -0.5
        npages = [-(-length // bs) for length, _ in specs]
        sparse_layers = (layers - 1,) if sparse_layers is None else sparse_layers
        self.cache = c = PagedKVCache(KVCacheConfig(
            num_layers=layers, sparse_layers=sparse_layers, num_kv_heads=hkv, head_dim=d, index_dim=di or d,
            page_size=bs, num_pages=sum(npages) + spare_pages, max_seqs=len(specs),
            max_pages_per_seq=max_pages_per_seq or max(npages) + spare_pages, dtype=dtype, index_dtype=dtype,
            device=device))
        for i in range(len(specs)):
            c.add_sequence(i)
        for n in range(1, max(npages) + 1):  # round-robin growth interleaves the sequences' pages
            for i, (length, _) in enumerate(specs):
                c.reserve(i, min(length, n * bs))
        self.refill()
        self.builder = MetadataBuilder(c, max_tokens=max_tokens or sum(n for _, n in specs) + 3, max_seqs=len(specs))
        self.plan(chunks_for(specs))
        rows = self.builder.max_tokens
        self.q, self.iq = self.randn(rows, hq, d), self.randn(rows, hkv, di or d)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, device=self.device).to(self.dtype)

    def refill(self) -> None:
        """New random contents for every cache slot."""
        for t in (self.cache.k_cache, self.cache.v_cache, self.cache.index_k_cache):
            t.copy_(torch.randn(t.shape, generator=self.g, device=self.device))

    def plan(self, chunks: Sequence[TokenChunk]) -> AttentionMetadata:
        """Metadata for ``chunks`` (positions already hold data: no continuity check here)."""
        self.meta = self.builder.build(chunks)
        self.T = self.meta.num_tokens
        self.chunks = list(chunks)
        self.tok = [(ch.seq_id, ch.start_pos + j) for ch in chunks for j in range(ch.num_tokens)]  # (seq, pos)
        return self.meta

    def sequence(self, cache_l: torch.Tensor, seq: int, length: int | None = None) -> torch.Tensor:
        """One sequence's first ``length`` positions of a cache layer, contiguous, fp64."""
        length = length or self.specs[seq][0]
        return paged_gather(cache_l, self.cache.block_tables, self.cache.table_row(seq), length).double()

    def poisoned_out(self, rows: int | None = None) -> torch.Tensor:
        return torch.full((rows or self.q.shape[0], self.hq, self.d), float("nan"), dtype=self.dtype,
                          device=self.device)

    def step(self, uniform_decode: bool | None = None) -> Step:
        """The step object of the planned metadata (``uniform_decode``: every chunk one token)."""
        if uniform_decode is None:
            uniform_decode = all(ch.num_tokens == 1 for ch in self.chunks)
        return Step(self.T, self.meta.num_seqs, {}, uniform_decode, self.meta)


@contextlib.contextmanager
def planned(backend, step: Step, padding: Padding | None = None) -> Iterator[Step]:
    """Inside a step context: ``backend.plan(step, padding)`` done, ops may run."""
    padding = padding or Padding.unpadded(step.num_tokens, step.num_seqs)
    with step_context(step, padding):
        backend.plan(step, padding)
        yield step
