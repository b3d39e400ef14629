"""EagerPath: one step run eagerly through the splice path, padded or at its own size.

Warm-up, debug-eager runs, fallbacks above the ceiling, validation's reference and audits all
run a step this way; a replay differs only in the last part (the graph instead of the forward).
"""

from __future__ import annotations

from typing import Any

import torch

from .buckets import Padding
from .guard import CaptureGuard
from .segments import EagerDriver, Forward, run_eager
from .source import CaptureSource
from .splice import Step, step_context
from .static import StaticInputs


class EagerPath:
    """The eager ways of running a step of ``forward`` on ``inputs``, planned by ``source``.

    Args:
        forward, inputs: the manager's forward and static inputs.
        source: plans each step (``None``: nothing to plan).
        guard_producers: check producer ops in guarded runs (``CaptureConfig.guard_producers``).
    """

    def __init__(self, forward: Forward, inputs: StaticInputs, source: CaptureSource | None,
                 guard_producers: bool) -> None:
        self.forward, self.inputs, self.source = forward, inputs, source
        self.guard_producers = guard_producers

    def plan(self, step: Step, padding: Padding) -> None:
        """The source's host plan, under the step context (its reads of the step are allowed)."""
        if self.source is not None:
            with step_context(step, padding):
                self.source.plan(step, padding)

    def staged(self, step: Step, padding: Padding) -> dict[str, torch.Tensor]:
        """The host plan and the copy-in of a padded run: the views the forward (or a graph
        recorded on them) reads."""
        self.plan(step, padding)
        return self.inputs.copy_in(step.inputs, padding)

    def padded(self, step: Step, padding: Padding, guard: bool) -> tuple[Any, EagerDriver]:
        """Plan, copy in and run the forward on ``padding.rows`` rows; ``guard``: producer code
        is checked as in a capture (and may not read the step)."""
        views = self.staged(step, padding)
        checker = CaptureGuard(self.inputs.device) if guard and self.guard_producers else None
        return run_eager(self.forward, views, step, padding, checker, capturing=guard)

    def again(self, step: Step, padding: Padding) -> tuple[Any, EagerDriver]:
        """The forward once more on the views already staged for ``step`` (its plan and static
        inputs are still in place after a replay)."""
        return run_eager(self.forward, self.inputs.views(padding.rows), step, padding, None)

    def unpadded(self, step: Step, padding: Padding | None = None) -> Any:
        """``step`` at its own size (no padding, no guard)."""
        padding = padding or Padding.unpadded(step.num_tokens, step.num_seqs)
        self.plan(step, padding)
        out, _ = run_eager(self.forward, self.inputs.eager_inputs(step.inputs, step.num_tokens), step, padding, None)
        return out


__all__ = ["EagerPath"]
