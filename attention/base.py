"""The attention backend interface: the splice points a model calls, and the capture hooks.

A backend plans once per step on the host (``plan(step, padding)``), then its ops launch
kernels only. The ops are the splice points, declared once here so their names and
graph-safety answers cannot drift between backends: ``dense`` and ``sparse`` call the
backend's ``_dense`` / ``_sparse`` and ask ``dense_graph_safe`` / ``sparse_graph_safe`` whether
a decode graph of a given padding may capture them. Every op writes into a
caller-owned ``out`` and returns ``None``.

Step metadata reaches the ops through one channel, the step context graphcap watches
(``self.meta`` / ``self.padding`` read ``graphcap.current_step()``): captured producer code that
reads them raises, naming the read.

Capture hooks, called by the runner before every (re)capture: ``init_capture(decode_sizes,
max_seqs)`` with the decode-graph sizes (flashinfer builds its graph-mode wrappers for exactly
those), ``warmup()`` (JIT builds before any capture; ``needs_jit`` says whether it builds
anything), ``before_jit()`` (the ops as they may run while ``warmup`` still builds, e.g. for
compiling Triton kernels ahead), and ``graph_tensors()``: every buffer a graph reads
(workspaces, indptr/indices buffers, the top-k buffer), registered with the manager so that
reallocating any of them invalidates the graphs. ``deterministic``: a step's kernels give
the same bits for the same inputs (graphcap's audits then compare bit for bit).

Adding a backend: subclass in its own module under ``attention/backends/`` and add it to
``attention.registry.BACKENDS``. Mix backends per layer kind with ``LayerSplit``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Iterator, Sequence

import torch

from graphcap import Padding, Step, current_padding, current_step, splice
from kvcache.paged import PagedKVCache

from .dims import AttentionDims
from .metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Base of every backend: the cache, the dims, the splice points and the capture hooks.

    Args:
        cache: the paged cache the ops read.
        dims: attention shapes (kv heads, head dim and block size must match the cache).

    Attributes:
        needs_jit: ``warmup`` builds kernels (JIT) the ops need before they can run.
        deterministic: the ops give the same bits for the same inputs (no atomics whose order
            varies, no data-dependent split choices).
    """

    needs_jit: bool = False
    deterministic: bool = True

    def __init__(self, cache: PagedKVCache, dims: AttentionDims) -> None:
        dims.check_cache(cache)
        self.cache = cache
        self.dims = dims

    # ---- per step ----------------------------------------------------------------------
    @abstractmethod
    def plan(self, step: Step, padding: Padding) -> None:
        """Host work for ``step`` run as ``padding``: fill persistent device buffers. Never captured."""

    @property
    def meta(self) -> AttentionMetadata:
        """This step's attention metadata (only inside a splice or ``plan``)."""
        meta = current_step("AttentionBackend.meta", skip_frames=1).metadata
        if not isinstance(meta, AttentionMetadata):
            raise RuntimeError(f"the step's metadata is a {type(meta).__name__}, not AttentionMetadata; build steps "
                               f"with the runner (make_step)")
        return meta

    @property
    def padding(self) -> Padding:
        """This step's padding decision (only inside a splice or ``plan``)."""
        return current_padding("AttentionBackend.padding", skip_frames=1)

    @property
    def uniform_decode(self) -> bool:
        """Whether this step is a uniform decode (one token per request)."""
        return current_step("AttentionBackend.uniform_decode", skip_frames=1).uniform_decode

    def check_plan(self, step: Step, padding: Padding) -> AttentionMetadata:
        """Checks every ``plan`` starts with; returns the step's metadata."""
        meta = step.metadata
        if not isinstance(meta, AttentionMetadata) or meta.block_tables is not self.cache.block_tables:
            raise ValueError("the step's metadata was not built for this backend's cache; build steps with the runner")
        if padding.rows > self.dims.max_tokens:
            raise ValueError(f"step runs {padding.rows} rows but the backend holds max_tokens={self.dims.max_tokens}")
        return meta

    # ---- splice points (declared once) ---------------------------------------------------
    @splice("attention.dense", graph_safe_decode=lambda self, padding: self.dense_graph_safe(padding))
    def dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """Causal GQA of dense layer ``layer``. q, out: ``[T, num_qo_heads, head_dim]``; rows of
        padding are left untouched or zeroed."""
        self._dense(layer, q, out)

    @splice("attention.sparse", graph_safe_decode=lambda self, padding: self.sparse_graph_safe(padding))
    def sparse(self, layer: int, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor) -> None:
        """Index top-k into the shared top-k buffer, then block-sparse GQA of sparse layer ``layer``.

        q, out: ``[T, num_qo_heads, head_dim]``; iq: ``[T, num_kv_heads, index_dim]``.
        """
        self._sparse(layer, q, iq, out)

    def _dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no dense attention; combine backends with LayerSplit")

    def _sparse(self, layer: int, q: torch.Tensor, iq: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no sparse attention; combine backends with LayerSplit")

    def dense_graph_safe(self, padding: Padding) -> bool:
        """Whether a decode graph of ``padding`` may capture ``dense`` (default: no)."""
        return False

    def sparse_graph_safe(self, padding: Padding) -> bool:
        """Whether a decode graph of ``padding`` may capture ``sparse`` (default: no)."""
        return False

    # ---- capture hooks -----------------------------------------------------------------
    def init_capture(self, decode_sizes: Sequence[int], max_seqs: int) -> None:
        """Prepare graph-mode state for decode graphs of these batch sizes (idempotent: state
        made for earlier calls stays valid, since graphs captured then still read it)."""

    def warmup(self) -> None:
        """Build and load every kernel the ops may launch (JIT), before any capture."""

    @contextlib.contextmanager
    def before_jit(self) -> Iterator[bool]:
        """Within the block the ops run as they can while ``warmup`` may still be building
        (another thread): yields True when they can run now, False when they need ``warmup``
        to finish first. A composite may serve a part by a JIT-free stand-in meanwhile (not
        for capture: the graph state stays the part's)."""
        yield not self.needs_jit

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """Every persistent device buffer a captured graph of these ops reads."""
        return {}

    def describe(self) -> str:
        """One line naming the backend (and its parts), for reports."""
        return type(self).__name__


def device_tensors(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """The CUDA tensor attributes of ``obj`` (a library wrapper's internal buffers), keyed
    ``prefix + name``: used by ``graph_tensors`` for objects whose buffers we do not name."""
    return {prefix + k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor) and v.device.type == "cuda"}


__all__ = ["AttentionBackend", "AttentionDims", "device_tensors"]
