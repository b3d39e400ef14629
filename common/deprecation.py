"""Renamed public names keep their old spelling for one release, with a warning (one rule)."""

from __future__ import annotations

import warnings
from typing import Callable


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` was renamed ``new`` (``stacklevel`` 3: the caller of the alias)."""
    warnings.warn(f"{old} is deprecated and goes in the next release; use {new}", DeprecationWarning,
                  stacklevel=stacklevel)


def module_aliases(module: str, renamed: dict[str, tuple[str, Callable[[], object]]]) -> Callable[[str], object]:
    """A module ``__getattr__`` serving ``renamed[old] = (new spelling, loader)`` with a warning."""

    def __getattr__(name: str) -> object:
        if name in renamed:
            new, load = renamed[name]
            warn_renamed(f"{module}.{name}", new)
            return load()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["module_aliases", "warn_renamed"]
