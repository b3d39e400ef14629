"""graphcap.startup.compile_ahead on a GPU: launches inside compile only, in parallel, and the real
launches after it find their kernels built."""

import threading

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from graphcap.startup.compile_ahead import compile_ahead, launching  # noqa: E402

pytestmark = pytest.mark.cuda


@triton.jit
def _fill(out_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, VALUE, mask=i < n)


class Misses:
    """Counts launches that found no built kernel in memory (Triton's jit_cache_hook runs
    before every such compile)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __enter__(self):
        self._old = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc):
        triton.knobs.runtime.jit_cache_hook = self._old

    def _hook(self, *args, **kwargs) -> bool:
        self.names.append(str(kwargs.get("repr", "?")))
        return False  # compile as usual


def test_launches_inside_compile_only_and_the_real_launches_after_compile_nothing():
    out = torch.zeros(64, device="cuda", dtype=torch.float32)
    values = [1.0 + 0.25 * i for i in range(6)]  # a fresh specialization each (VALUE is constexpr)
    with compile_ahead(4):
        for v in values:
            _fill[(1,)](out, 64, VALUE=v, BLOCK=64)
    torch.cuda.synchronize()
    assert torch.count_nonzero(out) == 0  # nothing ran inside
    with Misses() as misses:
        for v in values:
            _fill[(1,)](out, 64, VALUE=v, BLOCK=64)
            torch.cuda.synchronize()
            assert torch.all(out == v)
    assert misses.names == []  # every kernel was built by compile_ahead


def test_other_threads_and_launching_blocks_run_their_launches():
    out = torch.zeros(2, 32, device="cuda", dtype=torch.float32)
    with compile_ahead(2):
        t = threading.Thread(target=lambda: _fill[(1,)](out[0], 32, VALUE=11.0, BLOCK=32))
        t.start()
        t.join()
        with launching():
            _fill[(1,)](out[1], 32, VALUE=12.0, BLOCK=32)
        _fill[(1,)](out[1], 32, VALUE=13.0, BLOCK=32)  # compile only again
    torch.cuda.synchronize()
    assert torch.all(out[0] == 11.0) and torch.all(out[1] == 12.0)


def test_a_kernel_that_fails_to_compile_raises_at_its_real_launch():
    out = torch.zeros(48, device="cuda", dtype=torch.float32)
    with compile_ahead(2):  # BLOCK 48 is no power of two: the compile fails, silently here
        _fill[(1,)](out, 48, VALUE=1.0, BLOCK=48)
    with pytest.raises(Exception, match="power of 2"):
        _fill[(1,)](out, 48, VALUE=1.0, BLOCK=48)
