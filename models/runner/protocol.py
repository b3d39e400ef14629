"""What the generic ``ModelRunner`` needs from a model: the ``RunnerModel`` protocol and the
op table's start-up hooks (``OpTable``).

A model on the runner reads its per-token inputs, its weights, the paged KV cache and the
attention splice points (the backend it is attached to), and nothing else; the runner owns
the requests, the steps, graphcap and start-up.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from attention.base import AttentionBackend
from distributed import ParallelGroup
from graphcap.splice_buffers import SpliceBuffers
from graphcap.startup.tuning import KernelTuner
from kvcache.paged import PagedKVCache


class OpTable:
    """The part of a model's producer op table the runner drives at start-up. The hooks do
    nothing here: a model without tunable kernels subclasses this and sets the attributes.

    Attributes:
        name: shown in reports (``"torch"``, ``"triton"``...).
        tuner: the validated kernel tuner whose choice store the runner also keeps its start-up
            record in (``None``: no tuned kernels, no record).
    """

    # Annotations only (no class defaults), so that dataclass op tables declare them as fields.
    name: str
    tuner: KernelTuner | None

    def choose_kernels(self, model: torch.nn.Module, num_tokens: int, tune: bool = True) -> None:
        """Kernel choices for a forward of ``num_tokens`` rows (host work, never captured);
        ``tune``: time the candidates (a graph size), else validate a default only."""

    def compile_kernels(self, model: torch.nn.Module, num_tokens: int) -> None:
        """Launch every candidate kernel for ``num_tokens`` rows on a probe, for
        ``graphcap.startup.compile_ahead`` (the launches compile only, many at once)."""


@runtime_checkable
class RunnerModel(Protocol):
    """A model the ``ModelRunner`` can run (``models.minimax_m3.MiniMaxM3ForCausalLM`` and
    ``models.toy.ToyModel`` are).

    Attributes:
        config: the model's frozen config (its ``repr`` is part of the start-up record's key).
        ops: the producer op table (``OpTable`` hooks).
        group: the ranks the model is sharded over (``ParallelGroup.single`` when not).
        splice_buffers: the activations that cross splice points, allocated by ``attach``.
        vocab_size: token ids lie in ``[0, vocab_size)``; logits have that many columns.
    """

    config: Any
    ops: OpTable
    group: ParallelGroup
    splice_buffers: SpliceBuffers | None

    @property
    def vocab_size(self) -> int: ...

    def attach(self, cache: PagedKVCache, backend: AttentionBackend) -> None:
        """Use ``cache`` and ``backend`` (checked against the config once)."""

    def hidden_states(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``input_ids``, ``positions``, ``slot_mapping`` ``[T]`` and ``num_real_tokens`` ->
        ``[T, hidden]`` (what graphcap captures)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab_size]``."""

    def parameters(self) -> Any: ...


__all__ = ["OpTable", "RunnerModel"]
