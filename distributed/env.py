"""NCCL settings that CUDA graphs need, applied before the first communicator exists.

NCCL reads its environment once, when a communicator is created, so these must be set before
``torch.distributed.init_process_group`` (``ParallelGroup.init`` calls ``configure_nccl``).

- ``NCCL_CUMEM_ENABLE=0``: since NCCL 2.19 cuMem (virtual memory) allocations are on by
  default, and graphs that capture NCCL collectives then hold 1-2 GiB more GPU memory per rank
  (NVIDIA/nccl#1234). An explicit user value is kept (multi-node NVLink systems need 1).
- ``NCCL_NVLS_ENABLE=0``: NVLink SHARP (multicast) stays off. Its buffers are registered
  lazily, which is not allowed inside a stream capture, and the lent multi-GPU machines do not
  support it (see the device notes).
"""

from __future__ import annotations

import os

GRAPH_SAFE_NCCL = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def configure_nccl(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set every ``GRAPH_SAFE_NCCL`` variable the user has not set; returns the final values
    of those variables (what NCCL will read)."""
    env = os.environ if environ is None else environ
    for name, value in GRAPH_SAFE_NCCL.items():
        env.setdefault(name, value)
    return {name: env[name] for name in GRAPH_SAFE_NCCL}
