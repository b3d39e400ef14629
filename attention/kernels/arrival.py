"""Last-arrival merges: the program that finishes a row's partial results last merges them.

Split kernels (the decode indexer's key chunks, the decode attention's splits of the selected
blocks) write partial results per row, and a second launch merged them. At a decode step of a
few rows the merge is a few microseconds of work behind a launch of its own, once per sparse
layer and kernel. Here each program of a row counts its arrival on a counter after writing its
partial; the one that sees every other arrival merges the row in place and resets the counter
to zero for the next launch. The merge reads the partials in a fixed order, so the result is
the same bits whichever program arrives last, and the same as the separate merge kernel's.

Where it pays (H100, graph replays, ``benchmarks/results/arrival_merges/``): a decode step's
sparse kernels, 1-8 rows, 2-8% faster (one launch fewer each); not at 32 rows, where the
merge launch overlapped nothing anyway. Where it did not, and is not used: the block-major
prefill attention (a block program merging the tokens it completed: 158 vs 97 us at 64K, the
merges serialised inside 255-register programs), the decode router's top-k in its last
logits program (14.0 vs 11.9 us: one 4-warp program's serial top-k rounds cost more than the
launch) and the weight-row MoE's combine in its down kernel's last program of each row tile
(H100, 60 layers, decode 1: down 9.7 + combine 1.4 -> 13.8 us a layer; decode 2: 17.7 ->
24.7; 3500-3900 programs each draining its stores before an acquire-release count;
``benchmarks/results/decode_launches_r13/``).

Ordering: every thread's partial stores come before the count (a barrier, then an
acquire-release atomic at GPU scope: the release covers the program's stores), and the last
program's reads come after its count (the acquire; the atomic's result reaches its threads
through a barrier). Its reads go through L2 (``.cg``), where the other programs' stores are.

The counters live in one zeroed int32 buffer per device (:func:`arrival_counters`), shared by
every such launch: launches on one stream run one after another and each leaves its counters
at zero. Kernels of one device that use them must not run concurrently on two streams (the
runner's persistent metadata buffers already ask the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed ``int32`` buffer of at least ``n`` counters on ``device``, persistent.

    The buffer only grows: a larger one is allocated when asked for more (at warm-up, before
    any graph is captured with this size), and every earlier buffer stays alive, since graphs
    captured before keep its address."""
    device = torch.device(device)
    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 2 * held[-1].numel() if held else 256), dtype=torch.int32, device=device))
    return held[-1]


@triton.jit
def arrive(counter_ptr, expected):
    """Count this program's arrival at ``counter_ptr`` and return whether it is the last of
    ``expected`` (the last one also resets the counter to zero). Call it after the program's
    partial stores, from every thread (a barrier is inside)."""
    tl.debug_barrier()  # every thread's partial stores come before the count
    seen = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = seen == expected - 1
    tl.atomic_xchg(counter_ptr, 0, mask=last, sem="relaxed", scope="gpu")
    return last


__all__ = ["arrival_counters", "arrive"]
