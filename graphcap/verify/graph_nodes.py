"""The nodes of a captured CUDA graph, read through the CUDA driver API.

Frozen-value detection (``graphcap.verify.frozen``) compares two captures of one bucket node by
node: kernel names, launch dimensions and the bytes of every kernel parameter. PyTorch exposes
a kept graph's ``cudaGraph_t`` (``CUDAGraph(keep_graph=True).raw_cuda_graph()``); the nodes are
read here with ctypes from ``libcuda`` (no extra package): ``cuGraphGetNodes``,
``cuGraphKernelNodeGetParams``, ``cuFuncGetName`` and ``cuFuncGetParamInfo`` (CUDA 12.4+,
which gives each parameter's offset and size, so parameters can be compared byte for byte).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

_KERNEL, _MEMCPY, _MEMSET = 0, 1, 2
_TYPE_NAMES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty", 6: "event wait",
               7: "event record", 8: "semaphore signal", 9: "semaphore wait", 10: "mem alloc", 11: "mem free",
               12: "batch mem op", 13: "conditional"}
_LAUNCH_PARAM_END, _LAUNCH_PARAM_BUFFER_POINTER, _LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
_POINTER_ATTRIBUTE_MEMORY_TYPE = 2


class _KernelParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2``."""

    _fields_ = [("func", ctypes.c_void_p),
                ("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint),
                ("kernel_params", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.POINTER(ctypes.c_void_p)),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _MemsetParams(ctypes.Structure):
    """``CUDA_MEMSET_NODE_PARAMS``."""

    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


@dataclass(frozen=True)
class GraphNode:
    """One node of a captured graph.

    Attributes:
        kind: ``kernel``, ``memset``, ``memcpy``, ... (the driver's node type).
        name: the kernel's (mangled) name; the node kind for other nodes.
        launch: kernel ``(grid x, y, z, block x, y, z, shared memory bytes)``; memset
            ``(element size, width, height)``; empty otherwise.
        params: each kernel parameter's bytes in order (a memset's value); ``None`` when the
            driver cannot tell the parameter sizes (then only name and launch are compared).
    """

    kind: str
    name: str
    launch: tuple[int, ...] = ()
    params: tuple[bytes, ...] | None = ()


class NodeReaderUnavailable(RuntimeError):
    """The CUDA driver library (or a function this reader needs) is not available."""


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise NodeReaderUnavailable("the CUDA driver library (libcuda) cannot be loaded")


def _fn(name: str, *alternatives: str):
    lib = _driver()
    for n in (name, *alternatives):
        f = getattr(lib, n, None)
        if f is not None:
            return f
    raise NodeReaderUnavailable(f"the CUDA driver has no {name} (a driver for CUDA 12.4 or newer is needed)")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {rc}")


def is_device_pointer(value: int) -> bool:
    """Whether ``value`` is an address inside memory the CUDA driver allocated (device, pinned
    host or managed): pointers differ between two captures of one bucket legitimately."""
    if value == 0:
        return False
    memtype = ctypes.c_uint(0)
    rc = _fn("cuPointerGetAttribute")(ctypes.byref(memtype), ctypes.c_int(_POINTER_ATTRIBUTE_MEMORY_TYPE),
                                     ctypes.c_uint64(value))
    return rc == 0


def _kernel_name(p: _KernelParams) -> str:
    name = ctypes.c_char_p()
    if p.func:
        rc = _fn("cuFuncGetName")(ctypes.byref(name), ctypes.c_void_p(p.func))
    else:
        rc = _fn("cuKernelGetName")(ctypes.byref(name), ctypes.c_void_p(p.kern))
    return name.value.decode(errors="replace") if rc == 0 and name.value else "<unnamed kernel>"


def _param_layout(p: _KernelParams) -> list[tuple[int, int]]:
    """(offset, size) of each parameter (the driver answers until the index is past the last)."""
    if p.func:
        get, handle = _fn("cuFuncGetParamInfo"), ctypes.c_void_p(p.func)
    else:
        get, handle = _fn("cuKernelGetParamInfo"), ctypes.c_void_p(p.kern)
    out: list[tuple[int, int]] = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    while len(out) < 4096:
        if get(handle, ctypes.c_size_t(len(out)), ctypes.byref(offset), ctypes.byref(size)) != 0:
            break
        out.append((offset.value, size.value))
    return out


def _kernel_params(p: _KernelParams) -> tuple[bytes, ...] | None:
    layout = _param_layout(p)
    if p.kernel_params:
        return tuple(ctypes.string_at(p.kernel_params[i], size) for i, (_, size) in enumerate(layout))
    if p.extra:  # one packed argument buffer: (key, value) pairs ending in CU_LAUNCH_PARAM_END
        buf, buf_size, i = None, 0, 0
        while p.extra[i] and p.extra[i] != _LAUNCH_PARAM_END:
            key, value = p.extra[i], p.extra[i + 1]
            if key == _LAUNCH_PARAM_BUFFER_POINTER:
                buf = value
            elif key == _LAUNCH_PARAM_BUFFER_SIZE:
                buf_size = ctypes.c_size_t.from_address(value).value
            i += 2
        if buf is None:
            return None
        blob = ctypes.string_at(buf, buf_size)
        return tuple(blob[off:off + size] for off, size in layout)
    return ()


def graph_nodes(raw_graph: int) -> list[GraphNode]:
    """The nodes of a ``cudaGraph_t`` (``CUDAGraph.raw_cuda_graph()``) in the driver's order
    (the order of capture for one stream).

    Raises:
        NodeReaderUnavailable: no CUDA driver, or one too old for these queries.
    """
    graph = ctypes.c_void_p(raw_graph)
    get_nodes = _fn("cuGraphGetNodes")
    count = ctypes.c_size_t(0)
    _check(get_nodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * max(1, count.value))()
    _check(get_nodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    node_type = _fn("cuGraphNodeGetType")
    kernel_params = _fn("cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams")
    memset_params = _fn("cuGraphMemsetNodeGetParams")
    out: list[GraphNode] = []
    for i in range(count.value):
        node = ctypes.c_void_p(nodes[i])
        t = ctypes.c_int(-1)
        _check(node_type(node, ctypes.byref(t)), "cuGraphNodeGetType")
        if t.value == _KERNEL:
            p = _KernelParams()
            _check(kernel_params(node, ctypes.byref(p)), "cuGraphKernelNodeGetParams")
            out.append(GraphNode("kernel", _kernel_name(p),
                                 (p.grid_x, p.grid_y, p.grid_z, p.block_x, p.block_y, p.block_z, p.shared_mem),
                                 _kernel_params(p)))
        elif t.value == _MEMSET:
            m = _MemsetParams()
            _check(memset_params(node, ctypes.byref(m)), "cuGraphMemsetNodeGetParams")
            out.append(GraphNode("memset", "memset", (m.element_size, m.width, m.height),
                                 (int(m.value).to_bytes(4, "little"),)))
        else:
            kind = _TYPE_NAMES.get(t.value, f"type {t.value}")
            out.append(GraphNode(kind, kind))
    return out
