"""Frozen-value detection: two captures of one bucket must record the same kernels.

A capture records every kernel argument by value. A producer that passes a host value of the
step (a Python scalar computed in the plan, a length, a count) bakes it into the graph, and
every replay reuses the captured value: a wrong result no output comparison on the capture's
own dummy step can see. Capturing the bucket a second time on other dummy data (other tokens,
real-token count, positions and requests) and comparing the two captures node by node finds
it: kernel names, launch dimensions and parameter bytes must agree, except where both
captures hold a device address (tensors of two captures live at different addresses) and
where a repeated capture of either data set differs from its twin (bytes that change
between identical captures, such as uninitialised padding inside by-value structs, carry no
host value), and in parameters of a known empty type (``graphcap.verify.kernel_types``: their one
byte is uninitialised, and may differ with the data that was on the host stack before).
"""

from __future__ import annotations

from typing import Callable, Sequence

from .graph_nodes import GraphNode, is_device_pointer
from .kernel_types import stateless_params

MAX_REPORTED = 4


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def param_difference(a: bytes, b: bytes, is_pointer: Callable[[int], bool],
                     noise: bytes | None = None, b_again: bytes | None = None) -> str | None:
    """Where two captures' bytes of one kernel parameter differ beyond relocated pointers, or
    ``None``.

    8-byte words that differ must both be device addresses; a parameter shorter than a word
    (an int, a float) or a tail shorter than 8 bytes must be identical. ``noise``: the same
    parameter in a capture of the *same* data as ``a``; words that differ between ``a`` and
    it (uninitialised padding in by-value structs, host addresses) say nothing and are
    skipped; ``b_again``, the same for ``b``."""
    if a == b:
        return None
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} bytes"
    usable = noise if noise is not None and len(noise) == len(a) else None
    again = b_again if b_again is not None and len(b_again) == len(b) else None
    for off in range(0, len(a), 8):
        x, y = a[off:off + 8], b[off:off + 8]
        unstable = (usable is not None and usable[off:off + 8] != x) or (again is not None and again[off:off + 8] != y)
        if x == y or unstable:
            continue
        if len(x) == 8 and is_pointer(int.from_bytes(x, "little")) and is_pointer(int.from_bytes(y, "little")):
            continue
        return f"bytes {off}..{off + len(x) - 1} are {x.hex()} in one capture and {y.hex()} in the other"
    return None


def compare_segments(first: Sequence[Sequence[GraphNode]], second: Sequence[Sequence[GraphNode]],
                     labels: Sequence[str], is_pointer: Callable[[int], bool] = is_device_pointer,
                     same_data: Sequence[Sequence[GraphNode]] | None = None,
                     second_again: Sequence[Sequence[GraphNode]] | None = None) -> list[str]:
    """Differences between two captures of one bucket on different data, segment by segment
    (``labels`` name the segments); empty when the captures agree. ``same_data``: a capture
    of the same data as ``first``, whose differences from it are noise (see
    ``param_difference``); ``second_again`` likewise for ``second``. At most ``MAX_REPORTED``
    are described."""
    problems: list[str] = []
    if len(first) != len(second):
        return [f"the captures have {len(first)} and {len(second)} graph segments"]
    if same_data is not None and [len(s) for s in same_data] != [len(s) for s in first]:
        same_data = None  # two captures of the same data disagree in structure: no noise model
    if second_again is not None and [len(s) for s in second_again] != [len(s) for s in second]:
        second_again = None
    for s, (label, a_nodes, b_nodes) in enumerate(zip(labels, first, second)):
        if len(a_nodes) != len(b_nodes):
            problems.append(f"{label}: {len(a_nodes)} vs {len(b_nodes)} graph nodes (host control flow depends on "
                            f"the step)")
            continue
        for i, (a, b) in enumerate(zip(a_nodes, b_nodes)):
            where = f"{label}, node {i} ({a.kind} {_short(a.name)})"
            if a.name != b.name:
                problems.append(f"{where}: the second capture ran {_short(b.name)}")
            elif a.launch != b.launch:
                problems.append(f"{where}: launch {a.launch} vs {b.launch}")
            elif a.params is not None and b.params is not None:
                if len(a.params) != len(b.params):
                    problems.append(f"{where}: {len(a.params)} vs {len(b.params)} parameters")
                    continue
                ref = same_data[s][i].params if same_data is not None else None
                ref_b = second_again[s][i].params if second_again is not None else None
                for j, (pa, pb) in enumerate(zip(a.params, b.params)):
                    if pa != pb and len(pa) == 1 and j in stateless_params(a.name, len(a.params)):
                        continue  # an empty struct: one uninitialised byte (see graphcap.verify.kernel_types)
                    noise = ref[j] if ref is not None and j < len(ref) else None
                    again = ref_b[j] if ref_b is not None and j < len(ref_b) else None
                    diff = param_difference(pa, pb, is_pointer, noise, again)
                    if diff is not None:
                        problems.append(f"{where}: parameter {j}, {diff} (a host value frozen into the graph)")
                        break
            if len(problems) >= MAX_REPORTED:
                return problems
    return problems
