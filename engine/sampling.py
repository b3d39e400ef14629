"""Per-request token sampling: greedy argmax, temperature, top-k, top-p, seeded rows.

The engine feeds the sampled ids straight into the next step on the device, so ``Sampler.sample``
never waits for the GPU: every decision that shapes the work (which rows are greedy, seeded,
filtered) is taken from the host-side ``SamplingParams``, never from tensor values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from common.values import as_float, as_int

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token.

    Attributes:
        temperature: logits are divided by it before the softmax; 0 means greedy (argmax).
        top_k: keep only the k most likely tokens; 0 turns the filter off.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 is off.
        seed: None draws from the sampler's generator; an int makes the row reproducible
            (see ``Sampler.sample`` for the exact rule).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # NumPy and torch scalars are numbers to a user: accepted, stored as Python numbers.
        t = as_float(self.temperature)
        if t is None or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        k = as_int(self.top_k)
        if k is None or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        p = as_float(self.top_p)
        if p is None or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        s = self.seed if self.seed is None else as_int(self.seed)
        if self.seed is not None and (s is None or not 0 <= s <= _MASK64):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        for name, value in (("temperature", t), ("top_k", k), ("top_p", p), ("seed", s)):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """The row is an exact argmax: temperature 0, or top_k 1 (one candidate left)."""
        return self.temperature == 0 or self.top_k == 1


def row_seed(seed: int, offset: int) -> int:
    """The generator seed of a seeded row: splitmix64 of (seed, offset).

    Mixed rather than added so that every bit of the result depends on both inputs (the CPU
    generator only reads the low 32 bits of its seed).
    """
    z = (seed * 0x9E3779B97F4A7C15 + offset + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """Turns a batch of logits into next-token ids, one ``SamplingParams`` per row.

    The backend is chosen once, here: a flashinfer call that fails later raises instead of
    quietly switching to torch, so a run never mixes two samplers without saying so.

    Attributes:
        device: where logits live and the generators draw.
        backend: ``"flashinfer"`` or ``"torch"``; ``why``: the reason for that choice.
        generator: draws for unseeded rows (``manual_seed`` it for a reproducible run).
    """

    def __init__(self, device: torch.device | str, use_flashinfer: bool | None = None) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.seed()  # a fresh generator has a fixed default seed; unseeded means random
        self._fi: ModuleType | None = None
        if use_flashinfer is False:
            self.backend, self.why = "torch", "use_flashinfer=False"
            return
        if device.type != "cuda":
            reason = f"device is {device.type}, flashinfer sampling needs CUDA"
        else:
            try:  # lazy: most machines that run the CPU tests have no flashinfer at all
                import flashinfer.sampling

                self._fi = flashinfer.sampling
            except ImportError as e:
                reason = f"flashinfer does not import ({e})"
            else:
                self.backend, self.why = "flashinfer", "CUDA device and flashinfer imports"
                return
        if use_flashinfer:
            raise RuntimeError(f"use_flashinfer=True but {reason}")
        self.backend, self.why = "torch", reason

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], offsets: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Next token of every row, without a host sync.

        Args:
            logits: ``[n, vocab]``, any float dtype, on ``self.device``.
            params: ``n`` entries, one per row.
            offsets: ``n`` ints, a per-row counter for seeded rows (the engine passes how many
                tokens the request has generated, so each step of a seeded request draws anew);
                None means 0 for every row. Unseeded rows ignore it.
        Returns:
            int64 ``[n]`` on ``logits.device``. Greedy rows equal ``logits.argmax(-1)`` bit for bit.

        Seeding rule: a row with ``seed=s`` draws with its own generator on this device, seeded
        with ``row_seed(s, offset)``; its token depends only on its own logits row, params and
        offset, never on the other rows or its position in the batch (same device and backend).
        """
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"logits must be a float [n, vocab] tensor, got {logits.dtype} {tuple(logits.shape)}")
        if logits.device != self.device:
            raise ValueError(f"logits are on {logits.device}, the sampler on {self.device}")
        n, vocab = logits.shape
        offsets = [0] * n if offsets is None else list(offsets)
        if len(params) != n or len(offsets) != n:
            raise ValueError(f"{n} logits rows but {len(params)} params and {len(offsets)} offsets")
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)  # fast path: no parameter copy, no softmax

        # One host->device copy for all per-row parameters (pinned + non_blocking on CUDA, so
        # the host never waits). Greedy rows get temperature 1 so the division stays finite;
        # their token comes from argmax anyway. top_k 0 (off) becomes vocab: keep everything.
        # float32 holds every top_k exactly (vocab < 2**24).
        rows = [
            [1.0 if p.greedy else float(p.temperature) for p in params],
            [float(p.top_k if p.top_k > 0 else vocab) for p in params],
            [float(p.top_p) for p in params],
            [1.0 if p.greedy else 0.0 for p in params],
        ]
        cuda = self.device.type == "cuda"
        packed = torch.tensor(rows, dtype=torch.float32, pin_memory=cuda).to(self.device, non_blocking=cuda)
        temperature, top_k, top_p, greedy = packed[0], packed[1].to(torch.int32), packed[2], packed[3] > 0.5

        scaled = logits.float() / temperature[:, None]  # fp32: dividing in bf16 would round near logits together
        sampled_rows = [p for p in params if not p.greedy]  # greedy rows' filters and seeds do not matter
        use_k = any(0 < p.top_k < vocab for p in sampled_rows)
        use_p = any(p.top_p < 1.0 for p in sampled_rows)
        seeded = [(i, p.seed, o) for i, (p, o) in enumerate(zip(params, offsets))
                  if p.seed is not None and not p.greedy]
        if self._fi is not None:
            out = self._flashinfer_draw(scaled, top_k, top_p, use_k, use_p, seeded)
        else:
            out = self._torch_draw(scaled, top_k, top_p, seeded)
        if any(p.greedy for p in params):
            out = torch.where(greedy, logits.argmax(dim=-1), out)
        return out

    def _torch_draw(
        self, scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeded: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """Sort + cumsum filtering, then an exponential race (int64 ``[n]``).

        Args:
            scaled: fp32 ``[n, vocab]``, temperature already applied.
            top_k: int32 ``[n]`` in ``[1, vocab]``; top_p: fp32 ``[n]`` in ``(0, 1]``.
            seeded: ``(row, seed, offset)`` of the seeded rows.
        """
        vocab = scaled.shape[-1]
        # stable: ties keep index order, so a row's ranking never depends on its batch.
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=scaled.device)
        # top-k by position in the sorted row: exactly k survivors even when logits tie.
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)  # renormalized over the top-k
        # top-p: drop a token once the mass strictly before it already reaches top_p. The first
        # token always stays (mass 0 before it); top_p == 1 drops nothing, even when rounding
        # lets the running sum touch 1 before the tail.
        before = torch.cumsum(probs, dim=-1) - probs
        drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        probs = probs.masked_fill(drop, 0.0)
        # Exponential race: argmax(p / E), E ~ Exp(1), picks index i with probability p_i / sum(p),
        # needs no normalisation and no sync (unlike multinomial's checks). Dropped tokens have
        # p == 0 and can never win; the clamp keeps E > 0 so 0 / 0 = NaN cannot appear.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seed, offset in seeded:
            g = torch.Generator(device=scaled.device)
            g.manual_seed(row_seed(seed, offset))
            noise[i].exponential_(generator=g)
        choice = (probs / noise.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1, keepdim=True)
        return order.gather(-1, choice).squeeze(-1)

    def _flashinfer_draw(
        self, scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_k: bool, use_p: bool,
        seeded: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        """flashinfer's sorting-free kernels, the cheapest one that covers the batch's filters.

        Same arguments as ``_torch_draw``; ``use_k``/``use_p``: some sampled row filters. A seeded
        row is redrawn alone (a batch of one with its own generator) because flashinfer's Philox
        stream also depends on the row's batch slot. Returns int64 ``[n]``.
        """
        fi = self._fi

        def draw(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
            if use_k and use_p:
                return fi.top_k_top_p_sampling_from_logits(x, k, p, generator=g)
            if use_k:
                return fi.top_k_sampling_from_probs(torch.softmax(x, dim=-1), k, generator=g)
            if use_p:
                return fi.top_p_sampling_from_probs(torch.softmax(x, dim=-1), p, generator=g)
            return fi.sampling_from_logits(x, generator=g)

        out = draw(scaled, top_k, top_p, self.generator).long()  # flashinfer returns int32
        for i, seed, offset in seeded:
            g = torch.Generator(device=scaled.device)
            g.manual_seed(row_seed(seed, offset))
            out[i : i + 1] = draw(scaled[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], g)
        return out
