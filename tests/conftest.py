import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU machines; set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT,):
    if path not in sys.path:
        sys.path.insert(0, path)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run scripts/gpu_suite.sh on the device)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
