"""A small transformer that proves graphcap without MiniMax-M3: bare (``bare``: its own cache
and attention under a ``CaptureManager``) and on the generic runner (``model``)."""

from .config import ToyConfig
from .model import ToyModel, build_toy_runner

__all__ = ["ToyConfig", "ToyModel", "build_toy_runner"]
