"""StorageRegistry: everything a graph reads, and whether any of it moved.

A CUDA graph holds raw device addresses. If a weight, cache or buffer it reads is reallocated
(``param.data = new``, a module attribute reassigned, a cache grown), replaying would read
freed memory. The registry snapshots the storage address of every registered tensor at
capture and compares before each replay: one pass over a flat list of tensors, plus a
re-evaluation of callable sources (caches that may swap their tensors).
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Mapping, Union

import torch
from torch import nn

Source = Union[torch.Tensor, nn.Module, Callable[[], Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


_address = torch.Tensor.data_ptr  # a reallocation moves it; an in-place shrink keeps memory valid


# Hooks of registries that were collected, removed at the next ``add``: a registry can be
# collected while torch iterates its global hooks (a garbage collection during a parameter
# registration), and removing a hook then would change the dict under that iteration.
_RETIRED_HOOKS: list = []


def _retire_hooks(handles: list) -> None:
    _RETIRED_HOOKS.extend(handles)


class StorageRegistry:
    """Named sources of tensors that captured graphs read or write."""

    def __init__(self) -> None:
        self._sources: dict[str, tuple[Source, bool]] = {}
        self._snapshot: dict[str, dict[str, int]] = {}
        self._fixed: list[tuple[str, str, torch.Tensor]] = []
        self._fixed_tensors: list[torch.Tensor] = []
        self._fixed_addresses: list[int] = []
        self._dynamic: list[str] = []
        self._module_ids: dict[int, str] = {}
        self._reassigned: str | None = None
        self._hooks: list = []

    def _on_registration(self, module: nn.Module, key: str, value: object) -> None:
        # Global torch hooks fire for every module; only ours matter.
        owner = self._module_ids.get(id(module))
        if owner is not None and self._reassigned is None:
            self._reassigned = f"{owner}: {type(module).__name__}.{key} was reassigned"

    def add(self, name: str, source: Source, mutable: bool = False) -> None:
        """Register a tensor, a module (its parameters and buffers), a mapping of tensors or a
        callable returning one (re-evaluated at every check). ``mutable`` marks state the
        forward writes (caches), which validation snapshots and restores."""
        if name in self._sources:
            raise ValueError(f"a source named {name!r} is already registered")
        if not isinstance(source, (torch.Tensor, nn.Module, Mapping)) and not callable(source):
            raise ValueError(f"cannot register {name!r}: expected a tensor, module, mapping or callable, "
                             f"got {type(source).__name__}")
        self._sources[name] = (source, mutable)
        if isinstance(source, nn.Module):
            self._module_ids.update({id(m): name for m in source.modules()})
            if not self._hooks:
                from torch.nn.modules import module as module_hooks

                while _RETIRED_HOOKS:
                    _RETIRED_HOOKS.pop().remove()
                # The hooks are global: they reach this registry through a weak reference and
                # are retired when it is collected, so a dropped runner's registry (and the
                # model it watches) can be freed without close(). (A bound method here kept
                # every model alive.)
                on_registration = weakref.WeakMethod(self._on_registration)

                def hook(module: nn.Module, key: str, value: object) -> None:
                    method = on_registration()
                    if method is not None:
                        method(module, key, value)

                self._hooks = [module_hooks.register_module_parameter_registration_hook(hook),
                               module_hooks.register_module_buffer_registration_hook(hook)]
                weakref.finalize(self, _retire_hooks, list(self._hooks))

    def close(self) -> None:
        """Remove the global module hooks (the registry stops watching reassignment)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        source, _ = self._sources[name]
        if isinstance(source, torch.Tensor):
            return {"": source}
        if isinstance(source, nn.Module):
            return {**dict(source.named_parameters()), **dict(source.named_buffers())}
        if isinstance(source, Mapping):
            return dict(source)
        return dict(source())

    def mutable_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of every mutable source, keyed ``source.tensor``."""
        return {
            f"{name}.{key}" if key else name: t
            for name, (_, mutable) in self._sources.items()
            if mutable
            for key, t in self.tensors(name).items()
        }

    def snapshot(self) -> None:
        """Record current addresses (called after a successful capture)."""
        self._reassigned = None
        self._snapshot = {name: {k: _address(t) for k, t in self.tensors(name).items()} for name in self._sources}
        self._fixed = []
        self._dynamic = []
        for name, (source, _) in self._sources.items():
            if callable(source) and not isinstance(source, (torch.Tensor, nn.Module)):
                self._dynamic.append(name)
            else:
                # Modules are enumerated once here; replay checks these tensors' addresses, and
                # the registration hooks catch a parameter or buffer replaced by a new object.
                self._fixed += [(name, key, t) for key, t in self.tensors(name).items()]
        self._fixed_tensors = [t for _, _, t in self._fixed]
        self._fixed_addresses = list(map(_address, self._fixed_tensors))

    def changed(self, deep: bool = False) -> str | None:
        """A description of the first registered tensor whose storage moved, or ``None``.

        The fast check compares the snapshotted tensor objects and re-evaluates callables;
        ``deep`` also re-enumerates modules and mappings (catches attribute reassignment).
        """
        if self._reassigned is not None:
            return self._reassigned
        # One C-level pass over every weight and buffer: this runs before every replay.
        if list(map(_address, self._fixed_tensors)) != self._fixed_addresses:
            for (name, key, t), addr in zip(self._fixed, self._fixed_addresses):
                if _address(t) != addr:
                    return f"{name}{'.' + key if key else ''} was reallocated"
        names: Iterable[str] = self._sources if deep else self._dynamic
        for name in names:
            now = {k: _address(t) for k, t in self.tensors(name).items()}
            before = self._snapshot.get(name, {})
            if now != before:
                moved = sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k))
                return f"{name}: {', '.join(moved[:3]) or 'tensors'} moved or changed"
        return None
