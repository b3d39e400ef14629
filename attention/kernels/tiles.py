"""Token tiles of a step for the prefill indexer and sparse attention kernels.

A step is a flat batch of request chunks (decode requests of one token, prefill chunks of
many) in any order. The prefill kernels gain from tiles of neighbouring tokens *of one
request*: those tokens mostly select the same blocks, so a program that owns a tile loads
each shared K/V or index-K tile once. A fixed ``tile * BLOCK_T`` grid cannot promise that a
tile stays inside one request, so the kernels can instead take an explicit tile list of
``(first token row, end token row)`` pairs:

- ``multi``: the requests with more than one query token, cut into tiles of at most
  ``block_t`` consecutive rows that never cross a request boundary (launched with
  ``BLOCK_T = block_t``);
- ``single``: the one-token requests, one row per tile (both kernels run every tile,
  ``rows``, in one launch; the indexer scores a one-row tile in its one-token form, whose dot
  takes the keys as rows).

:func:`prefill_tiles` builds both on the host in O(tiles + requests) (NumPy, never a walk
over the tokens); :class:`TilePlanner` copies them into one persistent device buffer per
planner so the addresses stay fixed, and hands out :class:`StepTiles` views, valid until
that planner's next ``plan`` (later kernels are ordered after the copy on the stream).
Planning belongs in the backend's per-step plan, outside any CUDA graph (the prefill kernels
size their grids from host values, so they are not captured). Typical use, one planner per
tile size (the indexer's and the attention's defaults differ)::

    idx_planner = TilePlanner(max_tokens, device)                       # once
    att_planner = TilePlanner(max_tokens, device)
    idx_tiles = idx_planner.plan(meta.qo_indptr_host, indexer.tile_block_t(num_kv_heads))  # per step
    att_tiles = att_planner.plan(meta.qo_indptr_host, sparse.default_block_t(num_qo_heads // num_kv_heads))
    indexer.index_topk_prefill_tiled(iq, index_k_l, meta, topk, topk_buf, idx_tiles)  # per layer
    sparse.sparse_attention_prefill_tiled(q, k_l, v_l, topk_buf, meta, out, scale, att_tiles)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attention.staging import PingPongStaging

Tensor = torch.Tensor


def prefill_tiles(qo_indptr_host: Tensor, block_t: int) -> tuple[Tensor, Tensor]:
    """Tiles of a step's token rows, split into multi-token and one-token requests.

    Args:
        qo_indptr_host: ``int32 [B + 1]`` CPU, non-decreasing token offsets of the requests
            (``AttentionMetadata.qo_indptr_host``); request ``b`` owns rows
            ``[indptr[b], indptr[b + 1])``. Empty requests get no tile.
        block_t: most rows per multi tile (>= 1).

    Returns:
        ``(multi, single)``, both ``int32 [n, 2]`` CPU rows of ``(start, end)``:
        ``multi`` the requests with more than one token in tiles of ``<= block_t`` rows (a
        request of ``L`` tokens gives ``ceil(L / block_t)`` tiles, all full but its last),
        in batch order; ``single`` one tile per one-token request, in batch order. Together
        they cover every row exactly once, so ``len(multi) + len(single) <= indptr[-1] - indptr[0]``.

    Raises:
        ValueError: ``block_t < 1``, or ``qo_indptr_host`` not a 1-D integer CPU tensor of
            at least one entry, or decreasing.
    """
    _check_args(qo_indptr_host, block_t)
    multi, single = _tiles_np(qo_indptr_host.numpy(), block_t)
    return torch.from_numpy(multi), torch.from_numpy(single)


def _check_args(qo_indptr_host: Tensor, block_t: int) -> None:
    if not isinstance(block_t, int) or block_t < 1:
        raise ValueError(f"prefill_tiles: block_t must be an int >= 1, got {block_t!r}")
    if (not isinstance(qo_indptr_host, torch.Tensor) or qo_indptr_host.dim() != 1 or qo_indptr_host.numel() < 1
            or qo_indptr_host.device.type != "cpu" or qo_indptr_host.dtype.is_floating_point
            or qo_indptr_host.dtype == torch.bool):
        raise ValueError("prefill_tiles: qo_indptr_host must be a 1-D integer CPU tensor [B + 1], got "
                         f"{getattr(qo_indptr_host, 'dtype', type(qo_indptr_host))} "
                         f"{tuple(getattr(qo_indptr_host, 'shape', ()))} on "
                         f"{getattr(qo_indptr_host, 'device', '?')}")


def _tiles_np(indptr: np.ndarray, block_t: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`prefill_tiles` on NumPy arrays (int32 ``[n, 2]`` each). NumPy, not torch: a
    dozen small ops cost microseconds each here, torch's dispatch ~10x more per op, and
    this runs on the host every step."""
    indptr = indptr.astype(np.int64)
    starts, lens = indptr[:-1], np.diff(indptr)
    if (lens < 0).any():
        raise ValueError(f"prefill_tiles: qo_indptr_host must be non-decreasing, got {indptr.tolist()}")
    single_start = starts[lens == 1]
    single = np.stack([single_start, single_start + 1], axis=1)

    many = lens > 1
    m_start, m_len = starts[many], lens[many]
    per_req = (m_len + block_t - 1) // block_t  # tiles per multi-token request
    req = np.repeat(np.arange(m_len.size), per_req)  # request of each tile
    first = np.cumsum(per_req) - per_req  # each request's first tile index
    k = np.arange(req.size) - first[req]  # tile index inside its request
    t0 = m_start[req] + k * block_t
    t1 = np.minimum(t0 + block_t, m_start[req] + m_len[req])
    multi = np.stack([t0, t1], axis=1)
    return multi.astype(np.int32), single.astype(np.int32)


