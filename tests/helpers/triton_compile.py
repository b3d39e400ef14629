"""Compile Triton kernels for Hopper without a GPU (tests of the kernel modules share this)."""

import os
import re

import pytest


def run_compile_reports(cases):
    """compile_report for each case in a subprocess without the interpreter; the reports."""
    import json
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton's bundled ptxas is missing")
    code = ("import json, sys; from helpers.triton_compile import compile_report; "
            "print(json.dumps([compile_report(*c) for c in json.loads(sys.argv[1])]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests")])
    res = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    reports = json.loads(res.stdout.strip().splitlines()[-1])
    for case, rep in zip(cases, reports):
        assert rep["shared"] <= 227 * 1024, (case, rep)  # H200: 227 KiB per block
        assert rep["spill_bytes"] <= 256, (case, rep)  # a little spilling at the 255-register cap is tolerated
    return reports


def compile_report(module: str, kernel: str, constexprs: dict, ptr_dtypes: dict[str, str] | None = None,
                   float_args: tuple[str, ...] = (), num_warps: int = 4, num_stages: int = 3,
                   arch: int = 90, max_regs: int | None = None) -> dict:
    """Compile ``module.kernel`` for CUDA compute capability ``arch`` without a GPU and report
    its resources: ``{"shared": bytes, "regs": n, "spill_bytes": n, "wgmma": bool, "fp8_wgmma": bool,
    "wgmma_reg_a": bool, "ldmatrix": bool, "cp_async": bool, "k_loop_loads": n,
    "copies_in_flight": n, "acq_rel_atomics": bool, "narrow_shared_loads": n}`` (``fp8_wgmma``: a
    wgmma takes e4m3 operands as they are;
    ``wgmma_reg_a``: a wgmma takes its first operand from registers; ``ldmatrix``: some operand
    goes from shared memory to registers through ``ldmatrix``; ``cp_async``: some load is
    pipelined through asynchronous copies into shared memory;
    ``k_loop_loads``: loads left synchronous in a loop that feeds a dot, each a full memory
    latency per step; ``copies_in_flight``: the fewest asynchronous copies such a loop leaves
    in flight where it waits, ``num_stages - 2`` when fully pipelined, 0 where a step waits for
    the copy it just issued, -1 with no such wait; ``acq_rel_atomics``: some atomic orders memory
    at GPU scope, as a last-arrival count does; ``narrow_shared_loads``: shared-memory loads of
    one or two bytes a thread; ``grid_wait_first``: :func:`grid_wait_first`;
    ``launches_dependents``: the kernel lets the next one be dispatched early (PDL)).

    A development check (the interpreter accepts code the compiler rejects, e.g. sibling
    branches binding one name to different shapes). Argument types: ``*_ptr`` are pointers
    (``ptr_dtypes[name]``, default bf16), ``float_args`` are fp32, other non-constexpr
    arguments int32; pointers, strides and ``page_size`` are assumed 16-divisible, as at real
    launches; ``max_regs``: Triton's ``maxnreg`` (a per-thread register cap). Must run where
    ``TRITON_INTERPRET`` is off (the tests use a subprocess).
    """
    import importlib
    import inspect
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel)
    ptr_dtypes = ptr_dtypes or {}
    # constexprs left out take their defaults, as a launch that leaves them out does
    unset = inspect.Parameter.empty
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not unset}, **constexprs}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = "*" + ptr_dtypes.get(name, "bf16")
        else:
            sig[name] = "fp32" if name in float_args else "i32"
        if name.endswith("_ptr") or (name.startswith("stride") and name != "stride_bt") or name == "page_size":
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages,
                                           **({"maxnreg": max_regs} if max_regs else {})))
    ptx = compiled.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return dict(shared=compiled.metadata.shared, regs=int(regs.group(1)) if regs else -1,
                spill_bytes=int(spills.group(1)) if spills else 0, wgmma="wgmma" in ptx,
                fp8_wgmma=bool(re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
                wgmma_reg_a=bool(re.search(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*\{", ptx)), ldmatrix="ldmatrix" in ptx,
                cp_async="cp.async" in ptx, k_loop_loads=k_loop_loads(compiled.asm["ttgir"]),
                copies_in_flight=copies_in_flight(compiled.asm["ttgir"]),
                acq_rel_atomics=bool(re.search(r"atom\.\S*\.acq_rel\.", ptx)),
                narrow_shared_loads=len(re.findall(r"ld\.shared\.[bu](?:8|16)\b", ptx)),
                grid_wait_first=grid_wait_first(ptx),
                launches_dependents="griddepcontrol.launch_dependents" in ptx)


def grid_wait_first(ptx: str) -> bool:
    """Whether ``griddepcontrol.wait`` comes before the kernel's first global-memory access
    (load, store, atomic or asynchronous copy), as a PDL-launched kernel needs."""
    wait = ptx.find("griddepcontrol.wait")
    access = re.search(r"\b(?:ld|st|atom|red)\.global\b|\bcp\.async\b", ptx)
    return wait >= 0 and (access is None or wait < access.start())


def k_loop_loads(ttgir: str) -> int:
    """Plain ``tt.load`` ops left in the loops (``scf.for``) of a pipelined TTGIR whose body holds
    a dot: loads the software pipeliner did not turn into asynchronous copies (Triton skips
    those under 4 bytes per element, among others), so each step waits for them."""
    stack, total = [], 0  # per open region: [is a for loop, holds a dot, plain loads]
    for line in ttgir.splitlines():
        t = line.strip()
        if t.startswith("}") and stack:
            is_for, has_dot, loads = stack.pop()
            total += loads if is_for and has_dot else 0
        loop = next((r for r in reversed(stack) if r[0]), None)  # the innermost loop around this op
        if loop is not None:
            loop[1] |= "tt.dot " in t or "warp_group_dot " in t
            loop[2] += "= tt.load " in t
        if t.endswith("{"):
            stack.append([t.startswith("scf.for ") or " = scf.for " in t, False, 0])
    return total


def copies_in_flight(ttgir: str) -> int:
    """The smallest ``num`` of the ``ttg.async_wait`` ops in the loops of a pipelined TTGIR whose
    body holds a dot: how many asynchronous copies such a loop still has in flight where it
    waits (-1: none waits). A copy whose address depends on a load in the same loop (a page id
    read from a block table) makes the pipeliner wait for every copy each step (0)."""
    stack, found = [], []  # per open region: [is a for loop, holds a dot, its waits' nums]
    for line in ttgir.splitlines():
        t = line.strip()
        if t.startswith("}") and stack:
            is_for, has_dot, nums = stack.pop()
            found += nums if is_for and has_dot else []
        loop = next((r for r in reversed(stack) if r[0]), None)
        if loop is not None:
            loop[1] |= "tt.dot " in t or "warp_group_dot " in t
            m = re.search(r"ttg\.async_wait .*\{num = (\d+)", t)
            if m:
                loop[2].append(int(m.group(1)))
        if t.endswith("{"):
            stack.append([t.startswith("scf.for ") or " = scf.for " in t, False, []])
    return min(found) if found else -1
