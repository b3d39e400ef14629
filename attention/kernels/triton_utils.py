"""Small helpers shared by the Triton kernels: interpreter detection, padding, SMs, the fp8 row split,
register lookups of page lists.

The Triton interpreter (``TRITON_INTERPRET=1``) runs the same kernel source on the CPU, which
is how these kernels are tested without a GPU. Its bf16 ``tl.dot`` is wrong, so every kernel
takes a ``DOT_F32`` constexpr and upcasts its dot operands when it is set.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


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


def check_tile_config(config: object, dot_dims: tuple[str, ...]) -> None:
    """A frozen tile-config dataclass: every field a positive int (or a bool switch), and the
    fields in ``dot_dims`` powers of two >= 16 (``tl.dot`` dimensions).

    Raises:
        ValueError: naming the class, the field and the value.
    """
    import dataclasses

    cls = type(config).__name__
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        v = getattr(config, f.name)
        if f.type in (bool, "bool"):
            if not isinstance(v, bool):
                raise ValueError(f"{cls}.{f.name} must be True or False, got {v!r}")
        elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{cls}.{f.name} must be a positive int, got {v!r}")
    for name in dot_dims:
        v = getattr(config, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{cls}.{name} must be a power of two >= 16 (a tl.dot dimension), got {v}")


@triton.jit
def entry_at(values, lanes, i):
    """``values[i]`` of a 1D int tensor of entries ``>= -1`` (``lanes``: its ``tl.arange``; ``-1``
    where ``i`` is out of range), picked in registers. Block loops over paged caches read their
    page list before the loop and pick each step's page with this: a page read from the block
    table inside the loop makes the next tile's address wait on a load, and Triton's pipeliner
    then keeps one tile in flight (``async_wait 0`` each step), not ``num_stages - 1``."""
    return tl.max(tl.where(lanes == i, values, -1), axis=0)


@triton.jit
def fp8_split_rows(v):
    """A tile ``[rows, C]`` as two e4m3 tiles ``(hi, lo)`` with ``hi + lo ~= v * 2**e`` and the
    int32 exponents ``e [rows]`` (``common.fp8_split.fp8_split_rows`` is the same rounding in
    torch, and documents it): each row scaled by its own power of two so that its largest entry
    lands in ``[224, 448]``, ``hi`` with e4m3's 4 significant bits and ``lo`` the next 4 (about
    a bf16's 8), for fp8 tensor-core dots against e4m3 operands. (Under the interpreter the
    fp32 -> e4m3 cast drops the mantissa carry: check this on the GPU.)
    """
    vf = v.to(tl.float32)
    # The exponent from the bits (``log2`` and ``/`` are approximate on the GPU): amax = m * 2**x
    # with m in [1, 2); the largest e with amax * 2**e <= 448 = 1.75 * 2**8 is 8 - x, or 7 - x
    # past m = 1.75.
    bits = tl.max(tl.abs(vf), axis=1).to(tl.int32, bitcast=True)
    e = 8 - (((bits >> 23) & 0xFF) - 127) - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(bits > 0, tl.minimum(tl.maximum(e, -126), 127), 0)  # an all-zero (padded) row: 2**0
    vs = vf * ((e + 127) << 23).to(tl.float32, bitcast=True)[:, None]
    # hi's value in fp32 from the bits, not as ``hi.to(tl.float32)``: on the H200 (Triton 3.6)
    # that read back 0 right after the e4m3 cast, so lo came out as the whole value (the
    # GPU test of the split caught it); the cast of an e4m3-exact value is exact either way
    hi_f = _e4m3_nearest(vs)
    return hi_f.to(tl.float8e4nv), (vs - hi_f).to(tl.float8e4nv), e


@triton.jit
def _e4m3_nearest(v):
    """The e4m3 value nearest fp32 ``v`` (``|v| <= 448``; ties to even), in fp32: normal e4m3
    (``|v| >= 2**-6``) keeps 3 of fp32's 23 mantissa bits (a carry moves into the exponent);
    below, e4m3's subnormals are the multiples of 2**-9, where an fp32 add and subtract of
    1.5 * 2**14 rounds."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = (((mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    sub = ((v + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -0x80000000)  # -0.0 stays -0.0
    return tl.where(mag >= 0x3C800000, normal, sub.to(tl.float32, bitcast=True))
