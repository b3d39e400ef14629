"""Where JIT builds and kernel choices are cached, so a second start on a machine is warm.

One directory, ``$GRAPHCAP_CACHE_DIR`` (default ``~/.cache/graphcap``), holds:

- ``triton/``: Triton's compiled kernels (``TRITON_CACHE_DIR``);
- ``flashinfer/``: flashinfer's JIT-built modules (``FLASHINFER_WORKSPACE_BASE``; flashinfer
  reads it when it is imported, so ``configure`` runs before graphcap imports flashinfer);
- ``kernel_choices.json``: ``graphcap.startup.tuning.KernelTuner`` choices per GPU and software
  versions (a cached choice is still validated against the reference before it is used), and
  which graph keys' forward kernels were compiled into this directory (a warm start skips
  compiling them ahead).

A variable the user already set wins. Prebuild the caches for a deployment by running one
capture of the same shapes (``examples/prebuild_caches.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "GRAPHCAP_CACHE_DIR"


def cache_dir() -> Path:
    """The cache directory (not created)."""
    raw = os.environ.get(ENV, "").strip()
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "graphcap"


def configure() -> Path:
    """Point Triton's and flashinfer's caches into ``cache_dir()`` unless the user set them
    (idempotent; call before the first Triton compile and the flashinfer import). Returns the
    directory."""
    root = cache_dir()
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(root / "flashinfer"))
    return root


def kernel_choices_file() -> Path:
    return cache_dir() / "kernel_choices.json"
