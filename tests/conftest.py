"""Test setup shared by every folder.

- On machines without CUDA, Triton kernels run in the interpreter: ``TRITON_INTERPRET`` is set
  here, before any test module imports triton (so no test needs to reload a kernel module).
- GPU tests carry ``@pytest.mark.cuda`` (the one way to mark them) and are skipped without a GPU;
  ``scripts/gpu_suite.sh`` runs them on the device.
- ``tests/`` is on ``sys.path`` (pytest adds a root conftest's folder), so shared scaffolding
  imports as ``helpers.*``; the packages themselves are installed (``pip install -e .``).
- CPU tests run torch single-threaded (``OMP_NUM_THREADS=1``, inherited by the rank processes
  the parallel tests spawn): their tensors are tiny, so a second thread gains nothing, and on a
  2-core machine with another busy process OpenMP's spinning threads made the suite 7x slower
  (a 25 s test took 110 s). A value you set yourself wins.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run scripts/gpu_suite.sh on the device)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
