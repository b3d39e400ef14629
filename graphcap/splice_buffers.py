"""SpliceBuffers: activations that cross a splice point, allocated once at the ceiling.

A splice call recorded at capture keeps the tensors it was given (their addresses are baked
into the segments on either side), so a tensor allocated per layer inside a capture stays
alive for as long as the graph: sixty layers of q, index-q and attention output per bucket.
Buckets never run concurrently and layers run one after another, so one buffer per role,
sized for the largest step and viewed at each step's row count, serves every layer of every
bucket and of eager runs: a bucket then holds about one layer's crossing activations.

    buffers = SpliceBuffers(max_rows=1054, device="cuda")
    buffers.add("q", (num_heads, head_dim), torch.bfloat16)   # once, before any capture
    q = buffers.view("q", num_tokens)                          # [num_tokens, num_heads, head_dim]

Register ``buffers.tensors`` with the manager (their addresses are inside the graphs).
"""

from __future__ import annotations

import torch


class SpliceBuffers:
    """Named buffers ``[max_rows, *shape]``; ``view(name, rows)`` is the first ``rows`` rows.

    Args:
        max_rows: the most rows one step has (the step capacity, not only the capture
            ceiling: eager steps above it use the same buffers).
        device: where the buffers live.
    """

    def __init__(self, max_rows: int, device: torch.device | str) -> None:
        if max_rows < 1:
            raise ValueError(f"SpliceBuffers needs max_rows >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Allocate ``name`` as ``[max_rows, *shape]`` (zeros); a second ``add`` with the same
        shape and dtype keeps the buffer (several layers declare one role).

        Raises:
            ValueError: ``name`` exists with another shape or dtype.
        """
        full = (self.max_rows, *shape)
        old = self._buffers.get(name)
        if old is not None:
            if tuple(old.shape) != full or old.dtype != dtype:
                raise ValueError(f"splice buffer {name!r} is {tuple(old.shape)} {old.dtype}; cannot add it again as "
                                 f"{full} {dtype} (use another name)")
            return
        self._buffers[name] = torch.zeros(full, dtype=dtype, device=self.device)

    def view(self, name: str, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of buffer ``name`` (contents are whatever the last user left).

        Raises:
            KeyError: no buffer ``name`` (declare it with ``add`` first).
            ValueError: more rows than ``max_rows``.
        """
        buf = self._buffers.get(name)
        if buf is None:
            raise KeyError(f"no splice buffer {name!r}; declare it with SpliceBuffers.add before the first forward")
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows exceed splice buffer {name!r} ({self.max_rows} rows, the step capacity)")
        return buf[:rows]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer (for ``CaptureManager.register``)."""
        return dict(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())
