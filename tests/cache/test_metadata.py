"""MetadataBuilder: mixed batches, pad values in the persistent buffers, O(chunk) cost, the one
step check (capacity, continuity, duplicates, ids), and TokenChunk's input hygiene."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attention.metadata import MetadataBuilder
from kvcache.paged import KVCacheConfig, PagedKVCache
from steps import TokenChunk


def C(seq, start, n):  # noqa: N802 - a chunk of n placeholder tokens
    return TokenChunk(seq, start, [0] * n)


def make_cache(num_pages=64, page_size=4, max_seqs=4, max_pages_per_seq=16) -> PagedKVCache:
    return PagedKVCache(KVCacheConfig(
        num_layers=1, sparse_layers=(0,), num_kv_heads=1, head_dim=4, index_dim=4, page_size=page_size,
        num_pages=num_pages, max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq, dtype=torch.float32,
        index_dtype=torch.float32))


def expected(cache, chunks, max_tokens, max_seqs):
    """Full buffer contents written straight from the spec."""
    b, t = len(chunks), sum(c.num_tokens for c in chunks)
    indptr, lens, rows, tseq, pos, slots = [0], [], [], [], [], []
    for i, c in enumerate(chunks):
        indptr.append(indptr[-1] + c.num_tokens)
        lens.append(c.start_pos + c.num_tokens)
        rows.append(cache.table_row(c.seq_id))
        pages = cache.pages(c.seq_id)
        for p in range(c.start_pos, c.start_pos + c.num_tokens):
            tseq.append(i)
            pos.append(p)
            slots.append(pages[p // cache.page_size] * cache.page_size + p % cache.page_size)
    pad_s, pad_t = max_seqs + 1 - b, max_tokens - t
    return dict(
        qo_indptr=indptr + [t] * pad_s,
        kv_lens=lens + [0] * pad_s,
        table_rows=rows + [cache.pad_table_row] * pad_s,
        token_seq=tseq + [max_seqs] * pad_t,
        positions=pos + [0] * pad_t,
        slot_mapping=slots + [-1] * pad_t,
    )


def check_buffers(builder, chunks):
    want = expected(builder.cache, chunks, builder.max_tokens, builder.max_seqs)
    for name, vals in want.items():
        assert getattr(builder.buffers, name).tolist() == vals, name


def test_mixed_batch_two_decodes_and_a_prefill_chunk():
    cache = make_cache()
    for s, n in (("d0", 9), ("p", 14), ("d1", 3)):
        cache.add_sequence(s)
        cache.reserve(s, n)
    builder = MetadataBuilder(cache, max_tokens=16, max_seqs=4)
    chunks = [C("d0", 8, 1), C("p", 8, 6), C("d1", 2, 1)]
    m = builder.build(chunks)
    assert (m.num_tokens, m.num_seqs, m.max_q_len, m.max_kv_len) == (8, 3, 6, 14)
    assert m.qo_indptr.tolist() == [0, 1, 7, 8] and m.qo_indptr.dtype == torch.int32
    assert m.kv_lens.tolist() == [9, 14, 3] and m.kv_lens.dtype == torch.int32
    rows = [cache.table_row(s) for s in ("d0", "p", "d1")]
    assert m.table_rows.tolist() == rows and m.table_rows.dtype == torch.int32
    assert m.token_seq.tolist() == [0, 1, 1, 1, 1, 1, 1, 2] and m.token_seq.dtype == torch.int32
    assert m.positions.tolist() == [8, 8, 9, 10, 11, 12, 13, 2] and m.positions.dtype == torch.int64
    slots = cache.slots("d0", 8, 1) + cache.slots("p", 8, 6) + cache.slots("d1", 2, 1)
    assert m.slot_mapping.tolist() == slots and m.slot_mapping.dtype == torch.int64
    assert m.qo_indptr_host.tolist() == [0, 1, 7, 8] and m.kv_lens_host.tolist() == [9, 14, 3]
    assert m.table_rows_host.tolist() == rows and m.qo_indptr_host.device.type == "cpu"
    assert m.block_tables is cache.block_tables and m.page_size == 4
    # Views from offset 0 of the persistent buffers, whose tails hold pad values.
    for name in ("qo_indptr", "kv_lens", "table_rows", "token_seq", "positions", "slot_mapping"):
        assert getattr(m, name).data_ptr() == getattr(builder.buffers, name).data_ptr()
    check_buffers(builder, chunks)
    assert (cache.block_tables[m.buffers.table_rows[3]] == -1).all()  # pad rows read an empty table


def test_views_past_the_real_rows_read_padding():
    cache = make_cache()
    for s in range(3):
        cache.add_sequence(s)
        cache.reserve(s, 5 + s)
    builder = MetadataBuilder(cache, max_tokens=8, max_seqs=4)
    m = builder.build([C(s, 4 + s, 1) for s in range(3)])
    assert m.max_q_len == 1
    p = m.buffers.views(4, 4)  # a whole decode graph of 4 rows over 3 requests
    assert p["qo_indptr"].tolist() == [0, 1, 2, 3, 3] and p["kv_lens"].tolist() == [5, 6, 7, 0]
    assert p["table_rows"].tolist()[3] == cache.pad_table_row
    assert p["slot_mapping"].tolist()[3] == -1 and p["positions"].tolist()[3] == 0 and p["token_seq"].tolist()[3] == 4
    assert set(m.buffers.tensors()) == {"qo_indptr", "kv_lens", "table_rows", "token_seq", "positions", "slot_mapping"}


def test_repeated_builds_restore_pads():
    rng = random.Random(0)
    cache = make_cache(num_pages=160, max_seqs=6, max_pages_per_seq=32)
    for s in range(6):
        cache.add_sequence(s)
        cache.reserve(s, 100)
    builder = MetadataBuilder(cache, max_tokens=40, max_seqs=6)
    for _ in range(25):  # big and small steps in random order: earlier real entries must not linger
        seqs = rng.sample(range(6), rng.randint(1, 6))
        budget = 40
        chunks = []
        for s in seqs:
            n = rng.randint(1, max(1, min(12, budget - (len(seqs) - len(chunks) - 1))))
            budget -= n
            chunks.append(C(s, rng.randint(0, 100 - n), n))
        m = builder.build(chunks)
        assert m.num_tokens == sum(c.num_tokens for c in chunks)
        check_buffers(builder, chunks)


class CountingList(list):
    """A page list that counts how many entries are read."""

    reads = 0

    def __getitem__(self, i):
        CountingList.reads += len(range(*i.indices(len(self)))) if isinstance(i, slice) else 1
        return super().__getitem__(i)

    def __iter__(self):
        CountingList.reads += len(self)
        return super().__iter__()


def test_prefill_chunk_cost_is_o_chunk():
    cache = make_cache(num_pages=20000, page_size=2, max_seqs=2, max_pages_per_seq=20000)
    cache.add_sequence("long")
    cache.reserve("long", 40000)  # a 40k-token prompt: 20k pages
    cache._pages["long"] = CountingList(cache._pages["long"])
    builder = MetadataBuilder(cache, max_tokens=8, max_seqs=2)
    CountingList.reads = 0
    m = builder.build([C("long", 39992, 8)])
    assert CountingList.reads <= 5, f"building an 8-token chunk read {CountingList.reads} page entries"
    pages = cache.pages("long")
    assert m.slot_mapping.tolist() == [pages[p // 2] * 2 + p % 2 for p in range(39992, 40000)]


def test_check_refuses_bad_steps_and_changes_nothing():
    cache = make_cache(num_pages=9, max_seqs=2, max_pages_per_seq=8)
    for s in range(3):
        cache.add_sequence(s)
        cache.reserve(s, 12)  # every page taken
        cache.set_written(s, 7)
    builder = MetadataBuilder(cache, max_tokens=6, max_seqs=2)
    builder.build([C(0, 7, 1), C(1, 7, 4)])
    before = {k: t.clone() for k, t in builder.buffers.tensors().items()}
    tables, free = cache.block_tables.clone(), cache.num_free_pages
    bad = {
        "max_tokens=6": [C(0, 7, 4), C(1, 7, 3)],
        "max_seqs=2": [C(s, 7, 1) for s in range(3)],
        "at least one TokenChunk": [],
        "request 0 appears twice": [C(0, 7, 1), C(0, 8, 1)],
        r"request 'x' is unknown; add it first \(runner.add_request\('x'\)\)": [C("x", 0, 1)],
        "request 2: chunk at start_pos=9 skips past the 7 positions written": [C(2, 9, 1)],
        "request 2: chunk at start_pos=3 rewrites the 7 positions written so far.*rewind": [C(2, 3, 1)],
        r"request 1: token id 300 is outside the vocabulary \[0, 256\)": [TokenChunk(1, 7, [5, 300])],
        "a step is a sequence of TokenChunk": [(0, 7, 1)],
        r"a step is a list of TokenChunk, got one TokenChunk \(request 0\); pass \[chunk\]": C(0, 7, 1),
        "would hold 33 positions": [C(0, 7, 26)],
    }
    for msg, chunks in bad.items():
        with pytest.raises(ValueError, match=msg):
            builder.max_tokens = 40 if "33" in msg else 6
            builder.check(chunks, vocab_size=256)
    builder.max_tokens = 12
    with pytest.raises(RuntimeError, match=r"needs 2 new KV pages \(request 0 1, request 1 1\) but 0 of 9 are free"):
        builder.check([C(0, 7, 6), C(1, 7, 6)])
    builder.max_tokens = 6
    for k, v in before.items():
        assert torch.equal(builder.buffers.tensors()[k], v), k
    assert torch.equal(cache.block_tables, tables) and cache.num_free_pages == free
    builder.check([C(0, 7, 1), C(1, 7, 1)])  # a good step passes
    for kw in (dict(max_tokens=0, max_seqs=1), dict(max_tokens=1, max_seqs=0), dict(max_tokens=True, max_seqs=1)):
        with pytest.raises(ValueError):
            MetadataBuilder(cache, **kw)


def test_token_chunk_hygiene_names_the_request():
    ok = TokenChunk("r", np.int64(3), np.array([1, 2], dtype=np.int32))
    assert ok.start_pos == 3 and type(ok.start_pos) is int and ok.token_ids == (1, 2) and ok.end_pos == 5
    assert TokenChunk("r", torch.tensor(2), torch.tensor([7])).token_ids == (7,)
    for kwargs, msg in [
        (dict(token_ids=[8.7]), r"request 'r': token_ids\[0\] = 8.7 is not an integer token id"),
        (dict(token_ids=torch.tensor([1.0])), "1-D integer sequence"),
        (dict(token_ids=np.array([1.5])), "is not an integer token id"),
        (dict(token_ids=[True]), "is not an integer token id"),
        (dict(token_ids=[]), "at least one token"),
        (dict(token_ids="abc"), r"request 'r': token_ids must be a sequence of integers, got str"),
        (dict(start_pos=-1), "start_pos must be an integer >= 0"),
        (dict(start_pos=2.0), "start_pos must be an integer >= 0"),
        (dict(start_pos=True), "start_pos must be an integer >= 0"),
    ]:
        args = dict(seq_id="r", start_pos=0, token_ids=[1]) | kwargs
        with pytest.raises(ValueError, match=msg):
            TokenChunk(**args)


@pytest.mark.cuda
def test_builds_on_cuda_use_consistent_buffers():
    cache = PagedKVCache(KVCacheConfig(
        num_layers=1, sparse_layers=(), num_kv_heads=1, head_dim=4, index_dim=4, page_size=4, num_pages=64,
        max_seqs=4, max_pages_per_seq=16, dtype=torch.float32, device="cuda"))
    for s in range(4):
        cache.add_sequence(s)
        cache.reserve(s, 40)
    builder = MetadataBuilder(cache, max_tokens=24, max_seqs=4)
    assert builder.buffers.positions.is_cuda
    for step in range(6):  # alternate big and small: the two pinned staging sets take turns
        chunks = [C(s, 10 + step, 6 if step % 2 == 0 else 1) for s in range(4 - step % 3)]
        builder.build(chunks)
        torch.cuda.synchronize()
        check_buffers(builder, chunks)
