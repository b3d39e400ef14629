"""TokenChunk (one request's tokens for one step) and TokenFeed (device-resident token ids)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from common.values import as_int, integer_items


@dataclass(frozen=True)
class TokenChunk:
    """One request's tokens for one step: ``token_ids`` at positions ``start_pos ...``.

    ``start_pos`` must continue the sequence: it equals the positions already written for it
    (the runner's ``num_written(seq_id)``), so attention never reads a position this request
    did not write. To rewrite earlier positions (e.g. drop rejected speculative tokens), rewind
    the sequence first (the runner's ``rewind_request``). A decode request is a chunk of one
    token.

    Attributes:
        seq_id: the request (added with the runner's ``add_request``).
        start_pos: first position of this chunk (any integer type; stored as int).
        token_ids: the chunk's token ids (any integer sequence; stored as a tuple of ints).
    """

    seq_id: Hashable
    start_pos: int
    token_ids: Sequence[int]

    def __post_init__(self) -> None:
        start = as_int(self.start_pos)
        if start is None or start < 0:
            raise ValueError(f"request {self.seq_id!r}: start_pos must be an integer >= 0, got {self.start_pos!r}")
        ids = integer_items(f"request {self.seq_id!r}: token_ids", self.token_ids, "integer token id")
        if not ids:
            raise ValueError(f"request {self.seq_id!r}: a chunk needs at least one token")
        object.__setattr__(self, "start_pos", start)
        object.__setattr__(self, "token_ids", ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        """One past the chunk's last position: the context length after this step."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class TokenFeed:
    """Token ids of a step that live on the device (e.g. the previous step's sampled tokens,
    fed without a round trip to the host): rows ``rows`` of the step's flattened tokens take
    ``tokens``; the chunks hold placeholders there.

    Attributes:
        rows: flat token rows of the step (in chunk order), each once.
        tokens: ``int64 [len(rows)]`` on the step's device.
    """

    rows: tuple[int, ...]
    tokens: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(self.rows))
        if self.tokens.dim() != 1 or self.tokens.shape[0] != len(self.rows) or self.tokens.dtype != torch.int64:
            raise ValueError(f"TokenFeed.tokens must be int64 [{len(self.rows)}] (one per row), got "
                             f"{self.tokens.dtype} {tuple(self.tokens.shape)}")
        if len(set(self.rows)) != len(self.rows):
            raise ValueError(f"TokenFeed.rows must be distinct, got {self.rows}")


__all__ = ["TokenChunk", "TokenFeed"]
