"""Static input buffers: allocated once at the ceiling, sliced per bucket.

A captured graph reads its inputs from fixed addresses, so every per-token input of a step
lives in one of these buffers before replay. An input is either *owned* (``StaticInputs``
allocates it and ``copy_in`` copies the step's rows in and writes the declared pad value into
the padded rows) or *external* (a buffer someone else fills at fixed addresses, e.g. the
attention metadata's positions and slot mapping: the step's input must already be a view of
it, it is never copied a second time, and its owner declares and writes the pad values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .buckets import Padding


@dataclass(frozen=True)
class InputSpec:
    """One per-token input.

    Attributes:
        name: key in ``Step.inputs`` and in the dict the forward receives.
        dtype: buffer dtype (owned inputs are cast on copy).
        pad_value: what padded rows of an owned input hold (e.g. token id ``0``); ``None``
            for an external input, whose owner pads it.
        row_shape: trailing shape of one row (``()`` for a per-token scalar).
        buffer: the external buffer (``[>= max_tokens, *row_shape]`` on the device), or
            ``None`` for an owned input.
    """

    name: str
    dtype: torch.dtype
    pad_value: int | float | None = 0
    row_shape: tuple[int, ...] = ()
    buffer: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.buffer is None) == (self.pad_value is None):
            raise ValueError(f"InputSpec {self.name!r}: give a pad_value for an owned input, or an external buffer "
                             f"(whose owner pads it) with pad_value=None; not both, not neither")
        if self.buffer is not None and (self.buffer.dtype != self.dtype
                                        or tuple(self.buffer.shape[1:]) != self.row_shape):
            raise ValueError(f"InputSpec {self.name!r}: external buffer {self.buffer.dtype} {tuple(self.buffer.shape)} "
                             f"does not match dtype {self.dtype} and row shape {self.row_shape}")

    @classmethod
    def external(cls, name: str, buffer: torch.Tensor) -> "InputSpec":
        """An input that aliases ``buffer`` (its dtype and row shape)."""
        return cls(name, buffer.dtype, None, tuple(buffer.shape[1:]), buffer)


NUM_TOKENS_KEY = "num_real_tokens"


class StaticInputs:
    """Per-token input buffers of ``max_tokens`` rows plus a device count of real tokens.

    The forward receives ``views(rows)``: each buffer's first ``rows`` rows and, under
    ``"num_real_tokens"``, an ``int64 [1]`` device tensor holding the real token count (for
    producers that must mask padded rows, e.g. MoE routing).
    """

    def __init__(self, specs: list[InputSpec] | tuple[InputSpec, ...], max_tokens: int,
                 device: torch.device | str) -> None:
        if not specs:
            raise ValueError("StaticInputs needs at least one InputSpec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or NUM_TOKENS_KEY in names:
            raise ValueError(f"StaticInputs names must be unique and not {NUM_TOKENS_KEY!r}: {names}")
        self.specs = {s.name: s for s in specs}
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = {}
        for s in specs:
            if s.buffer is None:
                self.buffers[s.name] = torch.full((max_tokens, *s.row_shape), s.pad_value, dtype=s.dtype,
                                                  device=self.device)
            elif s.buffer.shape[0] < max_tokens or s.buffer.device != self.device:
                raise ValueError(f"external input {s.name!r} has {s.buffer.shape[0]} rows on {s.buffer.device}; "
                                 f"it needs >= {max_tokens} rows on {self.device}")
            else:
                self.buffers[s.name] = s.buffer
        self.num_real_tokens = torch.zeros(1, dtype=torch.int64, device=self.device)

    def views(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of every buffer, plus the real-token count."""
        out = {name: buf[:rows] for name, buf in self.buffers.items()}
        out[NUM_TOKENS_KEY] = self.num_real_tokens
        return out

    def copy_in(self, inputs: Mapping[str, torch.Tensor], padding: Padding) -> dict[str, torch.Tensor]:
        """The padding rule: rows ``[0, num_tokens)`` of owned inputs from ``inputs``, rows
        ``[num_tokens, rows)`` set to each spec's pad value; external inputs are checked to be
        their buffer already. Returns ``views(padding.rows)``.

        Raises:
            ValueError: missing or unknown inputs, wrong row count or row shape, an external
                input that is not a view of its buffer, or more rows than the buffers hold.
        """
        n, rows = padding.num_tokens, padding.rows
        if rows > self.max_tokens:
            raise ValueError(f"cannot place {n} tokens in {rows} rows (static buffers hold {self.max_tokens})")
        self.check(inputs, n)
        for name, buf in self.buffers.items():
            spec = self.specs[name]
            if spec.buffer is not None:
                continue
            buf[:n].copy_(inputs[name], non_blocking=True)
            if rows > n:
                buf[n:rows].fill_(spec.pad_value)
        self.num_real_tokens.fill_(n)
        return self.views(rows)

    def check(self, inputs: Mapping[str, torch.Tensor], num_tokens: int) -> None:
        """Raise ``ValueError`` unless ``inputs`` holds exactly the declared per-token inputs."""
        missing = set(self.buffers) - set(inputs)
        unknown = set(inputs) - set(self.buffers)
        if missing or unknown:
            raise ValueError(f"step inputs do not match the static inputs: missing {sorted(missing)}, "
                             f"unknown {sorted(unknown)}")
        for name, t in inputs.items():
            spec = self.specs[name]
            want = (num_tokens, *spec.row_shape)
            if tuple(t.shape) != want:
                raise ValueError(f"step input {name!r} has shape {tuple(t.shape)}, expected {want}")
            if spec.buffer is not None and t.data_ptr() != spec.buffer.data_ptr():
                raise ValueError(f"step input {name!r} must be a view (from row 0) of the external buffer it aliases; "
                                 f"build the step with the owner of that buffer")

    def eager_inputs(self, inputs: Mapping[str, torch.Tensor], num_tokens: int) -> dict[str, torch.Tensor]:
        """Inputs for an unpadded eager run: the caller's tensors on the device, cast, plus the count."""
        self.check(inputs, num_tokens)
        out = {
            name: t.to(device=self.device, dtype=self.specs[name].dtype, non_blocking=True)
            for name, t in inputs.items()
        }
        out[NUM_TOKENS_KEY] = torch.full((1,), num_tokens, dtype=torch.int64, device=self.device)
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer a graph reads, for invalidation checks."""
        return {**self.buffers, NUM_TOKENS_KEY: self.num_real_tokens}
