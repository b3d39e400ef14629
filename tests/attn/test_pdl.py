"""Programmatic dependent launch (``attention.kernels.pdl``).

- the mode switch and the launch options (none on CPU, none when off);
- every kernel that takes the ``PDL`` constexpr starts with ``grid_dependency(PDL)`` (source);
- compiled for Hopper with ``PDL=2``: ``griddepcontrol.wait`` before the first global-memory
  access and the early dispatch of the next kernel; with ``PDL=0`` neither (no GPU needed).
GPU runs of the kernels with PDL on are the GPU tests of their own files (graph replays equal to
padded eager, kernels against references), which launch with ``pdl_launch`` by default.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest
import torch
from helpers.triton_compile import run_compile_reports

from attention.kernels import pdl

KERNEL_MODULES = ["attention.kernels.indexer", "attention.kernels.sparse", "models.minimax_m3.kernels.fp8_linear",
                  "models.minimax_m3.kernels.moe", "models.minimax_m3.kernels.moe_gemv",
                  "models.minimax_m3.kernels.norm", "models.minimax_m3.kernels.producer",
                  "models.minimax_m3.kernels.router"]


def test_mode_switch_and_launch_options(monkeypatch):
    monkeypatch.delenv("GRAPHCAP_PDL", raising=False)
    assert pdl.pdl_mode() == pdl.DEFAULT_MODE == "early"
    for mode in pdl.PDL_MODES:
        monkeypatch.setenv("GRAPHCAP_PDL", mode.upper())
        assert pdl.pdl_mode() == mode
        assert pdl.pdl_launch(torch.device("cpu")) == {}  # no PDL off the GPU, whatever the mode
    monkeypatch.setenv("GRAPHCAP_PDL", "sometimes")
    with pytest.raises(ValueError, match="GRAPHCAP_PDL must be one of"):
        pdl.pdl_launch(torch.device("cpu"))


@pytest.mark.cuda
def test_launch_options_on_gpu(monkeypatch):
    dev = torch.device("cuda")
    monkeypatch.setenv("GRAPHCAP_PDL", "off")
    assert pdl.pdl_launch(dev) == {}
    hopper = torch.cuda.get_device_capability()[0] >= 9
    for mode, constexpr in (("wait", 1), ("early", 2)):
        monkeypatch.setenv("GRAPHCAP_PDL", mode)
        assert pdl.pdl_launch(dev) == ({"PDL": constexpr, "launch_pdl": True} if hopper else {})


def pdl_kernels() -> list[tuple[str, object]]:
    """``(name, kernel)`` of every Triton kernel of the modules that takes ``PDL`` (compiled or,
    under the interpreter, interpreted)."""
    out = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for attr, fn in vars(module).items():
            src = getattr(fn, "fn", None)
            if "PDL" in getattr(fn, "arg_names", ()) and getattr(src, "__module__", None) == name:
                out.append((f"{name}.{attr}", fn))
    return out


def test_every_pdl_kernel_waits_first():
    """The rule of ``pdl``: the first statement of every kernel that takes ``PDL`` (after its
    docstring) is ``grid_dependency(PDL)``, so none touches memory before the kernel before it
    has completed."""
    kernels = pdl_kernels()
    assert len(kernels) >= 14, [k for k, _ in kernels]
    for name, fn in kernels:
        body = ast.parse(textwrap.dedent(inspect.getsource(fn.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        first = ast.unparse(body[0])
        assert first == "grid_dependency(PDL)", f"{name} starts with {first!r}"


def test_pdl_builds_wait_before_memory_for_hopper():
    norm = dict(H=6144, BLOCK_H=8192, FUSED_ADD=True)
    gemv = dict(TWO=False, BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3)
    combine = dict(K=4, BLOCK=1024, SPLIT=1)
    cases = []
    for pdl_value in (2, 0):
        cases += [["models.minimax_m3.kernels.norm", "_gemma_norm_kernel", dict(norm, PDL=pdl_value), {}, [], 8, 1],
                  ["models.minimax_m3.kernels.fp8_linear", "_gemv_linear_kernel", dict(gemv, PDL=pdl_value),
                   dict(w_ptr="fp8e4nv", s_ptr="i32"), [], 2, 3],
                  ["models.minimax_m3.kernels.moe", "_moe_combine_kernel", dict(combine, PDL=pdl_value),
                   dict(y_ptr="fp32", pos_ptr="i32"), [], 4, 1]]
    reports = run_compile_reports(cases)
    for case, rep in zip(cases[:3], reports[:3]):
        assert rep["grid_wait_first"] and rep["launches_dependents"], (case, rep)
    for case, rep in zip(cases[3:], reports[3:]):
        assert not rep["grid_wait_first"] and not rep["launches_dependents"], (case, rep)
