"""MiniMax-M3 text backbone: config, layers, model, op table, loader, synthetic checkpoints, runner."""

from attention.metadata import TokenChunk

from .config import MiniMaxM3Config
from .model import MiniMaxM3ForCausalLM
from .runner import M3Runner, StepOutput, build_from_checkpoint, build_from_preset
from .weights import LoadReport, load_checkpoint

__all__ = [
    "LoadReport",
    "M3Runner",
    "MiniMaxM3Config",
    "MiniMaxM3ForCausalLM",
    "StepOutput",
    "TokenChunk",
    "build_from_checkpoint",
    "build_from_preset",
    "load_checkpoint",
]
