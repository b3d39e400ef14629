"""Programmatic dependent launch (PDL) for the small kernels of a decode step.

A decode step at rank-of-8 runs ~13 kernels a layer of a few microseconds each, and in a CUDA
graph each still waits for the one before it to finish, drain and signal completion before its
own programs are dispatched. Launched with PDL (Hopper and later), a kernel's programs are
dispatched while the kernel before it still runs, and wait in ``griddepcontrol.wait`` until it
has completed and its writes are visible; the dispatch and the kernel's start overlap the tail
of the one before. The edges are kept when the stream is captured into a graph.

The rule, in one place: a kernel that takes the ``PDL`` constexpr calls :func:`grid_dependency`
before its first load or store, and only such a kernel is launched with ``**pdl_launch(device)``.
So nothing it reads or writes is touched before the kernel before it has completed, whatever
that kernel is (a Triton kernel with or without PDL, cuBLAS, flashinfer, a copy): the results are
those of plain stream order, bit for bit. Modes (``GRAPHCAP_PDL``, read at each launch):
- ``early`` (default): wait, then let the next kernel be dispatched at once (``launch_dependents``
  as a kernel's programs start: its programs then wait beside this kernel's last ones);
- ``wait``: wait only; the next kernel is dispatched as this one's programs exit;
- ``off``: launched as usual (the constexpr is 0: no ``griddepcontrol`` in the code).
Off on the Triton interpreter (no inline assembly there) and below compute capability 9.

H100, 30 layers of rank-of-8 in MXFP8, balanced routing (BENCHMARKS.md, "Tenth round"): the
decode-1 graph replay spans 80.3 us a layer off, 78.8 under ``wait`` and 74.1 under ``early``;
decode 32 (weight streams, not launches) 414.1 / 412.5 / 412.9. Under ``early`` a kernel's
profiled duration includes its wait, so summed kernel times overstate: profile with ``off``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from attention.kernels.triton_utils import interpreting

#: ``GRAPHCAP_PDL`` values, in the order of the ``PDL`` constexpr they give (0, 1, 2).
PDL_MODES = ("off", "wait", "early")
DEFAULT_MODE = "early"


def pdl_mode() -> str:
    """The mode ``GRAPHCAP_PDL`` names (default :data:`DEFAULT_MODE`).

    Raises:
        ValueError: an unknown mode.
    """
    mode = os.environ.get("GRAPHCAP_PDL", DEFAULT_MODE).strip().lower()
    if mode not in PDL_MODES:
        raise ValueError(f"GRAPHCAP_PDL must be one of {PDL_MODES}, got {mode!r}")
    return mode


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(device: torch.device) -> dict[str, object]:
    """Launch options for a kernel that starts with :func:`grid_dependency`: its ``PDL``
    constexpr and Triton's ``launch_pdl``, or none where PDL is off or unsupported."""
    mode = pdl_mode()
    if mode == "off" or interpreting() or device.type != "cuda":
        return {}
    if not _supported(device.index if device.index is not None else torch.cuda.current_device()):
        return {}
    return {"PDL": PDL_MODES.index(mode), "launch_pdl": True}


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement (see the module docstring): with ``PDL >= 1``
    wait until the kernel before has completed and its writes are visible; with ``PDL == 2``
    then let the next kernel be dispatched."""
    if PDL >= 1:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


__all__ = ["DEFAULT_MODE", "PDL_MODES", "grid_dependency", "pdl_launch", "pdl_mode"]