def check_tile_rows(tiles: Tensor, block_t: int, num_tokens: int) -> None:
    """Validate a kernel's ``tiles`` argument: a contiguous ``int32 [n, 2]`` tensor. When it
    is on the CPU (the interpreter) the rows are checked too (``0 <= start < end <=
    num_tokens``, ``end - start <= block_t``); on a GPU that would cost a device sync, so
    there it is the caller's contract.

    Raises:
        ValueError: naming the bad property.
    """
    if not isinstance(tiles, torch.Tensor) or tiles.dtype != torch.int32 or tiles.dim() != 2 \
            or tiles.shape[1] != 2 or not tiles.is_contiguous():
        raise ValueError(f"tiles must be a contiguous int32 [n, 2] tensor of (start, end) rows, got "
                         f"{getattr(tiles, 'dtype', type(tiles))} {tuple(getattr(tiles, 'shape', ()))}")
    if tiles.device.type == "cpu" and tiles.shape[0]:
        n = tiles[:, 1].long() - tiles[:, 0].long()
        if (tiles[:, 0] < 0).any() or (tiles[:, 1] > num_tokens).any() or (n < 1).any() or (n > block_t).any():
            raise ValueError(f"tiles rows must satisfy 0 <= start < end <= T={num_tokens} and end - start <= "
                             f"block_t={block_t}")


@dataclass(frozen=True)
class StepTiles:
    """One step's tiles on the device: views of a :class:`TilePlanner`'s persistent buffer.

    Attributes:
        rows: ``int32 [num_multi + num_single, 2]`` contiguous ``(start, end)`` rows, the
            multi tiles first (so ``rows`` itself is a valid tile list for one launch at
            ``BLOCK_T = block_t``).
        num_multi: how many leading rows are multi tiles.
        block_t: the most rows any tile holds (the multi tiles' ``BLOCK_T``).
        num_tokens: token rows the tiles cover (``indptr[-1] - indptr[0]``), so a launcher
            can tell tiles of another step from this one's without reading the device.
    """

    rows: Tensor
    num_multi: int
    block_t: int
    num_tokens: int

    @property
    def multi(self) -> Tensor:
        """``int32 [num_multi, 2]``: tiles of the multi-token requests (``<= block_t`` rows each)."""
        return self.rows[: self.num_multi]

    @property
    def single(self) -> Tensor:
        """``int32 [num_single, 2]``: one tile per one-token request."""
        return self.rows[self.num_multi :]

    @property
    def num_single(self) -> int:
        return self.rows.shape[0] - self.num_multi


class TilePlanner:
    """Persistent device buffer for :class:`StepTiles`, written once per step.

    Every tile holds at least one token, so a step of at most ``max_tokens`` tokens has at
    most ``max_tokens`` tiles: one ``int32 [max_tokens, 2]`` buffer holds both lists. The
    host rows go through pinned staging (two sets used alternately, like
    ``MetadataBuilder``), so the copy is asynchronous and a set is rewritten only after the
    copy that last read it has finished.

    Args:
        max_tokens: token capacity of one step (the metadata builder's ``max_tokens``).
        device: where the buffer lives (the kernels' device).
    """

    def __init__(self, max_tokens: int, device: torch.device | str) -> None:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"TilePlanner.max_tokens must be a positive int, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.buffer = torch.zeros((max_tokens, 2), dtype=torch.int32, device=self.device)

        def staging_set(pin: bool) -> tuple[Tensor, np.ndarray]:
            rows = torch.zeros((max_tokens, 2), dtype=torch.int32, pin_memory=pin)
            return rows, rows.numpy()  # same memory; the numpy view makes host writes cheap

        self._staging = PingPongStaging(staging_set, self.device)

    def plan(self, qo_indptr_host: Tensor, block_t: int) -> StepTiles:
        """Tiles of the step with token offsets ``qo_indptr_host`` (see :func:`prefill_tiles`),
        copied into the persistent buffer; returns views of it.

        Raises:
            ValueError: bad arguments (see :func:`prefill_tiles`), or more tokens than
                ``max_tokens``.
        """
        _check_args(qo_indptr_host, block_t)
        indptr = qo_indptr_host.numpy()
        multi, single = _tiles_np(indptr, block_t)
        nm, n = multi.shape[0], multi.shape[0] + single.shape[0]
        tokens = int(indptr[-1] - indptr[0])
        if tokens > self.max_tokens:
            raise ValueError(f"TilePlanner: step has {tokens} tokens but max_tokens={self.max_tokens}")
        with self._staging.next_set() as (_, (st, st_np)):
            st_np[:nm] = multi
            st_np[nm:n] = single
            self.buffer[:n].copy_(st[:n], non_blocking=self._staging.non_blocking)
        return StepTiles(rows=self.buffer[:n], num_multi=nm, block_t=block_t, num_tokens=tokens)


__all__ = ["StepTiles", "TilePlanner", "check_tile_rows", "prefill_tiles"]
