"""Per-step attention metadata, built on the host into persistent device buffers.

A step is a flat batch of request chunks (decode requests and prefill chunks in any order).
``MetadataBuilder.build`` writes their indptr, lengths, block-table rows, positions and cache
slots into buffers allocated once at capacity, so every captured graph reads the same
addresses. Past the real entries each buffer holds pad values (kv_len 0, slot -1,
position 0, the cache's all ``-1`` pad row, qo_indptr flat at T), so a graph captured at
any bucket size reads consistent data.

Host cost is O(tokens in the step + requests in the step): a prefill chunk costs only its own
slots, never a walk over the prompt's page list.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, Iterator, Sequence

import torch

from kvcache.paged import PagedKVCache


@dataclass(frozen=True)
class RequestChunk:
    """One request's share of a step.

    Attributes:
        seq_id: the sequence in the cache.
        start_pos: positions already cached before this step (a decode request's context,
            a prefill chunk's offset into the prompt).
        num_tokens: query tokens this step (1 for a decode request).
    """

    seq_id: Hashable
    start_pos: int
    num_tokens: int


@dataclass(frozen=True)
class MetadataBuffers:
    """The persistent device buffers, at capacity (``max_seqs + 1`` rows: the last is a pad row)."""

    qo_indptr: torch.Tensor  # int32 [max_seqs + 2]
    kv_lens: torch.Tensor  # int32 [max_seqs + 1]
    seq_slots: torch.Tensor  # int32 [max_seqs + 1]
    token_seq: torch.Tensor  # int32 [max_tokens]
    positions: torch.Tensor  # int64 [max_tokens]
    slot_mapping: torch.Tensor  # int64 [max_tokens]

    def views(self, num_tokens: int, num_seqs: int) -> dict[str, torch.Tensor]:
        """The first ``num_tokens`` token rows and ``num_seqs`` request rows of every buffer."""
        return dict(
            qo_indptr=self.qo_indptr[: num_seqs + 1],
            kv_lens=self.kv_lens[:num_seqs],
            seq_slots=self.seq_slots[:num_seqs],
            token_seq=self.token_seq[:num_tokens],
            positions=self.positions[:num_tokens],
            slot_mapping=self.slot_mapping[:num_tokens],
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention metadata.

    Device tensors are views, from offset 0, of the builder's persistent buffers. By default
    they have the real lengths (B = num_seqs rows, T = num_tokens tokens); ``pad_to`` gives
    longer views whose extra entries hold pad values. ``num_tokens``/``num_seqs`` always
    count real entries.

    Attributes:
        num_tokens, num_seqs: real tokens T and requests B.
        uniform_decode: every request has exactly one query token.
        max_q_len, max_kv_len: over the real requests.
        qo_indptr: int32 [B+1], token offsets of each request.
        kv_lens: int32 [B], context length including this step (start_pos + num_tokens).
        seq_slots: int32 [B], block-table rows.
        token_seq: int32 [T], request row of each token (pad tokens: row ``pad_seq_row``).
        positions: int64 [T]; slot_mapping: int64 [T] (pad: -1).
        block_tables: the cache's ``int32 [max_seq_slots, max_pages_per_seq]``.
        page_size: the cache's page (= sparse block) size.
        qo_indptr_host, kv_lens_host, seq_slots_host: CPU int32 copies of the real entries.
        buffers: the full persistent buffers (for kernels that launch at capacity).
        pad_seq_row: the request row pad tokens point at (always a pad row).
    """

    num_tokens: int
    num_seqs: int
    uniform_decode: bool
    max_q_len: int
    max_kv_len: int
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    seq_slots: torch.Tensor
    token_seq: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    page_size: int
    qo_indptr_host: torch.Tensor
    kv_lens_host: torch.Tensor
    seq_slots_host: torch.Tensor
    buffers: MetadataBuffers
    pad_seq_row: int

    def requests(self) -> Iterator[tuple[int, int, int, int]]:
        """The real requests on the host: ``(first token, end token, kv_len, block-table row)``
        each, in batch order (for reference maths and planners)."""
        return zip(self.qo_indptr_host[:-1].tolist(), self.qo_indptr_host[1:].tolist(),
                   self.kv_lens_host.tolist(), self.seq_slots_host.tolist())

    def pad_to(self, num_tokens: int, num_seqs: int | None = None) -> "AttentionMetadata":
        """Views with ``num_tokens`` token rows and ``num_seqs`` request rows (default: the
        bucket for uniform decode, else the real count); the extra rows hold pad values."""
        b = self.buffers
        if num_seqs is None:
            num_seqs = num_tokens if self.uniform_decode else self.num_seqs
        if not self.num_tokens <= num_tokens <= b.positions.shape[0]:
            raise ValueError(f"pad_to({num_tokens}) must lie in [{self.num_tokens}, {b.positions.shape[0]}]")
        if not self.num_seqs <= num_seqs <= b.kv_lens.shape[0]:
            raise ValueError(f"pad_to num_seqs={num_seqs} must lie in [{self.num_seqs}, {b.kv_lens.shape[0]}]")
        return replace(self, **b.views(num_tokens, num_seqs))


class MetadataBuilder:
    """Builds ``AttentionMetadata`` for a cache into buffers allocated once.

    Args:
        cache: the paged cache whose block tables and slots the metadata refers to.
        max_tokens: token capacity of one step.
        max_seqs: request capacity of one step.
        device: where the buffers live (normally the cache's device).
    """

    def __init__(self, cache: PagedKVCache, max_tokens: int, max_seqs: int, device: torch.device | str | None = None) -> None:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"MetadataBuilder.max_tokens must be a positive int, got {max_tokens!r}")
        if not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"MetadataBuilder.max_seqs must be a positive int, got {max_seqs!r}")
        self.cache = cache
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.device = torch.device(device) if device is not None else cache.block_tables.device
        self.pad_seq_row = max_seqs  # one request row beyond capacity is always padding
        pin = self.device.type == "cuda"
        s, t = max_seqs + 1, max_tokens

        def host(n: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
            return torch.full((n,), fill, dtype=dtype, pin_memory=pin)

        # Host staging (pinned on CUDA) mirrors the device buffers entry for entry. Two sets,
        # used alternately, so a non-blocking copy still reading one set is never overwritten
        # by the next build.
        pads = dict(qo_indptr=0, kv_lens=0, seq_slots=cache.pad_seq_slot, token_seq=self.pad_seq_row,
                    positions=0, slot_mapping=-1)
        sizes = dict(qo_indptr=s + 1, kv_lens=s, seq_slots=s, token_seq=t, positions=t, slot_mapping=t)
        dtypes = dict(qo_indptr=torch.int32, kv_lens=torch.int32, seq_slots=torch.int32, token_seq=torch.int32,
                      positions=torch.int64, slot_mapping=torch.int64)
        self._pads = pads
        self._staging = [{k: host(sizes[k], dtypes[k], pads[k]) for k in sizes} for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._which = 0
        self.buffers = MetadataBuffers(**{k: self._staging[0][k].to(self.device, copy=True) for k in sizes})
        # High-water marks (tokens, requests) of the last build per staging set and on device.
        self._hw = [(0, 0), (0, 0)]
        self._hw_dev = (0, 0)

    def build(self, chunks: Sequence[RequestChunk]) -> AttentionMetadata:
        """Metadata for ``chunks`` flattened in the given order.

        Raises:
            ValueError: empty batch, more tokens than ``max_tokens`` or requests than
                ``max_seqs``, a chunk with ``num_tokens < 1`` or ``start_pos < 0``, a sequence
                twice in one batch, an unknown sequence, or a chunk beyond its reserved pages.
        """
        nb = len(chunks)
        if nb == 0:
            raise ValueError("build needs at least one RequestChunk")
        if nb > self.max_seqs:
            raise ValueError(f"batch has {nb} requests but max_seqs={self.max_seqs}; split the step or raise max_seqs")
        total = 0
        for ch in chunks:
            if ch.num_tokens < 1 or ch.start_pos < 0:
                raise ValueError(f"{ch} needs num_tokens >= 1 and start_pos >= 0")
            total += ch.num_tokens
        if total > self.max_tokens:
            raise ValueError(f"batch has {total} tokens but max_tokens={self.max_tokens}; split the step or raise max_tokens")
        if len({ch.seq_id for ch in chunks}) != nb:
            raise ValueError("a sequence appears twice in one batch; merge its chunks")

        cache = self.cache
        indptr = [0]
        kv_lens: list[int] = []
        rows: list[int] = []
        token_seq: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for i, ch in enumerate(chunks):
            end = ch.start_pos + ch.num_tokens
            slots.extend(cache.slots(ch.seq_id, ch.start_pos, ch.num_tokens))  # raises past reserved pages
            rows.append(cache.seq_slot(ch.seq_id))
            indptr.append(indptr[-1] + ch.num_tokens)
            kv_lens.append(end)
            token_seq.extend([i] * ch.num_tokens)
            positions.extend(range(ch.start_pos, end))

        w = self._which
        self._which ^= 1
        ev = self._events[w]
        if ev is not None:
            ev.synchronize()  # the copy that last read this staging set has finished
        st = self._staging[w]
        # Invariant per buffer (staging set and device): entries past the high-water mark of
        # the last build that wrote it hold pad values. So only [0, max(old mark, new size))
        # needs rewriting, and a build costs O(this step), not O(capacity).
        hw_t, hw_s = self._hw[w]
        dev_t, dev_s = max(self._hw_dev[0], total), max(self._hw_dev[1], nb)
        # qo_indptr pads equal T, which changes every step: rewrite it whole (O(max_seqs)).
        _put(st["qo_indptr"], indptr, total, st["qo_indptr"].shape[0])
        _put(st["kv_lens"], kv_lens, self._pads["kv_lens"], max(hw_s, nb))
        _put(st["seq_slots"], rows, self._pads["seq_slots"], max(hw_s, nb))
        _put(st["token_seq"], token_seq, self._pads["token_seq"], max(hw_t, total))
        _put(st["positions"], positions, 0, max(hw_t, total))
        _put(st["slot_mapping"], slots, -1, max(hw_t, total))
        self._hw[w] = (total, nb)
        self._hw_dev = (total, nb)
        nonblock = self.device.type == "cuda"
        buf = self.buffers
        lengths = dict(qo_indptr=st["qo_indptr"].shape[0], kv_lens=dev_s, seq_slots=dev_s, token_seq=dev_t,
                       positions=dev_t, slot_mapping=dev_t)
        for name, n in lengths.items():
            getattr(buf, name)[:n].copy_(st[name][:n], non_blocking=nonblock)
        if nonblock:
            ev = torch.cuda.Event()
            ev.record()
            self._events[w] = ev

        q_lens = [ch.num_tokens for ch in chunks]
        return AttentionMetadata(
            num_tokens=total,
            num_seqs=nb,
            uniform_decode=all(q == 1 for q in q_lens),
            max_q_len=max(q_lens),
            max_kv_len=max(kv_lens),
            **buf.views(total, nb),
            block_tables=cache.block_tables,
            page_size=cache.page_size,
            qo_indptr_host=torch.tensor(indptr, dtype=torch.int32),
            kv_lens_host=torch.tensor(kv_lens, dtype=torch.int32),
            seq_slots_host=torch.tensor(rows, dtype=torch.int32),
            buffers=buf,
            pad_seq_row=self.pad_seq_row,
        )


def _put(dst: torch.Tensor, values: list[int], pad: int, upto: int) -> None:
    """``dst[:len(values)] = values``; ``dst[len(values):upto] = pad`` (host tensors)."""
    n = len(values)
    dst[:n] = torch.tensor(values, dtype=dst.dtype)
    upto = min(upto, dst.shape[0])
    if upto > n:
        dst[n:upto] = pad
