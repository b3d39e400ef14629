"""PagedKVCache: config validation, page bookkeeping, block tables, capturable writes."""

from __future__ import annotations

import pytest
import torch

from kvcache.paged import KVCacheConfig, PagedKVCache

BASE = dict(num_layers=3, sparse_layers=(1, 2), num_kv_heads=2, head_dim=8, index_dim=4, page_size=4,
            num_pages=12, max_seqs=3, max_pages_per_seq=5, dtype=torch.float32, index_dtype=torch.float32)


def make(**over) -> PagedKVCache:
    return PagedKVCache(KVCacheConfig(**{**BASE, **over}))


def snapshot(c: PagedKVCache) -> dict:
    return dict(k=c._k_store.clone(), v=c._v_store.clone(), ik=c._ik_store.clone(), bt=c.block_tables.clone(),
                free=list(c._free_pages), rows=list(c._free_rows), pages={s: list(p) for s, p in c._pages.items()},
                row=dict(c._row))


def assert_same(a: dict, b: dict) -> None:
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("field,value", [
    ("num_layers", 0), ("num_kv_heads", -1), ("head_dim", 1.5), ("index_dim", 0), ("page_size", 0),
    ("num_pages", 0), ("max_seqs", 0), ("max_pages_per_seq", 0), ("sparse_layers", (2, 1)),
    ("sparse_layers", (0, 3)), ("sparse_layers", (1, 1)), ("dtype", "bf16"), ("index_dtype", 3),
    ("table_row_headroom", -1), ("device", "nonsense"),
])
def test_config_rejects_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        KVCacheConfig(**{**BASE, field: value})


def test_shapes_and_initial_state():
    c = make(table_row_headroom=2)
    assert c.k_cache.shape == (3, 12, 4, 2, 8) and c.v_cache.shape == (3, 12, 4, 2, 8)
    assert c.index_k_cache.shape == (2, 12, 4, 4)
    assert c.k_cache[1].is_contiguous()  # flashinfer's NHD layout per layer
    assert c.config.max_live_seqs == 5 and c.block_tables.shape == (6, 5)
    assert c.block_tables.dtype == torch.int32 and (c.block_tables == -1).all()
    assert c.pad_table_row == 5
    assert c.sparse_index(1) == 0 and c.sparse_index(2) == 1
    with pytest.raises(ValueError, match="not a sparse layer"):
        c.sparse_index(0)
    assert make().config.table_row_headroom == 3  # default headroom: one whole batch


def test_headroom_lets_finishing_and_new_sequences_coexist():
    c = make(max_seqs=2, table_row_headroom=1)
    rows = [c.add_sequence(i) for i in range(3)]  # 2 running + 1 admitted before a free
    assert sorted(rows) == [0, 1, 2] and c.pad_table_row not in rows
    with pytest.raises(RuntimeError, match="too many sequences"):
        c.add_sequence(3)
    c.free(1)
    assert c.add_sequence(3) == rows[1]  # freed row reused


