"""Validated kernel choices: a candidate that is wrong, non-finite or raises is never chosen."""

import pytest
import torch

from graphcap.startup.tuning import KernelTuner


def test_bad_candidates_are_rejected_and_reported():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    ref = lambda: x.square()  # noqa: E731
    cands = {
        "corrupt": lambda: x.square() * 1.01,  # fast and wrong: 1% off
        "nan": lambda: x.square().index_fill(0, torch.tensor([3]), float("nan")),
        "raises": lambda: (_ for _ in ()).throw(RuntimeError("out of shared memory")),
        "shape": lambda: x.square()[1:],
        "good": lambda: x * x,
    }
    tuner = KernelTuner(time_candidates=False)
    assert tuner.choose("square", 64, cands, ref, tol=1e-5) == "good"
    choice = tuner.choices[("square", 64)]
    assert set(choice.rejected) == {"corrupt", "nan", "raises", "shape"}
    assert "relative error" in choice.rejected["corrupt"] and "non-finite" in choice.rejected["nan"]
    assert "out of shared memory" in choice.rejected["raises"] and "shape" in choice.rejected["shape"]
    calls = []
    assert tuner.choose("square", 64, {"other": lambda: calls.append(1) or x}, ref, 1e-5) == "good"  # remembered
    assert not calls and tuner.get("square", 64) == "good" and tuner.get("square", 65) is None


def test_no_valid_candidate_raises():
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="no candidate of op for 4 matches the reference"):
        KernelTuner(time_candidates=False).choose("op", 4, {"bad": lambda: x + 1}, lambda: x, 1e-3)


def test_timed_runs_replace_the_candidate_when_timing(monkeypatch):
    """``timed`` is what is timed (e.g. the op over several layers' weights), divided by its
    calls; validation still runs the candidate itself."""
    ran: list[str] = []
    monkeypatch.setattr(KernelTuner, "_time", lambda self, run: (run(), 40.0)[1])
    x = torch.randn(8)
    cands = {"a": lambda: ran.append("a") or x * 2, "b": lambda: ran.append("b") or x + x}
    timed = {"a": lambda: ran.append("a x4")}
    tuner = KernelTuner(time_candidates=True)
    assert tuner.choose("op", 8, cands, lambda: x * 2, 1e-6, timed=timed, calls_per_timed=4) == "a"
    assert ran == ["a", "b", "a x4", "b"]  # validated as themselves, "a" timed through its timed run
    assert tuner.choices[("op", 8)].timings_us == {"a": 10.0, "b": 40.0}
    with pytest.raises(ValueError, match="calls_per_timed"):
        tuner.choose("op", 9, cands, lambda: x * 2, 1e-6, timed=timed, calls_per_timed=0)


@pytest.mark.cuda
def test_fastest_passing_candidate_wins_on_gpu():
    x = torch.randn(4096, 4096, device="cuda")
    slow = lambda: (x @ x.T + x @ x.T) / 2  # noqa: E731
    fast = lambda: x @ x.T  # noqa: E731
    wrong = lambda: x @ x.T * 0  # faster still, and wrong  # noqa: E731
    tuner = KernelTuner(time_candidates=True, iters=3)
    assert tuner.choose("mm", 4096, {"slow": slow, "wrong": wrong, "fast": fast}, fast, 1e-3) == "fast"
    c = tuner.choices[("mm", 4096)]
    assert "wrong" in c.rejected and c.timings_us["fast"] < c.timings_us["slow"]


def test_stored_choices_skip_timing_but_are_still_validated(tmp_path, monkeypatch):
    """A second process reads the timed choice from the store, checks it against the
    reference and uses it without timing; a stored choice that is now wrong is re-tuned."""
    from graphcap.startup.tuning import ChoiceStore

    timed = []
    monkeypatch.setattr(KernelTuner, "_time", lambda self, run: timed.append(run) or float(len(timed)))
    x = torch.randn(8)
    ref = lambda: x * 2  # noqa: E731
    path = tmp_path / "choices.json"
    first = KernelTuner(time_candidates=True, store=ChoiceStore(path, "gpu A"))
    assert first.choose("op", 8, {"a": lambda: x * 2, "b": lambda: x + x}, ref, 1e-6, signature="H64") == "a"
    assert len(timed) == 2 and path.exists()
    second = KernelTuner(time_candidates=True, store=ChoiceStore(path, "gpu A"))
    assert second.choose("op", 8, {"a": lambda: x * 2, "b": lambda: x + x}, ref, 1e-6, signature="H64") == "a"
    assert len(timed) == 2 and second.choices[("op", 8)].cached  # validated, not timed
    other_gpu = KernelTuner(time_candidates=True, store=ChoiceStore(path, "gpu B"))
    other_gpu.choose("op", 8, {"a": lambda: x * 2, "b": lambda: x + x}, ref, 1e-6, signature="H64")
    assert len(timed) == 4  # another namespace tunes again
    broken = KernelTuner(time_candidates=True, store=ChoiceStore(path, "gpu A"))
    assert broken.choose("op", 8, {"a": lambda: x * 3, "b": lambda: x + x}, ref, 1e-6, signature="H64") == "b"
    assert "relative error" in broken.choices[("op", 8)].rejected["a"]
