"""Small helpers shared by the Triton attention kernels: interpreter detection, padding, SMs.

The Triton interpreter (``TRITON_INTERPRET=1``) runs the same kernel source on the CPU, which
is how these kernels are tested without a GPU. Its bf16 ``tl.dot`` is wrong, so every kernel
takes a ``DOT_F32`` constexpr and upcasts its dot operands when it is set.
"""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET`` is truthy).

    Triton reads this variable when a kernel is decorated, so it must be set before the kernel
    modules are imported; the value seen here is the one the kernels were built with only if
    nobody changed it in between.
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def pad_dim(n: int, minimum: int = 16) -> int:
    """Power-of-two tile width for a dimension of size ``n``; ``tl.dot`` needs >= 16."""
    return max(minimum, next_pow2(n))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small fixed number on the CPU (interpreter),
    so grid-size heuristics still pick several programs per op there."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """Kernels need CUDA tensors, or CPU tensors under the interpreter (every launcher calls
    this first; under the interpreter it also applies :func:`fix_interpreter_scalar_index`).

    Raises:
        RuntimeError: a CPU tensor reached a kernel while the interpreter is off.
    """
    if interpreting():
        fix_interpreter_scalar_index()
        return
    for t in tensors:
        if t.device.type != "cuda":
            raise RuntimeError(
                f"{name}: got a {t.device.type} tensor but Triton kernels need CUDA tensors; "
                f"set TRITON_INTERPRET=1 before importing attention.* to run them on the CPU"
            )


def fix_interpreter_scalar_index() -> None:
    """Let interpreted kernels use tensor-valued loop bounds (``range(lo, hi)``).

    The interpreter holds every scalar as a 1-element array and converts it with
    ``int(array)``, which NumPy 2.x rejects for arrays of ndim 1; compiled kernels are
    unaffected. This wraps the interpreter's tensor patching so ``__index__`` takes the single
    element. Only called (idempotently) by launchers while interpreting; a no-op otherwise.
    """
    if not interpreting():
        return
    from triton.runtime import interpreter as interp

    if getattr(interp._patch_lang_tensor, "_graphcap_fixed", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._graphcap_fixed = True  # type: ignore[attr-defined]
    interp._patch_lang_tensor = patched


def compile_report(module: str, kernel: str, constexprs: dict, ptr_dtypes: dict[str, str] | None = None,
                   float_args: tuple[str, ...] = (), num_warps: int = 4, num_stages: int = 3,
                   arch: int = 90) -> dict:
    """Compile ``module.kernel`` for CUDA compute capability ``arch`` without a GPU and report
    its resources: ``{"shared": bytes, "regs": n, "spill_bytes": n, "wgmma": bool}``.

    A development check (the interpreter accepts code the compiler rejects, e.g. sibling
    branches binding one name to different shapes). Argument types: ``*_ptr`` are pointers
    (``ptr_dtypes[name]``, default bf16), ``float_args`` are fp32, other non-constexpr
    arguments int32; pointers, strides and ``page_size`` are assumed 16-divisible, as at real
    launches. Must run where ``TRITON_INTERPRET`` is off (the tests use a subprocess).
    """
    import importlib
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel)
    ptr_dtypes = ptr_dtypes or {}
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
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
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
                spill_bytes=int(spills.group(1)) if spills else 0, wgmma="wgmma" in ptx)
