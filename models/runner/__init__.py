"""The generic model runner: requests, steps and graphcap over any ``RunnerModel`` on the
paged KV cache and an attention backend (``ModelRunner``), with its capture source
(``RunnerSource``: plan, dummy steps, start-up builds)."""

from .dummy_steps import capture_reserve
from .protocol import OpTable, RunnerModel
from .runner import ModelRunner, StepOutput

__all__ = ["ModelRunner", "OpTable", "RunnerModel", "StepOutput", "capture_reserve"]