def test_block_table_and_slots_match_pages():
    c = make()
    torch.manual_seed(0)
    c.add_sequence("a"), c.add_sequence("b")
    c.reserve("a", 5)
    c.reserve("b", 9)
    c.reserve("a", 17)
    for s in ("a", "b"):
        pages = c.pages(s)
        row = c.block_tables[c.table_row(s)]
        assert row[: len(pages)].tolist() == pages and (row[len(pages):] == -1).all()
        n = c.num_reserved_tokens(s)
        assert n == len(pages) * 4
        for start, cnt in [(0, n), (3, 2), (n - 1, 1), (5, 0)]:
            want = [pages[p // 4] * 4 + p % 4 for p in range(start, start + cnt)]
            assert c.slots(s, start, cnt) == want
    all_pages = c.pages("a") + c.pages("b")
    assert len(set(all_pages)) == len(all_pages) == 8 and c.num_free_pages == 4


def test_block_table_updates_only_new_entries():
    c = make()
    row = c.add_sequence(7)
    c.reserve(7, 6)  # 2 pages
    c.block_tables[row, :2] = 99  # poison: a full rewrite would restore the real ids
    c.reserve(7, 6)  # no new page: nothing written
    assert c.block_tables[row, :2].tolist() == [99, 99]
    c.reserve(7, 13)  # 2 more pages
    assert c.block_tables[row, :2].tolist() == [99, 99]
    assert c.block_tables[row, 2:4].tolist() == c.pages(7)[2:]
    assert (c.block_tables[row, 4:] == -1).all()


def test_free_resets_row_and_reuses_pages():
    c = make()
    c.add_sequence("a")
    c.reserve("a", 10)
    pa = c.pages("a")
    row = c.table_row("a")
    c.free("a")
    assert (c.block_tables[row] == -1).all() and c.num_free_pages == 12 and not c.has_sequence("a")
    c.add_sequence("b")
    c.reserve("b", 10)
    assert c.pages("b") == pa  # most recently freed pages come back first, in order


@pytest.mark.parametrize("layer,with_index", [(0, False), (1, True), (2, True), (2, False)])
def test_write_scatters_and_minus_one_writes_nothing(layer, with_index):
    torch.manual_seed(layer)
    c = make()
    c.add_sequence(0), c.add_sequence(1)
    c.reserve(0, 7), c.reserve(1, 4)
    c._k_store.normal_(), c._v_store.normal_(), c._ik_store.normal_()  # non-zero background
    before = snapshot(c)
    slots = c.slots(0, 2, 5) + c.slots(1, 0, 3)
    sm = torch.tensor(slots[:3] + [-1] + slots[3:] + [-1, -1], dtype=torch.int64)
    sm = sm[torch.randperm(sm.numel())]
    t = sm.numel()
    k, v, ik = torch.randn(t, 2, 8), torch.randn(t, 2, 8), torch.randn(t, 4)
    c.write(layer, sm, k, v, ik if with_index else None)
    exp_k, exp_v = before["k"][:, :12].clone(), before["v"][:, :12].clone()
    exp_ik = before["ik"][:, :12].clone()
    for i, s in enumerate(sm.tolist()):
        if s < 0:
            continue
        exp_k[layer].view(-1, 2, 8)[s] = k[i]
        exp_v[layer].view(-1, 2, 8)[s] = v[i]
        if with_index:
            exp_ik[c.sparse_index(layer)].view(-1, 4)[s] = ik[i]
    assert torch.equal(c.k_cache, exp_k) and torch.equal(c.v_cache, exp_v)
    assert torch.equal(c.index_k_cache, exp_ik)


def test_all_pad_write_leaves_every_page_unchanged():
    c = make()
    c._k_store.normal_(), c._v_store.normal_(), c._ik_store.normal_()
    k0, v0, i0 = c.k_cache.clone(), c.v_cache.clone(), c.index_k_cache.clone()
    sm = torch.full((6,), -1, dtype=torch.int64)
    c.write(1, sm, torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 4))
    assert torch.equal(c.k_cache, k0) and torch.equal(c.v_cache, v0) and torch.equal(c.index_k_cache, i0)


def test_write_argument_errors():
    c = make()
    sm = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="not a sparse layer"):
        c.write(0, sm, torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.randn(2, 4))
    with pytest.raises(ValueError, match="k/v"):
        c.write(0, sm, torch.randn(2, 2, 4), torch.randn(2, 2, 4))
    with pytest.raises(ValueError, match="out of range"):
        c.write(3, sm, torch.randn(2, 2, 8), torch.randn(2, 2, 8))


