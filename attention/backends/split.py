"""LayerSplit: one backend for dense layers and another for sparse layers, as one backend.

The composite owns no state: ``plan`` plans both parts, the splice points (declared once in
``AttentionBackend``) dispatch to the part's implementation, graph safety is the part's
answer, and the capture hooks and graph tensors are the union of both parts'.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from attention.backends.torch import TorchAttention
from attention.base import AttentionBackend
from graphcap import Padding, Step


class LayerSplit(AttentionBackend):
    """Dense layers run ``dense``'s attention, sparse layers ``sparse``'s (same cache and dims).

    Raises:
        ValueError: the parts read different caches or have different dims.
    """

    def __init__(self, dense: AttentionBackend, sparse: AttentionBackend) -> None:
        if dense.cache is not sparse.cache or dense.dims != sparse.dims:
            raise ValueError("LayerSplit parts must share one cache and one AttentionDims")
        super().__init__(dense.cache, dense.dims)
        self.dense_part, self.sparse_part = dense, sparse

    @contextmanager
    def dense_served_by(self, stand_in: AttentionBackend) -> Iterator[None]:
        """Within the block, dense layers run ``stand_in``'s attention (same cache and dims),
        e.g. a JIT-free one while the dense part's modules are still being built. Not for
        capture: the graph state and graph tensors stay the dense part's."""
        if stand_in.cache is not self.cache or stand_in.dims != self.dims:
            raise ValueError("the stand-in must read the split's cache with the split's dims")
        part = self.dense_part
        self.dense_part = stand_in
        try:
            yield
        finally:
            self.dense_part = part

    @property
    def needs_jit(self) -> bool:  # type: ignore[override]
        return self.dense_part.needs_jit or self.sparse_part.needs_jit

    @property
    def deterministic(self) -> bool:  # type: ignore[override]
        return self.dense_part.deterministic and self.sparse_part.deterministic

    @contextmanager
    def before_jit(self) -> Iterator[bool]:
        """Dense layers whose part needs its JIT run the torch reference meanwhile (the sparse
        part's kernels are what compile-ahead builds; they are the same either way)."""
        if self.sparse_part.needs_jit or not self.dense_part.needs_jit:
            yield not self.needs_jit
            return
        with self.dense_served_by(TorchAttention(self.cache, self.dims)):
            yield True

    @property
    def topk_buf(self) -> torch.Tensor:
        """The sparse part's shared top-k buffer."""
        return self.sparse_part.topk_buf  # type: ignore[attr-defined]

    def plan(self, step: Step, padding: Padding) -> None:
        self.dense_part.plan(step, padding)
        self.sparse_part.plan(step, padding)

    def _dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        self.dense_part._dense(layer, q, out)

    def _sparse(self, layer: int, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor) -> None:
        self.sparse_part._sparse(layer, q, iq, out)

    def dense_graph_safe(self, padding: Padding) -> bool:
        return self.dense_part.dense_graph_safe(padding)

    def sparse_graph_safe(self, padding: Padding) -> bool:
        return self.sparse_part.sparse_graph_safe(padding)

    def init_capture(self, decode_sizes: Sequence[int], max_seqs: int) -> None:
        self.dense_part.init_capture(decode_sizes, max_seqs)
        self.sparse_part.init_capture(decode_sizes, max_seqs)

    def warmup(self) -> None:
        self.dense_part.warmup()
        self.sparse_part.warmup()

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        return {**{f"dense.{k}": t for k, t in self.dense_part.graph_tensors().items()},
                **{f"sparse.{k}": t for k, t in self.sparse_part.graph_tensors().items()}}

    def describe(self) -> str:
        return f"LayerSplit(dense={self.dense_part.describe()}, sparse={self.sparse_part.describe()})"
