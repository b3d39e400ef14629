"""Parameter types of a CUDA kernel, read from its (Itanium C++) mangled name.

Frozen-value detection compares kernel parameters byte by byte. Some parameters carry no
value at all: torch's elementwise kernels take stateless policy objects (offset calculators
for contiguous tensors, loaders and storers that do not cast) by value. Each is an empty
struct, one byte that nobody writes, so the driver copies whatever the host stack held
there, and that byte may differ between two captures on different data (seen on an H200:
``TrivialOffsetCalculator`` holding 41 in one capture, 42 in the other). ``stateless_params``
names those parameters so the comparison can skip them.

Only types known to be empty are skipped (``STATELESS_TYPES``): a one-byte parameter of any
other type (a ``bool`` flag, a one-byte enum such as a dtype) may be a real host value and is
still compared. A name that does not demangle (Triton kernels are not C++) has none.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# Empty structs torch's elementwise kernels take by value (ATen/native/cuda/MemoryAccess.cuh,
# OffsetCalculator.cuh): the unqualified class name, template arguments left out.
STATELESS_TYPES = frozenset({"TrivialOffsetCalculator", "LoadWithoutCast", "StoreWithoutCast"})


@functools.cache
def _demangler() -> tuple[object, object] | None:
    for lib in ("libstdc++.so.6", ctypes.util.find_library("stdc++")):
        if not lib:
            continue
        try:
            cxx = ctypes.CDLL(lib)
            fn = cxx.__cxa_demangle
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        free = ctypes.CDLL(None).free
        free.argtypes = [ctypes.c_void_p]
        return fn, free
    return None


def demangle(name: str) -> str | None:
    """The demangled C++ signature of ``name``, or ``None`` (not a mangled name, or no
    demangler in this process)."""
    tools = _demangler()
    if tools is None or not name.startswith("_Z"):
        return None
    fn, free = tools
    status = ctypes.c_int(0)
    out = fn(name.encode(), None, None, ctypes.byref(status))  # type: ignore[operator]
    if status.value != 0 or not out:
        return None
    try:
        return ctypes.string_at(out).decode(errors="replace")
    finally:
        free(out)  # type: ignore[operator]


def split_parameters(signature: str) -> list[str] | None:
    """The parameter types of a demangled function signature (``void f<...>(int, T, ...)``):
    the last top-level parenthesised list, split at top-level commas; ``None`` when it does not
    end in one."""
    sig = signature.rstrip()
    if not sig.endswith(")"):
        return None
    depth, start = 0, None
    for i in range(len(sig) - 1, -1, -1):  # the "(" that matches the final ")"
        depth += {")": 1, "(": -1}.get(sig[i], 0)
        if depth == 0:
            start = i
            break
    if start is None:
        return None
    inner = sig[start + 1:-1]
    params, depth, cur = [], 0, []
    for ch in inner:
        if ch in "<({[":
            depth += 1
        elif ch in ">)}]":
            depth -= 1
        if ch == "," and depth == 0:
            params.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        params.append("".join(cur).strip())
    return params


def _class_name(type_name: str) -> str:
    """``at::native::memory::LoadWithoutCast`` -> ``LoadWithoutCast``;
    ``TrivialOffsetCalculator<1, unsigned int>`` -> ``TrivialOffsetCalculator``."""
    depth, base = 0, []
    for ch in type_name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            base.append(ch)
    return "".join(base).strip().rsplit("::", 1)[-1]


@functools.lru_cache(maxsize=4096)
def stateless_params(kernel_name: str, num_params: int) -> frozenset[int]:
    """Indices of ``kernel_name``'s parameters whose type is a known empty struct
    (``STATELESS_TYPES``): their one byte is uninitialised host memory, not a value. Empty
    unless the signature lists exactly ``num_params`` parameters (what the driver reports), so
    a name this parser splits wrongly skips nothing."""
    sig = demangle(kernel_name)
    params = split_parameters(sig) if sig else None
    if not params or len(params) != num_params:
        return frozenset()
    return frozenset(i for i, t in enumerate(params) if _class_name(t) in STATELESS_TYPES)


__all__ = ["STATELESS_TYPES", "demangle", "split_parameters", "stateless_params"]
