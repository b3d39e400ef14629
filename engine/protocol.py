"""What the serving engine needs from a model runner (``models.runner.ModelRunner`` has it).

The engine is model-agnostic: it schedules requests and samples tokens; a runner owns the
model, the KV cache and graphcap. Every step goes through ``run_chunks``, which must not sync
the host with the device, so that the engine can prepare the next step while this one runs.
"""

from __future__ import annotations

from typing import Any, Hashable, Protocol, Sequence, runtime_checkable

import torch

from steps import TokenChunk, TokenFeed


@runtime_checkable
class StepRunner(Protocol):
    """A model runner the engine drives.

    Attributes:
        max_tokens: token capacity of one step.
        max_seqs: request capacity of one step.
        page_size: positions per KV page.
        max_seq_len: most positions one request holds.
        num_pages: KV pages requests may hold.
        max_live_requests: requests that may hold a cache row at once (step capacity plus the
            headroom for finished requests not yet freed).
        vocab_size: token ids lie in ``[0, vocab_size)``.
        device: where logits and token ids live.
    """

    max_tokens: int
    max_seqs: int
    device: torch.device

    @property
    def page_size(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def num_pages(self) -> int: ...

    @property
    def max_live_requests(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def add_request(self, seq_id: Hashable) -> None:
        """Give a request a cache row (its first chunk starts at position 0)."""

    def free_request(self, seq_id: Hashable) -> None:
        """Return the request's pages and row."""

    def num_written(self, seq_id: Hashable) -> int:
        """Positions written for the request (its next chunk's ``start_pos``)."""

    def check(self, chunks: Sequence[TokenChunk]) -> None:
        """Raise the error running ``chunks`` would raise, changing nothing."""

    def run_chunks(self, chunks: Sequence[TokenChunk], feed: TokenFeed | None = None,
                   commit: bool = True) -> torch.Tensor:
        """Queue one step on the device without a host sync; ``[len(chunks), vocab]`` logits of
        each chunk's last token. ``feed`` gives rows whose token ids live on the device;
        ``commit=False`` leaves the written lengths (a reference run of a step that runs again)."""

    def compiles_after_capture(self, start: int = 0) -> Sequence[Any] | None:
        """Kernel compiles since the runner's capture returned, from the ``start``-th on
        (``None``: the runner counts none, e.g. it was never captured). Each has ``kernel``
        (a name), ``key`` (its specialization), ``cached`` (loaded from a disk cache rather
        than built) and ``seconds``: ``graphcap.startup.compile_counter.CompileEvent``."""


__all__ = ["StepRunner"]
