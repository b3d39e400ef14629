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

import warnings
from dataclasses import dataclass, fields
from typing import Iterator, Sequence

import torch

import steps
from attention.staging import PingPongStaging
from common.values import is_int
from kvcache.paged import PagedKVCache
from steps import TokenChunk as _Chunk


@dataclass(frozen=True)
class MetadataBuffers:
    """The persistent device buffers, at capacity (``max_seqs + 1`` rows: the last is a pad row)."""

    qo_indptr: torch.Tensor  # int32 [max_seqs + 2]
    kv_lens: torch.Tensor  # int32 [max_seqs + 1]
    table_rows: torch.Tensor  # int32 [max_seqs + 1]
    token_seq: torch.Tensor  # int32 [max_tokens]
    positions: torch.Tensor  # int64 [max_tokens]
    slot_mapping: torch.Tensor  # int64 [max_tokens]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer, by name (for invalidation checks)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def views(self, num_tokens: int, num_seqs: int) -> dict[str, torch.Tensor]:
        """The first ``num_tokens`` token rows and ``num_seqs`` request rows of every buffer."""
        return dict(
            qo_indptr=self.qo_indptr[: num_seqs + 1],
            kv_lens=self.kv_lens[:num_seqs],
            table_rows=self.table_rows[:num_seqs],
            token_seq=self.token_seq[:num_tokens],
            positions=self.positions[:num_tokens],
            slot_mapping=self.slot_mapping[:num_tokens],
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention metadata.

    Device tensors are views, from offset 0, of the builder's persistent buffers, with the
    real lengths (B = num_seqs rows, T = num_tokens tokens); past them every buffer holds pad
    values up to its capacity, so a view of more rows (``buffers``, sliced by the step's
    ``graphcap.Padding``) reads padding. Whether the step is a uniform decode is a fact of the
    ``graphcap.Step`` (``Step.uniform_decode``), not repeated here.

    Attributes:
        num_tokens, num_seqs: real tokens T and requests B.
        max_q_len, max_kv_len: over the real requests.
        qo_indptr: int32 [B+1], token offsets of each request.
        kv_lens: int32 [B], context length including this step (start_pos + num_tokens).
        table_rows: int32 [B], block-table rows.
        token_seq: int32 [T], request row of each token (pad tokens: row ``pad_seq_row``).
        positions: int64 [T]; slot_mapping: int64 [T] (pad: -1).
        block_tables: the cache's ``int32 [max_table_rows, max_pages_per_seq]``.
        page_size: the cache's page (= sparse block) size.
        qo_indptr_host, kv_lens_host, table_rows_host: CPU int32 copies of the real entries.
        buffers: the full persistent buffers (for kernels that launch at capacity).
        pad_seq_row: the request row pad tokens point at (always a pad row).
    """

    num_tokens: int
    num_seqs: int
    max_q_len: int
    max_kv_len: int
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    table_rows: torch.Tensor
    token_seq: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    page_size: int
    qo_indptr_host: torch.Tensor
    kv_lens_host: torch.Tensor
    table_rows_host: torch.Tensor
    buffers: MetadataBuffers
    pad_seq_row: int

    def requests(self) -> Iterator[tuple[int, int, int, int]]:
        """The real requests on the host: ``(first token, end token, kv_len, block-table row)``
        each, in batch order (for reference maths and planners)."""
        return zip(self.qo_indptr_host[:-1].tolist(), self.qo_indptr_host[1:].tolist(),
                   self.kv_lens_host.tolist(), self.table_rows_host.tolist())


class MetadataBuilder:
    """Builds ``AttentionMetadata`` for a cache into buffers allocated once.

    Args:
        cache: the paged cache whose block tables and slots the metadata refers to.
        max_tokens: token capacity of one step.
        max_seqs: request capacity of one step.
        device: where the buffers live (normally the cache's device).
    """

    def __init__(self, cache: PagedKVCache, max_tokens: int, max_seqs: int,
                 device: torch.device | str | None = None) -> None:
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"MetadataBuilder.max_tokens must be a positive int, got {max_tokens!r}")
        if not is_int(max_seqs) or max_seqs < 1:
            raise ValueError(f"MetadataBuilder.max_seqs must be a positive int, got {max_seqs!r}")
        self.cache = cache
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.device = torch.device(device) if device is not None else cache.block_tables.device
        self.pad_seq_row = max_seqs  # one request row beyond capacity is always padding
        s, t = max_seqs + 1, max_tokens
        # Host staging (pinned on CUDA) mirrors the device buffers entry for entry. Two sets,
        # used alternately, so a non-blocking copy still reading one set is never overwritten
        # by the next build.
        pads = dict(qo_indptr=0, kv_lens=0, table_rows=cache.pad_table_row, token_seq=self.pad_seq_row,
                    positions=0, slot_mapping=-1)
        sizes = dict(qo_indptr=s + 1, kv_lens=s, table_rows=s, token_seq=t, positions=t, slot_mapping=t)
        dtypes = dict(qo_indptr=torch.int32, kv_lens=torch.int32, table_rows=torch.int32, token_seq=torch.int32,
                      positions=torch.int64, slot_mapping=torch.int64)
        self._pads = pads
        self._staging = PingPongStaging(
            lambda pin: {k: torch.full((sizes[k],), pads[k], dtype=dtypes[k], pin_memory=pin) for k in sizes},
            self.device)
        self.buffers = MetadataBuffers(**{k: self._staging.sets[0][k].to(self.device, copy=True) for k in sizes})
        # High-water marks (tokens, requests) of the last build per staging set and on device.
        self._hw = [(0, 0), (0, 0)]
        self._hw_dev = (0, 0)

    def check(self, chunks: Sequence[_Chunk], vocab_size: int | None = None) -> None:
        """Every rule a step must meet, checked once, before anything is reserved or written.

        Raises:
            ValueError: naming the request and what to change: an empty step, more tokens than
                ``max_tokens`` or requests than ``max_seqs``, a request twice in one step, an
                unknown request, a chunk that does not continue its sequence (``start_pos`` not
                equal to the positions already written), a sequence longer than the cache
                allows, a token id outside ``[0, vocab_size)``.
            RuntimeError: the step needs more free KV pages than the cache has.
        """
        if isinstance(chunks, _Chunk):
            raise ValueError(f"a step is a list of TokenChunk, got one TokenChunk (request {chunks.seq_id!r}); "
                             f"pass [chunk]")
        if not chunks:
            raise ValueError("a step needs at least one TokenChunk")
        bad = [ch for ch in chunks if not isinstance(ch, _Chunk)]
        if bad:
            raise ValueError(f"a step is a sequence of TokenChunk, got {type(bad[0]).__name__}")
        if len(chunks) > self.max_seqs:
            raise ValueError(f"step has {len(chunks)} requests but max_seqs={self.max_seqs}; "
                             "split the step or raise max_seqs")
        total = sum(ch.num_tokens for ch in chunks)
        if total > self.max_tokens:
            raise ValueError(f"step has {total} tokens but max_tokens={self.max_tokens}; "
                             "split the step or raise max_tokens")
        cache, seen, needs = self.cache, set(), {}
        for ch in chunks:
            sid = ch.seq_id
            if sid in seen:
                raise ValueError(f"request {sid!r} appears twice in one step; merge its chunks")
            seen.add(sid)
            if not cache.has_sequence(sid):
                raise ValueError(f"request {sid!r} is unknown; add it first (runner.add_request({sid!r}))")
            written = cache.num_written(sid)
            if ch.start_pos != written:
                what = "skips past" if ch.start_pos > written else "rewrites"
                raise ValueError(
                    f"request {sid!r}: chunk at start_pos={ch.start_pos} {what} the {written} positions "
                    "written so far; "
                    f"a chunk must continue its sequence (start_pos={written})"
                    + ("" if ch.start_pos > written else ", or rewind it first (runner.rewind_request)"))
            if ch.end_pos > cache.config.max_seq_len:
                raise ValueError(f"request {sid!r} would hold {ch.end_pos} positions but a sequence holds at most "
                                 f"{cache.config.max_seq_len} (max_pages_per_seq * page_size); raise max_seq_len")
            if vocab_size is not None:
                out = [t for t in ch.token_ids if not 0 <= t < vocab_size]
                if out:
                    raise ValueError(f"request {sid!r}: token id {out[0]} is outside the vocabulary [0, {vocab_size})")
            new_pages = cache.pages_needed(sid, ch.end_pos)
            if new_pages:
                needs[sid] = new_pages
        if sum(needs.values()) > cache.num_free_pages:
            who = ", ".join(f"request {sid!r} {n}" for sid, n in needs.items())
            raise RuntimeError(f"step needs {sum(needs.values())} new KV pages ({who}) but {cache.num_free_pages} of "
                               f"{cache.num_pages} are free; run fewer chunks or free finished requests")

    def build(self, chunks: Sequence[_Chunk]) -> AttentionMetadata:
        """Metadata for ``chunks`` (checked by ``check``, pages reserved) flattened in order."""
        nb = len(chunks)
        total = sum(ch.num_tokens for ch in chunks)
        assert 0 < nb <= self.max_seqs and total <= self.max_tokens, "call check(chunks) before build"

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
            rows.append(cache.table_row(ch.seq_id))
            indptr.append(indptr[-1] + ch.num_tokens)
            kv_lens.append(end)
            token_seq.extend([i] * ch.num_tokens)
            positions.extend(range(ch.start_pos, end))

        buf = self.buffers
        with self._staging.next_set() as (w, st):
            # Invariant per buffer (staging set and device): entries past the high-water mark of
            # the last build that wrote it hold pad values. So only [0, max(old mark, new size))
            # needs rewriting, and a build costs O(this step), not O(capacity).
            hw_t, hw_s = self._hw[w]
            dev_t, dev_s = max(self._hw_dev[0], total), max(self._hw_dev[1], nb)
            # qo_indptr pads equal T, which changes every step: rewrite it whole (O(max_seqs)).
            _put(st["qo_indptr"], indptr, total, st["qo_indptr"].shape[0])
            _put(st["kv_lens"], kv_lens, self._pads["kv_lens"], max(hw_s, nb))
            _put(st["table_rows"], rows, self._pads["table_rows"], max(hw_s, nb))
            _put(st["token_seq"], token_seq, self._pads["token_seq"], max(hw_t, total))
            _put(st["positions"], positions, self._pads["positions"], max(hw_t, total))
            _put(st["slot_mapping"], slots, self._pads["slot_mapping"], max(hw_t, total))
            self._hw[w] = (total, nb)
            self._hw_dev = (total, nb)
            lengths = dict(qo_indptr=st["qo_indptr"].shape[0], kv_lens=dev_s, table_rows=dev_s, token_seq=dev_t,
                           positions=dev_t, slot_mapping=dev_t)
            for name, n in lengths.items():
                getattr(buf, name)[:n].copy_(st[name][:n], non_blocking=self._staging.non_blocking)

        return AttentionMetadata(
            num_tokens=total,
            num_seqs=nb,
            max_q_len=max(ch.num_tokens for ch in chunks),
            max_kv_len=max(kv_lens),
            **buf.views(total, nb),
            block_tables=cache.block_tables,
            page_size=cache.page_size,
            qo_indptr_host=torch.tensor(indptr, dtype=torch.int32),
            kv_lens_host=torch.tensor(kv_lens, dtype=torch.int32),
            table_rows_host=torch.tensor(rows, dtype=torch.int32),
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


def __getattr__(name: str) -> object:
    """``TokenChunk`` and ``TokenFeed`` moved to ``steps`` (the vocabulary the engine shares);
    the old import path works for one release, with a warning."""
    if name in ("TokenChunk", "TokenFeed"):
        warnings.warn(f"attention.metadata.{name} moved to steps.{name}; import it from steps", DeprecationWarning,
                      stacklevel=2)
        return getattr(steps, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
