"""Vocab-parallel embedding lookup and logits: rank r holds vocab rows ``[r*V/W, (r+1)*V/W)``
of ``embed_tokens`` and ``lm_head``.

The lookup is masked (ids outside this rank's rows give zero rows) and summed over the ranks,
so each token's row comes from the one rank that holds it. The logits of each rank's rows are
gathered, so every rank samples from the full vocabulary (and, seeded alike, draws the same
tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .group import ParallelGroup


def embed(weight: torch.Tensor, ids: torch.Tensor, group: ParallelGroup,
          padded: torch.Tensor | None = None) -> torch.Tensor:
    """ids: int ``[T]`` global token ids; weight: this rank's rows ``[V/W, H]`` -> ``[T, H]``;
    padded: bool ``[T, 1]`` padding rows (``ParallelGroup.padded_rows``), zeroed."""
    if not group.distributed:
        return F.embedding(ids, weight)
    rows = weight.shape[0]
    local = ids - group.rank * rows
    zero = ((local < 0) | (local >= rows))[:, None]
    if padded is not None:
        zero |= padded
    out = F.embedding(local.clamp(0, rows - 1), weight)
    return group.all_reduce_(out.masked_fill_(zero, 0))  # one mask: other ranks' ids and padding


def logits(lm_head: torch.nn.Linear, hidden: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """hidden ``[N, H]`` -> full-vocabulary logits ``[N, V]`` on every rank."""
    return group.all_gather_last(lm_head(hidden))
