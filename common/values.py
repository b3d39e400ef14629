"""Checks of user-given values: ints that are not bools, integer-like scalars, lists of ints,
finite numbers.

Python says ``True`` is an ``int``; a size, a count or a token id never is one. NumPy and torch
integer scalars are integers to a user (``np.int64(3)`` from an array, ``tensor(3)`` from a
tensor) and are accepted where a value is read from the user (``as_int``), then stored as
plain ``int``; floats are never truncated.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch


def is_int(value: object) -> bool:
    """A Python ``int`` that is not a bool (the check for values the code itself builds)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value: object) -> int | None:
    """``value`` as an ``int`` if it is an integer: Python, NumPy or a 0-d integer tensor, never a
    bool or a float (``3.0`` is refused, not truncated). ``None`` otherwise."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            return None
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    return None


def as_float(value: object) -> float | None:
    """``value`` as a finite ``float`` if it is a real number (Python, NumPy, 0-d tensor), never a
    bool, a string, NaN or infinity. ``None`` otherwise."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() or value.is_complex() or value.dtype == torch.bool:
            return None
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    out = float(value)
    return out if math.isfinite(out) else None


def integer_items(what: str, values: object, noun: str = "integer") -> tuple[int, ...]:
    """Integer items (token ids, say) as a tuple of Python ints: a list or tuple, a NumPy array,
    a 1-D integer tensor or any iterable of integers (``as_int``); never truncated.

    Raises:
        ValueError: a string or non-iterable, a float or bool tensor, or an item that is not an
            integer, naming it as ``what`` (e.g. ``"request 'a': token_ids"``), its position and
            what it should be (``noun``).
    """
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"{what} must be a 1-D integer sequence, got a {values.dtype} tensor of shape "
                             f"{tuple(values.shape)}")
        return tuple(values.tolist())
    if isinstance(values, (list, tuple)) and all(type(t) is int for t in values):
        return tuple(values)  # the common case, checked at C speed (bools are not type int)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{what} must be a sequence of integers, got {type(values).__name__}")
    out = []
    for i, t in enumerate(values):
        v = as_int(t)
        if v is None:
            raise ValueError(f"{what}[{i}] = {t!r} is not an {noun}")
        out.append(v)
    return tuple(out)


def int_tuple(name: str, value: object) -> tuple[int, ...]:
    """Any iterable of ints (tuple, list, range, generator) as a tuple.

    Raises:
        ValueError: a string, a non-iterable, or an element that is not an int, naming ``name``.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be an iterable of ints, got {value!r}")
    out = tuple(value)
    bad = [x for x in out if not is_int(x)]
    if bad:
        raise ValueError(f"{name} must hold ints, got {bad[0]!r} in {out!r}")
    return out


__all__ = ["as_float", "as_int", "int_tuple", "integer_items", "is_int"]
