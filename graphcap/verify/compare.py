"""Graph-vs-eager comparisons: relative error, output and cache-state checks (``validate``, audits)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.utils._pytree import tree_flatten

# Relative Frobenius error allowed between a replay and an eager run of the same step. The
# two may use different GEMM shapes (bucket vs real rows) and atomics are not bitwise
# deterministic, so the bound is a few units of the dtype's rounding, not zero.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in fp64; inf when either holds a NaN."""
    a, e = actual.double(), expected.double()
    if torch.isnan(a).any() or torch.isnan(e).any():
        return float("inf")
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def _close(actual: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float]:
    if actual.dtype.is_floating_point:
        err = relative_error(actual, expected)
        return err <= TOLERANCE.get(expected.dtype, 1e-3), err
    same = bool(torch.equal(actual, expected))
    return same, 0.0 if same else float("inf")


def compare_outputs(eager: Any, graph: Any) -> list[str]:
    """Problems found comparing two forward outputs (same pytree of tensors)."""
    e_leaves, _ = tree_flatten(eager)
    g_leaves, _ = tree_flatten(graph)
    if len(e_leaves) != len(g_leaves):
        return [f"output structure differs: eager {len(e_leaves)} leaves, graph {len(g_leaves)}"]
    problems = []
    for i, (e, g) in enumerate(zip(e_leaves, g_leaves)):
        if not isinstance(e, torch.Tensor):
            continue
        if e.shape != g.shape:
            problems.append(f"output {i} shape {tuple(g.shape)} != eager {tuple(e.shape)}")
            continue
        ok, err = _close(g, e)
        if not ok:
            problems.append(f"output {i} differs from eager (relative error {err:.3g})")
    return problems


def compare_state(before: Mapping[str, torch.Tensor], eager: Mapping[str, torch.Tensor],
                  graph: Mapping[str, torch.Tensor]) -> list[str]:
    """Problems in mutable state after a replay: writes eager did not make (padded rows
    writing the cache) and contents that differ from eager's."""
    problems = []
    for name, b in before.items():
        e, g = eager[name], graph[name]
        stray = ((g != b) & (e == b)).sum().item()
        if stray:
            problems.append(f"{name}: graph wrote {stray} elements that eager left untouched "
                            "(padded rows must write nothing)")
            continue
        ok, err = _close(g, e)
        if not ok:
            problems.append(f"{name}: contents differ from eager (relative error {err:.3g})")
    return problems
