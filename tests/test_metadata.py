"""MetadataBuilder: mixed batches, pad values in the persistent buffers, O(chunk) cost, errors."""

from __future__ import annotations

import random

import pytest
import torch

from kvcache.paged import KVCacheConfig, PagedKVCache
from attention.metadata import MetadataBuilder, RequestChunk


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
        rows.append(cache.seq_slot(c.seq_id))
        pages = cache.pages(c.seq_id)
        for p in range(c.start_pos, c.start_pos + c.num_tokens):
            tseq.append(i)
            pos.append(p)
            slots.append(pages[p // cache.page_size] * cache.page_size + p % cache.page_size)
    pad_s, pad_t = max_seqs + 1 - b, max_tokens - t
    return dict(
        qo_indptr=indptr + [t] * pad_s,
        kv_lens=lens + [0] * pad_s,
        seq_slots=rows + [cache.pad_seq_slot] * pad_s,
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
    chunks = [RequestChunk("d0", 8, 1), RequestChunk("p", 8, 6), RequestChunk("d1", 2, 1)]
    m = builder.build(chunks)
    assert (m.num_tokens, m.num_seqs, m.uniform_decode, m.max_q_len, m.max_kv_len) == (8, 3, False, 6, 14)
    assert m.qo_indptr.tolist() == [0, 1, 7, 8] and m.qo_indptr.dtype == torch.int32
    assert m.kv_lens.tolist() == [9, 14, 3] and m.kv_lens.dtype == torch.int32
    rows = [cache.seq_slot(s) for s in ("d0", "p", "d1")]
    assert m.seq_slots.tolist() == rows and m.seq_slots.dtype == torch.int32
    assert m.token_seq.tolist() == [0, 1, 1, 1, 1, 1, 1, 2] and m.token_seq.dtype == torch.int32
    assert m.positions.tolist() == [8, 8, 9, 10, 11, 12, 13, 2] and m.positions.dtype == torch.int64
    slots = cache.slots("d0", 8, 1) + cache.slots("p", 8, 6) + cache.slots("d1", 2, 1)
    assert m.slot_mapping.tolist() == slots and m.slot_mapping.dtype == torch.int64
    assert m.qo_indptr_host.tolist() == [0, 1, 7, 8] and m.kv_lens_host.tolist() == [9, 14, 3]
    assert m.seq_slots_host.tolist() == rows and m.qo_indptr_host.device.type == "cpu"
    assert m.block_tables is cache.block_tables and m.page_size == 4
    # Views from offset 0 of the persistent buffers, whose tails hold pad values.
    for name in ("qo_indptr", "kv_lens", "seq_slots", "token_seq", "positions", "slot_mapping"):
        assert getattr(m, name).data_ptr() == getattr(builder.buffers, name).data_ptr()
    check_buffers(builder, chunks)
    assert (cache.block_tables[m.buffers.seq_slots[3]] == -1).all()  # pad rows read an empty table


def test_uniform_decode_and_pad_to():
    cache = make_cache()
    for s in range(3):
        cache.add_sequence(s)
        cache.reserve(s, 5 + s)
    builder = MetadataBuilder(cache, max_tokens=8, max_seqs=4)
    m = builder.build([RequestChunk(s, 4 + s, 1) for s in range(3)])
    assert m.uniform_decode and m.max_q_len == 1
    p = m.pad_to(4)
    assert (p.num_tokens, p.num_seqs) == (3, 3)
    assert p.qo_indptr.tolist() == [0, 1, 2, 3, 3] and p.kv_lens.tolist() == [5, 6, 7, 0]
    assert p.seq_slots.tolist()[3] == cache.pad_seq_slot
    assert p.slot_mapping.tolist()[3] == -1 and p.positions.tolist()[3] == 0 and p.token_seq.tolist()[3] == 4
    with pytest.raises(ValueError, match="pad_to"):
        m.pad_to(2)
    with pytest.raises(ValueError, match="num_seqs"):
        m.pad_to(8)  # a decode bucket of 8 needs 8 request rows; capacity is 4 + 1 pad


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
            chunks.append(RequestChunk(s, rng.randint(0, 100 - n), n))
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
    m = builder.build([RequestChunk("long", 39992, 8)])
    assert CountingList.reads <= 5, f"building an 8-token chunk read {CountingList.reads} page entries"
    pages = cache.pages("long")
    assert m.slot_mapping.tolist() == [pages[p // 2] * 2 + p % 2 for p in range(39992, 40000)]


def test_batch_errors_leave_buffers_unchanged():
    cache = make_cache()
    for s in range(3):
        cache.add_sequence(s)
        cache.reserve(s, 8)
    builder = MetadataBuilder(cache, max_tokens=6, max_seqs=2)
    good = [RequestChunk(0, 7, 1), RequestChunk(1, 2, 4)]
    builder.build(good)
    before = {k: getattr(builder.buffers, k).clone() for k in ("qo_indptr", "kv_lens", "slot_mapping", "positions")}
    bad = {
        "max_tokens=6": [RequestChunk(0, 0, 4), RequestChunk(1, 0, 3)],
        "max_seqs=2": [RequestChunk(s, 0, 1) for s in range(3)],
        "reserve": [RequestChunk(2, 6, 3)],
        "at least one": [],
        "twice": [RequestChunk(0, 0, 1), RequestChunk(0, 1, 1)],
        "num_tokens >= 1": [RequestChunk(0, 0, 0)],
        "start_pos >= 0": [RequestChunk(0, -1, 1)],
        "unknown sequence": [RequestChunk("x", 0, 1)],
    }
    for msg, chunks in bad.items():
        with pytest.raises(ValueError, match=msg):
            builder.build(chunks)
        for k, v in before.items():
            assert torch.equal(getattr(builder.buffers, k), v), (msg, k)
    for kw in (dict(max_tokens=0, max_seqs=1), dict(max_tokens=1, max_seqs=0)):
        with pytest.raises(ValueError):
            MetadataBuilder(cache, **kw)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
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
        chunks = [RequestChunk(s, 10 + step, 6 if step % 2 == 0 else 1) for s in range(4 - step % 3)]
        builder.build(chunks)
        torch.cuda.synchronize()
        check_buffers(builder, chunks)
