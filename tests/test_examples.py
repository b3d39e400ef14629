"""The examples as a newcomer runs them (CPU, tiny preset): the one flag and every GRAPHCAP_*
setting reach them, argument mistakes are argparse errors naming the option, and the output
says what a CPU run shows (no graphs) without the profiler's log lines or cut notes."""

import json
import runpy
from pathlib import Path

import pytest
from rich.console import Console

from graphcap import CaptureConfig, CaptureManager, GraphKey
from graphcap.report import stats_table
from models.toy.bare import ToySource, ToyTransformer, toy_static_inputs
from models.toy.config import ToyConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", [name, *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_profile_forward_on_cpu_says_no_graphs_and_leaks_no_profiler_lines(monkeypatch, capfd):
    run_example("profile_forward.py", ["--decode", "1,2", "--context", "16", "--iters", "1"], monkeypatch)
    out, err = capfd.readouterr()
    assert "of aten ops in producer segments" in out and "no graphs" in out
    assert "of aten ops in graphs" not in out
    assert "USDT" not in out + err and "profiler_start" not in out + err


def test_profile_forward_honours_the_environment(monkeypatch, capfd, tmp_path):
    monkeypatch.setenv("GRAPHCAP_ENABLED", "0")
    path = tmp_path / "p.json"
    run_example("profile_forward.py", ["--decode", "1", "--context", "8", "--iters", "1", "--json", str(path)],
                monkeypatch)
    graphs = json.loads(path.read_text())["graphs"]
    assert graphs == {}  # GRAPHCAP_ENABLED=0: the "graphed" runner ran every step eagerly, so no graph was used


def test_profile_forward_prints_the_expert_spread_of_a_simulated_routing(monkeypatch, capfd, tmp_path):
    path = tmp_path / "p.json"
    run_example("profile_forward.py", ["--decode", "1", "--context", "8", "--iters", "1", "--routing", "balanced",
                                       "--json", str(path)], monkeypatch)
    assert "expert spread (balanced routing, decode 2" in capfd.readouterr().out  # max_seqs = 1 + 1
    assert json.loads(path.read_text())["expert_spread"]["routing"] == "balanced"


def test_serve_sim_runs_the_mode_the_environment_names_beside_decode(monkeypatch, capfd, tmp_path):
    monkeypatch.setenv("GRAPHCAP_MODE", "piecewise")
    monkeypatch.setenv("GRAPHCAP_AUDIT_EVERY", "2")
    path = tmp_path / "s.json"
    run_example("serve_sim.py", ["--requests", "4", "--concurrency", "2", "--prompt-len", "8:16", "--output-len", "3:4",
                                 "--json", str(path)], monkeypatch)
    results = json.loads(path.read_text())["results"]
    assert [r["mode"] for r in results] == ["decode+audit2", "piecewise+audit2"]
    assert results[1]["audits"] > 0 and results[1]["audit_mismatches"] == 0
    out = capfd.readouterr().out
    assert "finished / failed" in out and "4 / 0" in out
    assert "expert spread (model routing, decode 2" in out  # capped by the concurrency
    assert json.loads(path.read_text())["args"]["expert_spread"]["tokens"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "argument --concurrency: 0 must be >= 1"),
    (["--prompt-len", "abc"], "argument --prompt-len: 'abc' is not LO:HI token counts"),
    (["--output-len", "9:3"], "argument --output-len: '9:3': need 1 <= LO <= HI"),
    (["--audit-every", "-5"], "argument --audit-every: -5 must be >= 0"),
])
def test_serve_sim_argument_mistakes_are_argparse_errors(argv, message, monkeypatch, capfd):
    with pytest.raises(SystemExit) as e:
        run_example("serve_sim.py", argv, monkeypatch)
    assert e.value.code == 2 and message in capfd.readouterr().err


def test_serve_sim_plot_title_says_what_a_cpu_run_shows():
    ns = runpy.run_path(str(EXAMPLES / "serve_sim.py"))
    assert ns["plot_title"]("tiny, 24 requests", cuda=False).endswith("CPU: debug-eager, the wiring, not speed")
    assert ns["plot_title"]("tiny, 24 requests", cuda=True) == "tiny, 24 requests"


def test_the_stats_table_keeps_whole_notes():
    cfg = ToyConfig(num_layers=1, hidden=32, num_heads=4, vocab=64, max_seqs=4, max_len=32, max_tokens=8)
    model = ToyTransformer(cfg)
    manager = CaptureManager(model.forward, toy_static_inputs(cfg, "cpu"), CaptureConfig(enabled=True, max_tokens=8),
                             ToySource(model))
    reason = "splices not graph-safe for decode: attention.dense, attention.sparse (and a long tail here)"
    manager.table.drop(GraphKey(8, True), reason)
    console = Console(width=400, record=True)
    console.print(stats_table(manager))
    assert reason in console.export_text()
