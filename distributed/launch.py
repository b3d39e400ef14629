"""``--tp N`` for example scripts: join the group torchrun started, or run alone.

    torchrun --nproc-per-node 2 examples/profile_forward.py --preset slice --tp 2
"""

from __future__ import annotations

import os

from .group import ParallelGroup


def group_for_tp(tp: int | None, device: str) -> ParallelGroup | None:
    """None without ``--tp`` (one process, no collectives); with ``--tp N``, this process's
    rank of the ``N`` that torchrun launched (NCCL for a CUDA ``device``, gloo on CPU).

    Raises:
        SystemExit: ``N`` differs from torchrun's ``WORLD_SIZE``, or torchrun did not launch
            the script (``N > 1``).
    """
    if tp is None:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    under_torchrun = "WORLD_SIZE" in os.environ
    if tp < 1 or ((tp > 1 or under_torchrun) and world != tp):
        raise SystemExit(f"--tp {tp} needs {tp} processes: launch with `torchrun --nproc-per-node {tp} ...` "
                         f"(WORLD_SIZE is {os.environ.get('WORLD_SIZE', 'unset')})")
    if not under_torchrun:  # --tp 1 without torchrun: a group of one, same NCCL/gloo path
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
    return ParallelGroup.from_torchrun("cuda" if device.startswith("cuda") else "cpu")
