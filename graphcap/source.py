"""CaptureSource: the one object a ``CaptureManager`` asks for what only the model side knows.

The manager owns the mechanism (which graph a step runs as, padding, capture, replay,
invalidation, checks); the source owns the policy for its model:

- ``plan(step, padding)``: the host plan of one step for the manager's padding decision
  (attention metadata into persistent device buffers, kernel choices for ``padding.rows``),
  before every warm-up, capture, replay and eager run; never captured;
- ``dummy_step(key, purpose)``: a step for graph ``key``, built for one ``Purpose`` (capture,
  validation, frozen-value check: each on other data);
- ``release_dummies()``: free what the dummy steps hold (the manager calls it after each of
  its dummy runs, also when they fail);
- ``prebuild(keys)``: a context manager around every build before warm-up (JIT modules,
  kernel choices); inside it the manager compiles ahead the forward kernels of the keys the
  yielded ``Prebuild`` lists.

Nothing here reads the manager back: what a source needs to know arrives as arguments (the
graph keys, the padding decision with its ``graph_size``).
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Iterator, Sequence

from .buckets import GraphKey, Padding
from .splice import Step


class Purpose(str, enum.Enum):
    """What a dummy step is for; each purpose runs on its own data.

    - ``CAPTURE``: warm-up and capture (the data a graph is recorded on);
    - ``VALIDATE``: replay vs eager after capture: other tokens, positions and requests, every
      row real (graph and eager then run the same shapes and must agree to rounding);
    - ``FROZEN_CHECK``: frozen-value detection: other data again, with fewer real tokens where
      the key allows, so that a host value of the step baked into a graph differs from the
      capture's.
    """

    CAPTURE = "capture"
    VALIDATE = "validate"
    FROZEN_CHECK = "frozen_check"


@dataclass(frozen=True)
class Prebuild:
    """What the manager does inside ``CaptureSource.prebuild``.

    Attributes:
        compile_forward: graph keys whose forward the manager runs once on its dummy step with
            Triton launches compiled instead of run (``graphcap.startup.compile_ahead``), many
            at once; empty: kernels compile on their first launch in warm-up.
        workers: compile threads for that pass.
    """

    compile_forward: tuple[GraphKey, ...] = ()
    workers: int = 0


class CaptureSource:
    """Base of every capture source: override ``dummy_step`` (needed for any capture) and the
    hooks the model has. The defaults plan nothing, hold nothing and prebuild nothing.

    ``audit_tolerance``: the relative error an audit allows between a replay and the padded
    eager run of the same step; 0 asks for bit-identical outputs (every kernel deterministic).
    """

    audit_tolerance: float = 0.0

    def plan(self, step: Step, padding: Padding) -> None:
        """Host work for ``step`` run as ``padding`` (see the module docstring)."""

    def dummy_step(self, key: GraphKey, purpose: Purpose) -> Step:
        """A step for graph ``key`` (``key.rows`` tokens; one per request for a decode graph),
        built for ``purpose``. Whatever it holds lives until the next ``dummy_step`` or
        ``release_dummies``."""
        raise NotImplementedError(f"{type(self).__name__} builds no dummy steps; override dummy_step to capture")

    def release_dummies(self) -> None:
        """Free what the dummy steps hold (requests, cache rows)."""

    @contextlib.contextmanager
    def prebuild(self, keys: Sequence[GraphKey]) -> Iterator[Prebuild]:
        """Every build before warm-up and capture of ``keys``; yields what the manager compiles
        inside the block (nothing by default)."""
        yield Prebuild()


__all__ = ["CaptureSource", "Prebuild", "Purpose"]