def test_out_of_pages_leaves_cache_unchanged():
    c = make(num_pages=5)
    c.add_sequence("a"), c.add_sequence("b")
    c.reserve("a", 12)  # 3 pages
    before = snapshot(c)
    with pytest.raises(RuntimeError, match=r"needs 3 more page\(s\).*only 2 of 5 are free"):
        c.reserve("b", 10)
    assert_same(before, snapshot(c))
    c.reserve("b", 8)  # exactly the 2 free pages still works
    assert c.num_free_pages == 0


def test_error_paths():
    c = make(max_pages_per_seq=3)
    c.add_sequence("a")
    before = snapshot(c)
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        c.reserve("a", 13)
    assert_same(before, snapshot(c))
    for call in (lambda: c.reserve("zz", 1), lambda: c.slots("zz", 0, 1), lambda: c.free("zz"),
                 lambda: c.table_row("zz"), lambda: c.num_reserved_tokens("zz")):
        with pytest.raises(ValueError, match="unknown sequence"):
            call()
    with pytest.raises(ValueError, match="already in the cache"):
        c.add_sequence("a")
    c.reserve("a", 5)
    with pytest.raises(ValueError, match="beyond its reserved 8"):
        c.slots("a", 6, 3)
    with pytest.raises(ValueError, match="num_tokens >= 0"):
        c.reserve("a", -1)
    c.free("a")
    with pytest.raises(ValueError, match="unknown sequence"):
        c.free("a")


def test_reused_pages_never_leak_old_contents_into_attention():
    from attention.metadata import MetadataBuilder
    from attention.reference.dense import dense_attention_ref
    from steps import TokenChunk

    torch.manual_seed(3)
    c = make(num_pages=3)
    c.add_sequence("old")
    c.reserve("old", 12)
    sm = torch.tensor(c.slots("old", 0, 12), dtype=torch.int64)
    c.write(0, sm, 100 * torch.randn(12, 2, 8), 100 * torch.randn(12, 2, 8))  # loud stale data
    old_pages = c.pages("old")
    c.free("old")
    c.add_sequence("new")
    c.reserve("new", 6)
    assert set(c.pages("new")) <= set(old_pages)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    c.write(0, torch.tensor(c.slots("new", 0, 6), dtype=torch.int64), k, v)
    tail = c.k_cache[0, c.pages("new")[1], 2:]
    assert tail.abs().max() > 10, "the reused page still holds the old sequence's keys past position 5"
    meta = MetadataBuilder(c, max_tokens=6, max_seqs=1).build([TokenChunk("new", 0, [0] * 6)])
    q = torch.randn(6, 4, 8)
    out = torch.full_like(q, float("nan"))
    dense_attention_ref(q, c.k_cache[0], c.v_cache[0], meta, out, 0.25)
    for t in range(6):  # fresh brute force over contiguous K/V of the new sequence only
        for h in range(4):
            w = torch.softmax(k[: t + 1, h // 2] @ q[t, h] * 0.25, 0)
            torch.testing.assert_close(out[t, h], w @ v[: t + 1, h // 2], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_write_captures_and_replays_in_cuda_graph():
    c = make(device="cuda")
    c.add_sequence(0)
    c.reserve(0, 8)
    sm = torch.full((4,), -1, dtype=torch.int64, device="cuda")
    k, v, ik = (torch.zeros(4, 2, 8, device="cuda"), torch.zeros(4, 2, 8, device="cuda"),
                torch.zeros(4, 4, device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        c.write(1, sm, k, v, ik)  # warm-up: all pads, only the sink changes
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.write(1, sm, k, v, ik)
    slots = c.slots(0, 2, 3)
    sm.copy_(torch.tensor(slots + [-1]))
    k.normal_(), v.normal_(), ik.normal_()
    exp_k, exp_ik = c.k_cache.clone(), c.index_k_cache.clone()
    for i, s in enumerate(slots):
        exp_k[1].view(-1, 2, 8)[s] = k[i]
        exp_ik[0].view(-1, 4)[s] = ik[i]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(c.k_cache, exp_k) and torch.equal(c.index_k_cache, exp_ik)
