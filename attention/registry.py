"""Which attention backend to build: the registry of kinds and ``make_backend``.

Kinds resolve lazily (``"module:Class"`` or a builder function), so a backend whose
dependencies are missing only fails when asked for. ``"auto"`` picks the fastest kind that
works on the cache's device and records why it skipped the others (``AutoChoice.skipped``).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

from kvcache.paged import PagedKVCache

from .base import AttentionBackend
from .dims import AttentionDims


def _flashinfer_split(cache: PagedKVCache, dims: AttentionDims,
                      prefill_attention: str = "blocks") -> AttentionBackend:
    """flashinfer for the dense layers, Triton for the sparse ones."""
    from .backends.flashinfer import FlashinferAttention
    from .backends.split import LayerSplit
    from .backends.triton import TritonAttention

    return LayerSplit(dense=FlashinferAttention(cache, dims),
                      sparse=TritonAttention(cache, dims, prefill_attention=prefill_attention))


def _triton_prefill(cache: PagedKVCache, dims: AttentionDims, prefill_attention: str) -> AttentionBackend:
    from .backends.triton import TritonAttention

    return TritonAttention(cache, dims, prefill_attention=prefill_attention)


# kind -> "module:Class" or a builder ``(cache, dims) -> backend``. The registration point.
BACKENDS: dict[str, str | Callable[[PagedKVCache, AttentionDims], AttentionBackend]] = {
    "torch": "attention.backends.torch:TorchAttention",
    "triton": "attention.backends.triton:TritonAttention",
    "flashinfer": _flashinfer_split,
    # prefill sparse attention in token tiles (TritonAttention's module docstring: faster when
    # neighbouring tokens select the same blocks, slower when they do not)
    "triton_tiles": functools.partial(_triton_prefill, prefill_attention="tiles"),
    "flashinfer_tiles": functools.partial(_flashinfer_split, prefill_attention="tiles"),
    # prefill sparse attention one token per program (the default before the block-major
    # kernel, attention.kernels.sparse_blocks)
    "triton_per_token": functools.partial(_triton_prefill, prefill_attention="per_token"),
    "flashinfer_per_token": functools.partial(_flashinfer_split, prefill_attention="per_token"),
}
# What "auto" tries on a CUDA cache, in order; "torch" otherwise.
AUTO_ORDER: tuple[str, ...] = ("flashinfer", "triton")


@dataclass(frozen=True)
class AutoChoice:
    """What ``make_backend("auto")`` chose and why it skipped the kinds before it."""

    kind: str
    skipped: dict[str, str]


def make_backend(kind: str, cache: PagedKVCache, dims: AttentionDims) -> AttentionBackend:
    """Build the backend ``kind`` (a key of ``BACKENDS``, or ``"auto"``) for ``cache``.

    ``"auto"`` builds the first of ``AUTO_ORDER`` that imports and accepts a CUDA cache, else
    ``"torch"``; the result carries ``auto_choice`` (an ``AutoChoice`` naming each skipped kind
    and its error).

    Raises:
        ValueError: unknown kind.
        RuntimeError: the backend's module could not be imported.
    """
    if kind == "auto":
        skipped: dict[str, str] = {}
        if cache.block_tables.device.type == "cuda":
            for k in AUTO_ORDER:
                try:
                    backend = _resolve(k)(cache, dims)
                except (ImportError, RuntimeError, ValueError) as e:  # missing, or cannot serve this cache
                    skipped[k] = str(e)
                    continue
                backend.auto_choice = AutoChoice(k, skipped)  # type: ignore[attr-defined]
                return backend
        else:
            skipped = {k: f"needs a CUDA cache, the cache is on {cache.block_tables.device}" for k in AUTO_ORDER}
        backend = _resolve("torch")(cache, dims)
        backend.auto_choice = AutoChoice("torch", skipped)  # type: ignore[attr-defined]
        return backend
    if kind not in BACKENDS:
        raise ValueError(f"unknown attention backend {kind!r}; choose one of {sorted(BACKENDS) + ['auto']}")
    return _resolve(kind)(cache, dims)


def _resolve(kind: str) -> Callable[[PagedKVCache, AttentionDims], AttentionBackend]:
    target = BACKENDS[kind]
    if callable(target):
        return target
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"attention backend {kind!r} ({target}) is unavailable: {e}") from e
