"""graphcap.startup.compile_counter on a GPU: a JIT launch of a new specialization counts one
build, a launch that hits the in-memory cache counts nothing, a launch after the in-memory
cache was dropped counts one disk-cache load, compile_ahead's compiles are counted (in its
threads), and a runner reports what compiled after its capture."""

import time

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from graphcap.startup.compile_ahead import compile_ahead  # noqa: E402
from graphcap.startup.compile_counter import compile_counter  # noqa: E402

pytestmark = pytest.mark.cuda


@triton.jit
def _fill(out_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, VALUE, mask=i < n)


def fresh_value() -> float:
    """A constexpr no earlier launch of this process used (a new specialization)."""
    return float(time.perf_counter_ns() % 1_000_003) + 0.5


def test_a_new_specialization_counts_one_build_and_a_cached_launch_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # an empty disk cache: a real build
    counter = compile_counter()
    out = torch.zeros(64, device="cuda")
    v = fresh_value()
    before = counter.count
    _fill[(1,)](out, 64, VALUE=v, BLOCK=64)
    torch.cuda.synchronize()
    (event,) = counter.since(before)
    assert event.kernel == "_fill" and not event.cached and f"VALUE={v}" in event.key and event.seconds > 0
    _fill[(1,)](out, 64, VALUE=v, BLOCK=64)  # in memory: no hook fires
    assert counter.count == before + 1 and torch.all(out == v)
    _fill.device_caches.clear()  # the next launch finds the kernel on disk only
    _fill[(1,)](out, 64, VALUE=v, BLOCK=64)
    (load,) = counter.since(before + 1)
    assert load.cached and load.key == event.key


def test_compile_ahead_compiles_are_counted_in_its_threads(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    counter = compile_counter()
    out = torch.zeros(64, device="cuda")
    values = [fresh_value() + i for i in range(3)]
    before = counter.count
    with compile_ahead(2):
        for v in values:
            _fill[(1,)](out, 64, VALUE=v, BLOCK=64)
    events = counter.since(before)
    assert len(events) == 3 and not any(e.cached for e in events)
    assert all(e.thread.startswith("graphcap-compile") for e in events)
    for v in values:  # built ahead: the real launches compile nothing
        _fill[(1,)](out, 64, VALUE=v, BLOCK=64)
    assert counter.count == before + 3


def test_a_runner_counts_compiles_after_its_capture_only():
    from graphcap import CaptureConfig
    from models.minimax_m3 import build_from_preset

    # the Triton backend: flashinfer has no kernels for the tiny preset's head_dim 32
    runner = build_from_preset("tiny", "cuda", torch.bfloat16, backend="triton", max_tokens=32, max_seqs=2,
                               max_seq_len=256, capture=CaptureConfig(enabled=True, mode="decode", max_tokens=32))
    assert runner.compiles_after_capture() is None
    runner.capture()
    assert runner.compiles_after_capture() == []
    out = torch.zeros(64, device="cuda")
    _fill[(1,)](out, 64, VALUE=fresh_value(), BLOCK=64)  # any compile of the process after capture
    (event,) = runner.compiles_after_capture()
    assert event.kernel == "_fill" and runner.compiles_after_capture(1) == []
    runner.destroy()
