"""Static input buffers: allocated once at the ceiling, sliced per bucket.

A captured graph reads its inputs from fixed addresses, so every per-token input of a step is
copied into these buffers before replay. ``StaticInputs.copy_in`` is the one place that
decides what padded rows hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class InputSpec:
    """One per-token input.

    Attributes:
        name: key in ``Step.inputs`` and in the dict the forward receives.
        dtype: buffer dtype (inputs are cast on copy).
        pad_value: what padded rows hold (e.g. slot ``-1`` so cache writes skip them,
            position ``0``, token id ``0``).
        row_shape: trailing shape of one row (``()`` for a per-token scalar).
    """

    name: str
    dtype: torch.dtype
    pad_value: int | float = 0
    row_shape: tuple[int, ...] = ()


NUM_TOKENS_KEY = "num_real_tokens"


class StaticInputs:
    """Per-token input buffers of ``max_tokens`` rows plus a device count of real tokens.

    The forward receives ``views(bucket)``: each buffer's first ``bucket`` rows and, under
    ``"num_real_tokens"``, an ``int64 [1]`` device tensor holding the real token count (for
    producers that must mask padded rows, e.g. MoE routing).
    """

    def __init__(self, specs: list[InputSpec] | tuple[InputSpec, ...], max_tokens: int, device: torch.device | str) -> None:
        if not specs:
            raise ValueError("StaticInputs needs at least one InputSpec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or NUM_TOKENS_KEY in names:
            raise ValueError(f"StaticInputs names must be unique and not {NUM_TOKENS_KEY!r}: {names}")
        self.specs = {s.name: s for s in specs}
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.buffers = {
            s.name: torch.full((max_tokens, *s.row_shape), s.pad_value, dtype=s.dtype, device=self.device)
            for s in specs
        }
        self.num_real_tokens = torch.zeros(1, dtype=torch.int64, device=self.device)

    def views(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of every buffer, plus the real-token count."""
        out = {name: buf[:rows] for name, buf in self.buffers.items()}
        out[NUM_TOKENS_KEY] = self.num_real_tokens
        return out

    def copy_in(self, inputs: Mapping[str, torch.Tensor], num_tokens: int, bucket: int) -> dict[str, torch.Tensor]:
        """The padding rule: rows ``[0, num_tokens)`` from ``inputs``, rows
        ``[num_tokens, bucket)`` set to each spec's pad value. Returns ``views(bucket)``.

        Raises:
            ValueError: missing or unknown inputs, wrong row count or row shape, or a bucket
                larger than the buffers.
        """
        if not 0 < num_tokens <= bucket <= self.max_tokens:
            raise ValueError(
                f"cannot place {num_tokens} tokens in bucket {bucket} (static buffers hold {self.max_tokens})"
            )
        self.check(inputs, num_tokens)
        for name, buf in self.buffers.items():
            buf[:num_tokens].copy_(inputs[name], non_blocking=True)
            if bucket > num_tokens:
                buf[num_tokens:bucket].fill_(self.specs[name].pad_value)
        self.num_real_tokens.fill_(num_tokens)
        return self.views(bucket)

    def check(self, inputs: Mapping[str, torch.Tensor], num_tokens: int) -> None:
        """Raise ``ValueError`` unless ``inputs`` holds exactly the declared per-token inputs."""
        missing = set(self.buffers) - set(inputs)
        unknown = set(inputs) - set(self.buffers)
        if missing or unknown:
            raise ValueError(f"step inputs do not match the static inputs: missing {sorted(missing)}, unknown {sorted(unknown)}")
        for name, t in inputs.items():
            want = (num_tokens, *self.specs[name].row_shape)
            if tuple(t.shape) != want:
                raise ValueError(f"step input {name!r} has shape {tuple(t.shape)}, expected {want}")

    def eager_inputs(self, inputs: Mapping[str, torch.Tensor], num_tokens: int) -> dict[str, torch.Tensor]:
        """Inputs for an unpadded eager run: the caller's tensors on the device, cast, plus the count."""
        self.check(inputs, num_tokens)
        out = {
            name: t.to(device=self.device, dtype=self.specs[name].dtype, non_blocking=True) for name, t in inputs.items()
        }
        out[NUM_TOKENS_KEY] = torch.full((1,), num_tokens, dtype=torch.int64, device=self.device)
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer a graph reads, for invalidation checks."""
        return {**self.buffers, NUM_TOKENS_KEY: self.num_real_tokens}
