"""Graph memory: the pool's size, and the error a capture that runs out of memory raises."""

from __future__ import annotations

from typing import Any

import torch


class CaptureOutOfMemory(torch.OutOfMemoryError):
    """Capture ran out of GPU memory. The manager has dropped every graph and freed the pool;
    the message says what was being captured, what the graphs held and what to change."""


def pool_bytes(pool: Any) -> int | None:
    """Bytes the caching allocator holds for graph pool ``pool`` (``None`` when unknown)."""
    if pool is None or not torch.cuda.is_available():
        return None
    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:
        return None
    want = tuple(pool)
    return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == want)


def out_of_memory(what: str, graphs: int, held_mib: float, device: torch.device, error: BaseException) -> str:
    """The message for a capture that ran out of memory while doing ``what``."""
    free, total = torch.cuda.mem_get_info(device)
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return (
        f"capture ran out of GPU memory while {what}, with {graphs} graph(s) captured holding {held_mib:.0f} MiB "
        f"({free / 2**20:.0f} of {total / 2**20:.0f} MiB free after freeing them): {first}. All graphs and the "
        f"pool were released. Capture fewer graphs (CaptureConfig.buckets / decode_buckets), lower "
        f"CaptureConfig.max_tokens (the largest bucket sets the pool), or leave more memory free (fewer KV pages)."
    )
