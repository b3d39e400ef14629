"""Test setup shared by every folder.

- On machines without CUDA, Triton kernels run in the interpreter: ``TRITON_INTERPRET`` is set
  here, before any test module imports triton (so no test needs to reload a kernel module).
- GPU tests carry ``@pytest.mark.cuda`` (the one way to mark them) and are skipped without a GPU;
  ``scripts/gpu_suite.sh`` runs them on the device.
- ``tests/`` is on ``sys.path`` (pytest adds a root conftest's folder), so shared scaffolding
  imports as ``helpers.*``; the packages themselves are installed (``pip install -e .``).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run scripts/gpu_suite.sh on the device)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
