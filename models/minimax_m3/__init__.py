"""MiniMax-M3 text backbone: config, layers, model, op table and its kernels, loader,
synthetic checkpoints, and the builders of a ``models.runner.ModelRunner`` over it."""

from common.deprecation import module_aliases

from .build import build_from_checkpoint, build_from_preset
from .config import MiniMaxM3Config
from .model import MiniMaxM3ForCausalLM
from .weights import LoadReport, load_checkpoint

__all__ = [
    "LoadReport",
    "MiniMaxM3Config",
    "MiniMaxM3ForCausalLM",
    "build_from_checkpoint",
    "build_from_preset",
    "load_checkpoint",
]


def _model_runner() -> type:
    from models.runner import ModelRunner

    return ModelRunner


def _step_output() -> type:
    from models.runner import StepOutput

    return StepOutput


def _token_chunk() -> type:
    from steps import TokenChunk

    return TokenChunk


# Spellings of the previous release, served with a warning.
__getattr__ = module_aliases(__name__, {
    "M3Runner": ("models.runner.ModelRunner", _model_runner),
    "StepOutput": ("models.runner.StepOutput", _step_output),
    "TokenChunk": ("steps.TokenChunk", _token_chunk),
})
