"""models.runner.kv_budget: the bytes of a KV page and how many pages a cache gets (all wanted,
or what fits beside the weights), with a clear error when not one request fits."""

import pytest
import torch

from models.minimax_m3.config import MiniMaxM3Config
from models.runner.kv_budget import kv_budget, page_bytes

GIB = 2**30


def layout(dtype=torch.bfloat16):
    c = MiniMaxM3Config.preset("rank-of-8")
    return c.kv_cache_config(num_pages=1, max_seqs=1, max_pages_per_seq=1, dtype=dtype, index_dtype=dtype)


def test_a_rank_of_8_page_is_k_v_and_index_k_over_every_layer():
    # 60 layers x 128 positions x (K + V: 1 head x 128) + 57 sparse layers x 128 x 128 index dims, 2 bytes
    assert page_bytes(layout()) == (60 * 128 * 2 * 128 + 57 * 128 * 128) * 2 == 5_799_936
    assert page_bytes(layout(torch.float8_e4m3fn)) == page_bytes(layout()) // 2


def test_without_a_memory_figure_every_request_gets_its_longest_length():
    b = kv_budget(layout(), max_seqs=8, max_seq_len=131_328)
    assert (b.pages_per_request, b.wanted, b.pages, b.fits) == (1026, 8208, 8208, True)
    assert b.tokens == 8208 * 128 and b.longest_requests == 8
    assert "all 8 requests of 131,328 positions fit" in b.describe("bf16")


def test_what_does_not_fit_is_capped_and_said():
    # The H200 case: ~139 GiB free, 99.6 GiB of bf16 weights and 10 GiB headroom leave ~29 GiB.
    free, reserved = int(139.5 * GIB), int(109.6 * GIB)
    bf16 = kv_budget(layout(), 8, 131_328, free_bytes=free, reserved_bytes=reserved, extra_pages=10)
    assert bf16.pages == (free - reserved) // 5_799_936 - 10 and not bf16.fits
    assert bf16.longest_requests == 5
    text = bf16.describe("bf16")
    assert "does NOT fit 8 requests" in text and "5 fit at once" in text and "GiB free" in text
    fp8 = kv_budget(layout(torch.float8_e4m3fn), 8, 131_328, free_bytes=free, reserved_bytes=reserved)
    assert fp8.fits and fp8.pages == fp8.wanted


def test_not_one_request_fitting_is_an_error_that_says_what_to_change():
    with pytest.raises(ValueError, match="one request of 131328 positions needs 1026.*fp8 KV cache"):
        kv_budget(layout(), 8, 131_328, free_bytes=100 * GIB, reserved_bytes=99 * GIB)
