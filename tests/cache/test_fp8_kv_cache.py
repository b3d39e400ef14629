"""fp8 e4m3 KV and index-K caches (unit scale): config choices and refusals, the bytes a token
costs, and the round trip through both writers: what is read back equals
``x.clamp(-448, 448).to(torch.float8_e4m3fn)`` bit for bit, for the torch writer
(``PagedKVCache.write``) and the fused Triton producer (in the interpreter on CPU).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers.paged import DEV

from attention.reference.dense import paged_gather
from attention.rope import rope_inv_freq
from kvcache.paged import FP8_E4M3, KVCacheConfig, PagedKVCache, cache_dtype, to_cache_dtype
from models.minimax_m3.kernels import producer as cw
from models.minimax_m3.kernels.producer import QKVLayout

BASE = dict(num_layers=3, sparse_layers=(1, 2), num_kv_heads=2, head_dim=8, index_dim=4, page_size=4,
            num_pages=6, max_seqs=2, max_pages_per_seq=3, dtype=FP8_E4M3, index_dtype=FP8_E4M3, device=DEV)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes (fp8 has no ``torch.equal`` on CPU, and bytes also tell -0.0 from 0.0)."""
    return t.view(torch.uint8)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """What an fp8 cache must hold for ``x``: the spec of the write, spelled out."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def hard_values(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` values that exercise the cast, shuffled: every e4m3 value and every midpoint between
    two (ties round to even), values past +-448 and +-inf (saturate), subnormals, signed zeros
    (all of these when ``n >= 515``), then random magnitudes over many octaves."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_E4M3).float()
    grid = codes[~codes.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([449.0, 464.0, 465.0, 1e4, -1e4, float("inf"), -float("inf"), 0.0, -0.0, 2.0**-10])
    rand = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 11, (n,), generator=g).float())
    x = torch.cat([grid, mids, special, rand])[:n].to(dtype)
    return x[torch.randperm(n, generator=g)]


# ---- config ---------------------------------------------------------------------------


def test_fp8_is_accepted_for_both_caches_and_halves_the_bytes_per_token():
    fp8 = KVCacheConfig(**BASE)
    bf16 = KVCacheConfig(**{**BASE, "dtype": torch.bfloat16, "index_dtype": torch.bfloat16})
    # K and V of 3 layers (2 heads x 8) plus index-K of 2 sparse layers (4 wide), one byte each
    assert fp8.bytes_per_token == 3 * 2 * 2 * 8 + 2 * 4
    assert bf16.bytes_per_token == 2 * fp8.bytes_per_token
    cache = PagedKVCache(fp8)
    assert cache.k_cache.dtype == cache.v_cache.dtype == cache.index_k_cache.dtype == FP8_E4M3
    stores = (cache._k_store, cache._v_store, cache._ik_store)
    assert fp8.nbytes == sum(t.numel() * t.element_size() for t in stores)
    mixed = KVCacheConfig(**{**BASE, "index_dtype": torch.bfloat16})  # each cache has its own dtype
    assert mixed.bytes_per_token == 3 * 2 * 2 * 8 + 2 * 4 * 2


@pytest.mark.parametrize("field", ["dtype", "index_dtype"])
@pytest.mark.parametrize("dtype, hint", [
    (torch.float8_e5m2, "e4m3 only"), (torch.float8_e4m3fnuz, "e4m3 only"), (torch.int8, "choose one of"),
    (torch.uint8, "choose one of"), (torch.bool, "choose one of"), (torch.complex64, "choose one of"),
])
def test_unsupported_dtypes_are_refused_naming_the_field_and_the_choices(field, dtype, hint):
    with pytest.raises(ValueError, match=rf"KVCacheConfig.{field}={dtype} is not a supported cache dtype") as e:
        KVCacheConfig(**{**BASE, field: dtype})
    assert hint in str(e.value) and "torch.float8_e4m3fn" in str(e.value)


def test_cache_dtype_names():
    assert cache_dtype("fp8") is cache_dtype("FP8_E4M3") is cache_dtype(torch.float8_e4m3fn) is FP8_E4M3
    assert cache_dtype("bf16") is torch.bfloat16 and cache_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'; choose one of"):
        cache_dtype("int4")
    with pytest.raises(ValueError, match="kv_dtype=torch.float8_e5m2 is not a supported cache dtype"):
        cache_dtype(torch.float8_e5m2)


# ---- the torch writer -------------------------------------------------------------------


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_torch_write_then_read_is_the_clamped_e4m3_cast(src_dtype):
    cache = PagedKVCache(KVCacheConfig(**BASE))
    c = cache.config
    for s in ("a", "b"):
        cache.add_sequence(s)
        cache.reserve(s, 9)
    slots = cache.slots("a", 0, 9) + [-1] + cache.slots("b", 2, 5)
    t = len(slots)
    k = hard_values(t * 16, 1, src_dtype).view(t, 2, 8).to(DEV)
    v = hard_values(t * 16, 2, src_dtype).view(t, 2, 8).to(DEV)
    ik = hard_values(t * 4, 3, src_dtype).view(t, 4).to(DEV)
    before = [bits(x).clone() for x in (cache.k_cache, cache.v_cache, cache.index_k_cache)]
    sm = torch.tensor(slots, dtype=torch.int64, device=DEV)
    cache.write(2, sm, k, v, ik)
    live = sm >= 0
    ik_layer = cache.sparse_index(2)
    for got, x in ((cache.k_cache[2], k), (cache.v_cache[2], v), (cache.index_k_cache[ik_layer], ik)):
        by_slot = got.reshape(-1, *x.shape[1:])
        assert torch.equal(bits(by_slot[sm[live]]), bits(e4m3(x[live])))
        assert torch.equal(bits(to_cache_dtype(x, FP8_E4M3)), bits(e4m3(x)))  # the one definition of the cast
    # every other slot, of this layer and the others, kept its bytes (the pad row went to the sink)
    written = torch.zeros(c.total_pages * c.page_size, dtype=torch.bool, device=DEV)
    written[sm[live]] = True
    for old, new, layer in zip(before, (cache.k_cache, cache.v_cache, cache.index_k_cache), (2, 2, ik_layer)):
        changed = (old != bits(new)).reshape(new.shape[0], c.total_pages * c.page_size, -1).any(-1)
        assert not changed[torch.arange(new.shape[0], device=DEV) != layer].any()
        assert not (changed[layer] & ~written).any()
    # the readers gather the stored bytes (through the block table), then upcast exactly
    got = paged_gather(cache.k_cache[2], cache.block_tables, cache.table_row("a"), 9)
    assert got.dtype == FP8_E4M3 and torch.equal(bits(got), bits(e4m3(k[:9])))
    assert torch.equal(got.float(), e4m3(k[:9]).float())


def test_nan_stays_nan_and_nothing_else_becomes_nan():
    cache = PagedKVCache(KVCacheConfig(**BASE))
    cache.add_sequence("a")
    cache.reserve("a", 2)
    k = torch.full((2, 2, 8), 1e30, device=DEV)
    k[0, 0, 0] = float("nan")
    cache.write(0, torch.tensor(cache.slots("a", 0, 2), device=DEV), k, -k)
    got = cache.k_cache[0].reshape(-1, 2, 8)[:2].float()
    assert got.isnan().sum() == 1 and got[0, 0, 0].isnan()
    assert (cache.v_cache[0].reshape(-1, 2, 8)[:2].float() == -448).sum() == 31


# ---- the fused producer -------------------------------------------------------------------

LAYOUTS = {
    "sparse": QKVLayout(4, 2, 32, num_index_heads=2, index_dim=16, rotary_dim=16),
    "dense": QKVLayout(6, 2, 32, rotary_dim=16),
}


def producer_run(layout: QKVLayout, dtype: torch.dtype, cache_dtype_: torch.dtype, seed: int):
    """The Triton producer over 9 rows (two padded) into fresh caches of ``cache_dtype_``. K and
    index-K norm weights of scale 1000 and a projection output of scale 200 push them and V past 448."""
    L, T = layout, 9
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(s, generator=g, device=DEV)).to(dtype)  # noqa: E731
    qkv = r(T, L.width, scale=200.0)
    pos = torch.randint(0, 100_000, (T,), generator=g, device=DEV)
    slots = torch.randperm(24, generator=g, device=DEV)[:T]
    slots[torch.tensor([1, 5], device=DEV)] = -1
    di = max(L.index_dim, 1)
    norms = dict(q_norm=r(L.head_dim, scale=0.1), k_norm=r(L.head_dim, scale=1000.0))
    kc = torch.zeros(6, 4, L.num_kv_heads, L.head_dim, dtype=cache_dtype_, device=DEV)
    vc, ic = torch.zeros_like(kc), torch.zeros(6, 4, di, dtype=cache_dtype_, device=DEV)
    idx = {}
    if L.has_index:
        idx = dict(index_q_norm=r(di, scale=0.1), index_k_norm=r(di, scale=1000.0), index_k_cache=ic)
    q_out = torch.empty(T, L.num_q_heads, L.head_dim, dtype=dtype, device=DEV)
    cw.norm_rope_cache_write(qkv, pos, slots, L, rope_inv_freq(5e6, L.rotary_dim, DEV), norms["q_norm"],
                             norms["k_norm"], kc, vc, q_out=q_out, **idx)
    return q_out, kc, vc, ic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_triton_producer_writes_the_clamped_e4m3_cast(name, dtype):
    """The kernel into fp8 caches stores exactly the clamped cast of what it stores into fp32
    caches (the same fp32 values, written unrounded): K and V, and index-K on sparse layers."""
    L = LAYOUTS[name]
    seed = 3 + list(LAYOUTS).index(name)
    q32, *wide = producer_run(L, dtype, torch.float32, seed)
    q8, *narrow = producer_run(L, dtype, FP8_E4M3, seed)
    assert torch.equal(q8, q32)  # the queries do not depend on the cache dtype
    for w, n in zip(wide, narrow):
        assert torch.equal(bits(n), bits(e4m3(w)))
    assert (wide[0].abs() > 448).any() and (wide[1].abs() > 448).any(), "the clamp must be exercised"
    if L.has_index:
        assert (wide[2].abs() > 448).any()


@triton.jit
def _round_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, cw._cache_value(tl.load(x_ptr + i), out_ptr).to(out_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rounding_is_torchs_cast_on_every_hard_value(dtype):
    """The producer's in-kernel rounding on ties, subnormals, signed zeros, +-inf and values
    past 448: the same bytes as torch's clamped cast (the raw interpreter cast is not)."""
    x = hard_values(1024, 9, dtype).to(DEV)
    out = torch.empty(1024, dtype=FP8_E4M3, device=DEV)
    _round_kernel[(1,)](x, out, 1024)
    assert torch.equal(bits(out), bits(e4m3(x)))


def test_fp8_producer_compiles_for_hopper():
    """The producer with fp8 cache pointers compiles for sm_90 (no GPU needed), at the real
    and the rank-of-8 shapes, with the resources of the bf16 build."""
    from helpers.triton_compile import run_compile_reports

    fp8 = dict(pos_ptr="i64", slot_ptr="i64", inv_freq_ptr="fp32", kc_ptr="fp8e4nv", vc_ptr="fp8e4nv",
               ic_ptr="fp8e4nv")
    shapes = [dict(HQ=hq, HKV=hkv, D=128, HIDX=hkv, DI=128, ROT=64, HB=hb, BLOCK_D=128, BLOCK_DI=128)
              for hq, hkv, hb in ((64, 4, 16), (8, 1, 8))]
    cases = [["models.minimax_m3.kernels.producer", "_producer_kernel", c, fp8, ["eps"], 4, 1] for c in shapes]
    run_compile_reports(cases)
