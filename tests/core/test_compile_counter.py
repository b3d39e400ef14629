"""graphcap.startup.compile_counter on a CPU: the bookkeeping of Triton's compilation listener
(called directly), chaining with a listener already installed, that the interpreter compiles
nothing, and a real compile (for a Hopper target, no GPU needed) counted as a build, then as a
disk-cache load."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from graphcap.startup.compile_counter import CompileCounter, CompileEvent, compile_counter, specialization_key

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def fake_source(name="_fill", value=3.0):
    """What ``triton.compile`` hands its listener for a JIT kernel: an ``ASTSource``'s fields."""
    fn = SimpleNamespace(arg_names=["out_ptr", "n", "VALUE"])
    return SimpleNamespace(name=name, fn=fn, signature={"out_ptr": "*fp32", "n": "i32", "VALUE": "constexpr"},
                           constants={(2,): value})


def test_the_listener_records_kernel_specialization_kind_and_seconds():
    c = CompileCounter()
    meta = {"name": "_fill", "num_warps": 4, "num_stages": 3}
    c.on_compile(src=fake_source(), metadata=meta, cache_hit=False, times=SimpleNamespace(total=412_000),
                 metadata_group={})
    mark = c.count
    c.on_compile(src=fake_source(value=4.0), metadata=meta, cache_hit=True, times=SimpleNamespace(total=1_500),
                 metadata_group={})
    built, loaded = c.since(0)
    assert (built.kernel, built.cached, built.seconds) == ("_fill", False, pytest.approx(0.412))
    assert built.key == "_fill[VALUE=3.0](out_ptr: *fp32, n: i32) warps=4 stages=3"
    assert loaded.cached and loaded.key.startswith("_fill[VALUE=4.0]") and loaded.seconds == pytest.approx(0.0015)
    assert c.since(mark) == [loaded] and c.count == 2
    assert "built, 412 ms" in built.describe() and "disk cache" in loaded.describe()


def test_a_source_without_a_jit_function_is_named_by_its_metadata():
    assert specialization_key(SimpleNamespace(name=None), {"name": "kernel_from_ir"}) == "kernel_from_ir"
    c = CompileCounter()
    c.on_compile(src=SimpleNamespace(), metadata={"name": "k"}, cache_hit=False)  # no times given
    assert c.since(0)[0].kernel == "k" and c.since(0)[0].seconds == 0.0


def test_threads_recording_at_once_lose_nothing():
    c = CompileCounter()

    def work(i):
        for j in range(200):
            c.record(CompileEvent(f"k{i}", f"k{i}[{j}]", False, 0.0, threading.current_thread().name))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.count == 1600 and len({e.key for e in c.since(0)}) == 1600


def test_install_chains_the_listener_already_there_and_counts_each_compile_once(monkeypatch):
    seen = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: seen.append(kw["cache_hit"]))
    c = CompileCounter()
    assert c.install()
    ours = triton.knobs.compilation.listener
    assert c.install() and triton.knobs.compilation.listener is ours  # idempotent
    meta = {"name": "_fill"}
    ours(src=fake_source(), metadata=meta, cache_hit=False, times=None, metadata_group={})
    assert c.count == 1 and seen == [False]
    # A tool that wraps our listener later, then our install again (capture() does): the chain
    # holds two of our wrappers, and the compile is still counted once.
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: (seen.append("tool"), ours(**kw)))
    c.install()
    triton.knobs.compilation.listener(src=fake_source(), metadata=meta, cache_hit=True, times=None, metadata_group={})
    assert c.count == 2 and seen == [False, "tool", True]


def test_the_process_counter_is_one_and_installed(monkeypatch):
    counter = compile_counter()
    assert compile_counter() is counter
    monkeypatch.setattr(triton.knobs.compilation, "listener", None)  # someone took the slot
    counter.install()
    before = counter.count
    triton.knobs.compilation.listener(src=fake_source(), metadata={"name": "_fill"}, cache_hit=False, times=None,
                                      metadata_group={})
    assert counter.count == before + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_the_interpreter_compiles_nothing_so_the_cpu_count_is_zero():
    import triton.language as tl

    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest

    @triton.jit
    def _store(out_ptr, VALUE: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, 4), VALUE)

    counter = compile_counter()
    before = counter.count
    out = torch.zeros(4)
    for v in (1.0, 2.0):  # two specializations: each would compile on a GPU
        _store[(1,)](out, VALUE=v)
    assert torch.all(out == 2.0) and counter.count == before


COMPILE = """
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from graphcap.startup.compile_counter import compile_counter

@triton.jit
def _fill(out_ptr, n, VALUE: tl.constexpr):
    i = tl.arange(0, 16)
    tl.store(out_ptr + i, VALUE, mask=i < n)

counter = compile_counter()
for v in (3.0, 3.0, 4.0):  # a build, the same from the disk cache, a new specialization
    src = ASTSource(_fill, {"out_ptr": "*fp32", "n": "i32", "VALUE": "constexpr"}, constexprs={"VALUE": v})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))
print(json.dumps([[e.kernel, e.key, e.cached, e.seconds] for e in counter.since(0)]))
"""


def test_a_real_triton_compile_is_counted_as_a_build_then_as_a_disk_load(tmp_path):
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=str(ROOT))
    script = tmp_path / "compile_fill.py"  # @triton.jit needs its source in a file
    script.write_text(COMPILE)
    res = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    events = json.loads(res.stdout.strip().splitlines()[-1])
    assert [(k, cached) for k, _, cached, _ in events] == [("_fill", False), ("_fill", True), ("_fill", False)]
    assert events[0][1].startswith("_fill[VALUE=3.0](out_ptr: *fp32, n: i32)") and "VALUE=4.0" in events[2][1]
    assert events[0][3] > events[1][3] > 0  # a build takes longer than a load
