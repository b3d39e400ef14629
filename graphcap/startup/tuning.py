"""Validated kernel choices: a fast wrong kernel is never selected.

A tunable op offers several candidates (Triton configurations, split-K choices) for one
shape. ``KernelTuner.choose`` runs every candidate on a probe input and compares it with the
op's reference (plain torch, fp32 maths); a candidate that raises, writes a non-finite value
or differs beyond the tolerance is rejected and reported, and the fastest of the rest is
chosen. Choices are made once per (op, shape) on the host, before capture (warm-up), never
inside a graph, and kept for the report (``graphcap.report.choices_table``).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Mapping

import torch

from ..verify.compare import relative_error


@dataclass
class KernelChoice:
    """One (op, shape) decision: which candidate runs, how fast each passing one was (us,
    ``None`` when not timed), and why each rejected one failed."""

    op: str
    key: Hashable
    chosen: str
    timings_us: dict[str, float | None] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    cached: bool = False  # taken from the choice store (validated, not timed again)


class ChoiceStore:
    """Kernel choices on disk (``graphcap.startup.jit_cache.kernel_choices_file``), per namespace (the
    GPU and software versions), so a second start skips timing. A stored name is only a hint:
    the tuner validates it against the reference before using it. Other start-up records
    may share the file under their own entries (the M3 runner's "forward kernels|..." lists the
    graph keys whose kernels were compiled into this cache directory).

    Args:
        path: the JSON file (created on the first ``put``).
        namespace: e.g. ``"NVIDIA H200|torch 2.11|triton 3.6"``.
    """

    def __init__(self, path: Path, namespace: str) -> None:
        self.path, self.namespace = Path(path), namespace
        try:
            data = json.loads(self.path.read_text())
            self._choices: dict[str, str] = dict(data.get(namespace, {}))
        except (OSError, ValueError, AttributeError):
            self._choices = {}

    def get(self, entry: str) -> str | None:
        return self._choices.get(entry)

    def put(self, entry: str, name: str) -> None:
        """Record a choice and rewrite the file atomically (other namespaces are kept)."""
        self._choices[entry] = name
        try:
            data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            data = {}
        data[self.namespace] = self._choices
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache directory costs only the timing on the next start


class KernelTuner:
    """Chooses, validates and remembers kernel candidates per (op, shape key).

    Args:
        time_candidates: time the passing candidates (CUDA events) and pick the fastest; when
            False (CPU, the interpreter) the first passing candidate is chosen.
        iters: timed runs per candidate (median).
        store: timed choices persisted across processes (``ChoiceStore``); ``None``: none.
    """

    def __init__(self, time_candidates: bool, iters: int = 10, store: ChoiceStore | None = None) -> None:
        self.time_candidates = time_candidates
        self.iters = iters
        self.store = store
        self.choices: dict[tuple[str, Hashable], KernelChoice] = {}

    def get(self, op: str, key: Hashable) -> str | None:
        """The chosen candidate's name, or ``None`` if no choice was made yet."""
        choice = self.choices.get((op, key))
        return None if choice is None else choice.chosen

    def choose(self, op: str, key: Hashable, candidates: Mapping[str, Callable[[], torch.Tensor]],
               reference: Callable[[], torch.Tensor], tol: float, signature: str = "",
               timed: Mapping[str, Callable[[], object]] | None = None, calls_per_timed: int = 1) -> str:
        """Validate every candidate against ``reference`` on its probe input, pick the fastest
        passing one (in ``candidates`` order when not timing), remember and return its name.

        Each callable runs the op on the same probe input and returns the output tensor. With a
        store, a stored choice for ``(op, key, signature)`` (``signature``: the shapes and
        dtypes the key leaves out) is validated alone and used when it passes.

        ``timed[name]``, where given, is what is timed for a validated candidate in place of
        ``candidates[name]``: ``calls_per_timed`` calls of the same kernel, e.g. over several
        layers' weights, so that an op whose one weight fits in L2 is timed reading from HBM
        as the model runs it (timings are per call).

        Raises:
            RuntimeError: no candidate matches the reference (the op cannot run correctly).
        """
        if (op, key) in self.choices:
            return self.choices[(op, key)].chosen
        want = reference().detach().clone()
        entry = f"{op}|{key!r}|{signature}"
        stored = self.store.get(entry) if self.store is not None and self.time_candidates else None
        choice = KernelChoice(op, key, chosen="")
        if stored in candidates and self._passes(stored, candidates[stored], want, tol, choice):
            choice.chosen, choice.cached, choice.timings_us[stored] = stored, True, None
            self.choices[(op, key)] = choice
            return stored
        passing = [name for name, run in candidates.items()
                   if name not in choice.rejected and self._passes(name, run, want, tol, choice)]
        if not passing:
            raise RuntimeError(f"no candidate of {op} for {key!r} matches the reference: {choice.rejected}")
        if calls_per_timed < 1:
            raise ValueError(f"calls_per_timed must be >= 1, got {calls_per_timed}")
        for name in passing:
            run = (timed or {}).get(name, candidates[name])
            calls = calls_per_timed if timed is not None and name in timed else 1
            choice.timings_us[name] = (
                self._time(run) / calls if self.time_candidates and len(passing) > 1 else None
            )
        timed = {n: t for n, t in choice.timings_us.items() if t is not None}
        choice.chosen = min(timed, key=timed.__getitem__) if timed else passing[0]
        self.choices[(op, key)] = choice
        if self.store is not None and self.time_candidates:
            self.store.put(entry, choice.chosen)
        return choice.chosen

    @staticmethod
    def _passes(name: str, run: Callable[[], torch.Tensor], want: torch.Tensor, tol: float,
                choice: KernelChoice) -> bool:
        """Run one candidate and check it against the reference output; a failure is recorded
        in ``choice.rejected``."""
        try:
            got = run()
        except Exception as e:  # a candidate that cannot run is rejected, not fatal
            choice.rejected[name] = f"raised {type(e).__name__}: {str(e)[:200]}"
            return False
        if got.shape != want.shape:
            choice.rejected[name] = f"output shape {tuple(got.shape)} != reference {tuple(want.shape)}"
        elif not torch.isfinite(got).all():
            choice.rejected[name] = "non-finite output"
        else:
            err = relative_error(got.float(), want.float())
            if err <= tol:
                return True
            choice.rejected[name] = f"relative error {err:.3g} > {tol:g} against the reference"
        return False

    def _time(self, run: Callable[[], object]) -> float:
        """Median GPU time of ``run`` in us, from CUDA-graph replays (the way the candidate will
        run: timing eager launches would rank small-shape candidates by their host overhead);
        eager launches when the candidate cannot be captured."""
        run()
        torch.cuda.synchronize()
        graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()  # allocator warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                run()
        except RuntimeError:
            graph = None
        times = []
        for _ in range(self.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay() if graph is not None else run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        del graph
        return statistics.median(times)
