"""CaptureGuard: catch producer code that would bake host state into a graph.

Captured producer code must not synchronise with the host (``.item()``, ``.tolist()``,
boolean-mask indexing, ``nonzero``) or read CPU tensors: both either break the capture or,
worse, freeze this step's values into every replay. The guard is a dispatch mode that sees
every aten op between splices during capture and in debug-eager runs, and raises an error
naming the segment, the op and the line of user code that issued it. It costs nothing at
replay: replays do not dispatch.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

# Ops whose output shape or value must be known on the host: each is a device->host sync.
_SYNC_OPS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.equal",
    "aten.is_nonzero",
    "aten.repeat_interleave",
}

_INTERNAL_PATHS = (
    os.sep + "torch" + os.sep,
    os.sep + "graphcap" + os.sep + "guard.py",
    os.sep + "graphcap" + os.sep + "segments.py",
)


_NAMES: dict[Any, str] = {}  # aten overload -> its packet name (str() is slow, the guard sees every op)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments: direct, or in a list/tuple (``Tensor[]``,
    ``Tensor?[]``); aten schemas nest no deeper, so this replaces a full pytree walk."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


class CaptureViolation(RuntimeError):
    """Producer code inside a captured segment did something a graph cannot replay."""


def _user_frame() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(p in frame.filename for p in _INTERNAL_PATHS) and "contextlib" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.name}: {frame.line})"
    return "<unknown>"


class CaptureGuard(TorchDispatchMode):
    """Raises ``CaptureViolation`` on host syncs and CPU-tensor reads in producer code.

    Args:
        device: the device graphs run on; CPU tensors are only a violation when it is CUDA.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Unless this says False, torch wraps a dispatch mode's __torch_dispatch__ in
        # torch._dynamo.disable: the first guarded op of a process then imports torch._dynamo
        # (2-7 s of start-up), and every op the guard sees pays the wrapper. The guard runs no
        # compiled code (torch.compile'd producers run op by op under any dispatch mode).
        return False

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.check_cpu_tensors = device.type == "cuda"
        self.segment = "segment 0"
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Splice bodies run eagerly with the guard off: they may plan, sync and read host data.

        The guard leaves the dispatch stack meanwhile (when it is on top), so a splice's own
        ops cost nothing extra, e.g. the reference attention's per-request host loops."""
        self._paused += 1
        try:
            if _get_current_dispatch_mode() is self:
                with _pop_mode_temporarily():
                    yield
            else:
                yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._paused:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = _NAMES.get(func)
        if name is None:
            name = _NAMES[func] = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        tensors = _tensors(args, kwargs)
        reason = None
        if name in _SYNC_OPS:
            reason = "synchronises with the host (its result is needed on the CPU)"
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            t.dtype == torch.bool for t in tensors[1:]
        ):
            reason = "indexes with a boolean mask (data-dependent shape, a host sync)"
        elif self.check_cpu_tensors:
            if any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
                reason = "reads a CPU tensor (its value would be frozen into the graph)"
            elif kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu" and tensors:
                reason = "copies device data to the host (a sync)"
        if reason is not None:
            raise CaptureViolation(
                f"{self.segment}: {name} {reason}; called at {_user_frame()}. Producer code between "
                f"splice points is captured into a CUDA graph: move this op into a function "
                f"decorated with @graphcap.splice, or compute it from device tensors"
            )
