"""examples/serve_sim.py --workload long on the tiny preset (CPU): its defaults (concurrency 8,
chunk 64, decode and full_and_piecewise, bf16 and fp8 KV where the build takes kv_dtype), the
same requests for each KV dtype, and the figures the long-context issue asks for in the JSON
and the table: chunk-step times, compiles after capture (0: the interpreter builds nothing),
KV pages and capacity, and what did not fit."""

import inspect
import json
import runpy
from pathlib import Path

import pytest

import models.minimax_m3 as m3

SERVE_SIM = Path(__file__).resolve().parents[1] / "examples" / "serve_sim.py"
HAS_KV_DTYPE = "kv_dtype" in inspect.signature(m3.build_from_preset).parameters


def run(argv, monkeypatch):
    monkeypatch.setattr("sys.argv", ["serve_sim.py", *argv])
    runpy.run_path(str(SERVE_SIM), run_name="__main__")


def test_the_long_workload_reports_chunk_steps_compiles_and_kv_pages(monkeypatch, capfd, tmp_path):
    path = tmp_path / "long.json"
    kv = "bf16,fp8" if HAS_KV_DTYPE else "bf16"
    # Shorter than the workload's own prompts (128-512) to stay fast; 100 pages of 4 positions
    # hold 2 requests of the longest length, so admission is bounded by the KV pages.
    run(["--workload", "long", "--requests", "4", "--prompt-len", "64:192", "--output-len", "2:3", "--kv-dtype", kv,
         "--kv-pages", "100", "--json", str(path)], monkeypatch)
    data = json.loads(path.read_text())
    args, results = data["args"], data["results"]
    assert (args["workload"], args["concurrency"], args["chunk"]) == ("long", 8, 64)
    kvs = kv.split(",")
    suffix = [f" kv-{k}" for k in kvs] if len(kvs) > 1 else [""]
    assert [r["mode"] for r in results] == [f"{m}{s}" for s in suffix for m in ("decode", "full_and_piecewise")]
    for r in results:
        assert r["finished"] == 4 and r["failed"] == 0
        assert r["compiles_after_capture"] == 0 and r["disk_loads_after_capture"] == 0 and r["compile_events"] == []
        assert r["chunk_steps"] > 0 and r["chunk_step_ms_p50"] > 0 and r["chunk_step_bins"]
        assert r["kv_pages"] == 100 and r["kv_capacity_tokens"] == 400
        assert 0 < r["kv_pages_peak_used"] <= r["kv_pages_peak_claimed"] <= 100
        assert 2 <= r["peak_running"] < 4 and r["kv_bound_steps"] > 0 and not r["kv_fits"]
    if HAS_KV_DTYPE:
        assert [r["kv_cache_dtype"] for r in results] == ["float32", "float32", "float8_e4m3fn", "float8_e4m3fn"]
        assert results[0]["per_user"] and len(results[2]["ttft"]) == len(results[0]["ttft"])  # the same 4 requests
    assert set(args["kv_budgets"]) == {f"bf16 {k}" for k in kvs}
    out = capfd.readouterr().out
    for row in ("chunk steps (p50 / worst ms)", "compiles after capture (disk)", "KV pages peak used", "peak running"):
        assert row.split()[0] in out
    assert "does NOT fit 8 requests" in out and "requests waiting on KV pages" in out


def test_fp8_kv_without_the_build_keyword_is_refused_before_building(monkeypatch, capfd):
    def old_build(name, device="cpu", dtype=None, *, max_tokens=512, max_seqs=8, max_seq_len=4096, num_pages=None):
        raise AssertionError("must not build")

    monkeypatch.setattr(m3, "build_from_preset", old_build)
    with pytest.raises(SystemExit) as e:
        run(["--workload", "long", "--kv-dtype", "bf16,fp8"], monkeypatch)
    assert "takes no kv_dtype keyword" in str(e.value) and "--kv-dtype bf16" in str(e.value)


def test_an_unknown_kv_dtype_is_refused(monkeypatch):
    with pytest.raises(SystemExit) as e:
        run(["--kv-dtype", "fp16"], monkeypatch)
    assert "--kv-dtype 'fp16': a comma list of bf16 and fp8" in str(e.value)
