"""Paged K/V and index-K caches, block tables (one row per live request) and page bookkeeping.

One page holds ``page_size`` consecutive positions of one sequence; for MiniMax-M3 the page is
the sparse block (128 tokens), so a selected logical block is exactly one page.

Block-table rows and headroom: the block table has one row per live sequence. A step may hold
``max_seqs`` requests, but a request that finishes in a step keeps its row until the caller
frees it after reading the step's outputs, while the scheduler may already admit its
replacement into the next (or, with async scheduling, the same) step. So the table holds
``max_seqs + table_row_headroom`` assignable rows (headroom defaults to ``max_seqs``: a whole
batch can finish and be replaced at once; a row costs only ``max_pages_per_seq`` int32s) plus
one more row, ``pad_table_row``, that is never assigned and stays all ``-1``: padded metadata
rows point at it, so a graph replayed with padding reads an empty sequence.

Capture reserve: graph capture, validation and recapture run dummy steps. Their block-table
rows (``capture_rows``) and pages (``capture_pages``) are set aside here and never handed to
requests, so a recapture while serving at full capacity needs nothing from live requests.
All capture sequences share the capture pages; the runner lays their tokens out at distinct
positions, so no two tokens of one dummy step write the same slot.

Cache writes by slot ``-1`` (padding) must touch no real page. The torch writer redirects them
to a private sink page stored after the last real page in every layer; the sink is never
handed out and ``k_cache``/``v_cache``/``index_k_cache`` are views that exclude it.

fp8 caches: main K/V and index-K may each be ``torch.float8_e4m3fn`` with unit scale (no
per-tensor or per-block scale: the stored value is the value), as vLLM and TensorRT-LLM run
MiniMax-M3 (K and index-K are RMS-normed, V is a projection output, so their magnitudes sit
far inside e4m3's range). Every writer clamps to ``+-448`` (e4m3's largest finite value),
then casts, rounding to nearest even: an out-of-range value saturates instead of landing as
NaN (e4m3fn has no inf, and what torch's cast does past 448 differs by device: NaN from the
scalar conversion CUDA kernels use, saturation on this CPU; the clamp makes every device
store the same bytes). NaN stays NaN. Readers upcast to their compute dtype after gathering
(exact). ``to_cache_dtype`` is the one definition of the cast; the fused producer kernel
reproduces it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

from common.values import int_tuple, is_int

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: the clamp before every fp8 cache write
# Storage dtypes a cache may use. fp64 serves float64 reference runs; fp8 is e4m3 only.
CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32, torch.float64, FP8_E4M3)
# Names a command line may give for a cache dtype (``cache_dtype``).
CACHE_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3,
    "float8_e4m3fn": FP8_E4M3,
}


def check_cache_dtype(name: str, dtype: object) -> torch.dtype:
    """``dtype`` if a cache may store it.

    Raises:
        ValueError: not a torch dtype, or one no cache stores (names ``name`` and the choices).
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name} must be a torch.dtype, got {dtype!r}")
    if dtype not in CACHE_DTYPES:
        other_fp8 = dtype.is_floating_point and dtype.itemsize == 1
        fp8 = " (fp8 caches are e4m3 only: torch.float8_e4m3fn, unit scale)" if other_fp8 else ""
        raise ValueError(f"{name}={dtype} is not a supported cache dtype{fp8}; choose one of "
                         f"{', '.join(str(d) for d in CACHE_DTYPES)}")
    return dtype


def cache_dtype(value: torch.dtype | str) -> torch.dtype:
    """A cache dtype from a torch dtype or a name (``bf16``, ``fp16``, ``fp32``, ``fp8``, ...).

    Raises:
        ValueError: an unknown name or an unsupported dtype.
    """
    if isinstance(value, str):
        if value.lower() not in CACHE_DTYPE_NAMES:
            raise ValueError(f"unknown KV cache dtype {value!r}; choose one of {sorted(CACHE_DTYPE_NAMES)}")
        return CACHE_DTYPE_NAMES[value.lower()]
    return check_cache_dtype("kv_dtype", value)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` stores fp8 e4m3 (and its writers clamp)."""
    return dtype == FP8_E4M3


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: for fp8 e4m3, ``x.clamp(-448, 448)`` cast
    (round to nearest even; NaN stays NaN); otherwise the plain cast. Capturable."""
    if is_fp8(dtype) and x.dtype != dtype:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)


def _scatter_rows(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, idx, src)``; one-byte (fp8) rows move as their bytes, because
    ``index_copy_`` has no fp8 kernel on CPU (the bytes are the values: nothing is converted)."""
    if dst.element_size() == 1 and dst.dtype.is_floating_point:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(0, idx, src)


@dataclass(frozen=True)
class KVCacheConfig:
    """Sizes of the paged caches.

    Attributes:
        num_layers: decoder layers; every layer has main K/V pages.
        sparse_layers: layer indices that also cache index-K (sorted, unique).
        num_kv_heads: K/V heads per layer.
        head_dim: K/V head width.
        index_dim: index-K width (one shared index-key head per token).
        page_size: positions per page; equals the sparse block size.
        num_pages: real pages per layer (shared by all sequences).
        max_seqs: requests one step may hold (metadata capacity).
        max_pages_per_seq: block-table width; a sequence holds at most
            ``max_pages_per_seq * page_size`` positions.
        dtype: main K/V storage dtype (one of ``CACHE_DTYPES``; ``torch.float8_e4m3fn``: fp8
            e4m3, unit scale, clamped to +-448 on write; see the module docstring).
        index_dtype: index-K storage dtype (the same choices).
        device: where the caches live.
        table_row_headroom: extra assignable block-table rows beyond ``max_seqs``; ``None``
            means ``max_seqs`` (see the module docstring).
        capture_rows, capture_pages: block-table rows and pages reserved for the dummy steps of
            capture and validation (see the module docstring); 0 when nothing is captured.
    """

    num_layers: int
    sparse_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    index_dim: int
    page_size: int
    num_pages: int
    max_seqs: int
    max_pages_per_seq: int
    dtype: torch.dtype = torch.bfloat16
    index_dtype: torch.dtype = torch.bfloat16
    device: torch.device | str = "cpu"
    table_row_headroom: int | None = None
    capture_rows: int = 0
    capture_pages: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "index_dim", "page_size", "num_pages",
                     "max_seqs", "max_pages_per_seq"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"KVCacheConfig.{name} must be a positive int, got {v!r}")
        sl = int_tuple("KVCacheConfig.sparse_layers", self.sparse_layers)
        object.__setattr__(self, "sparse_layers", sl)
        if list(sl) != sorted(set(sl)) or (sl and (sl[0] < 0 or sl[-1] >= self.num_layers)):
            raise ValueError(
                f"KVCacheConfig.sparse_layers must be strictly increasing layer ids in "
                f"[0, num_layers={self.num_layers}), got {sl!r}"
            )
        for name in ("dtype", "index_dtype"):
            check_cache_dtype(f"KVCacheConfig.{name}", getattr(self, name))
        try:
            object.__setattr__(self, "device", torch.device(self.device))
        except (RuntimeError, TypeError):
            raise ValueError(f"KVCacheConfig.device {self.device!r} is not a torch device") from None
        if self.table_row_headroom is None:
            object.__setattr__(self, "table_row_headroom", self.max_seqs)
        for name in ("table_row_headroom", "capture_rows", "capture_pages"):
            v = getattr(self, name)
            if not is_int(v) or v < 0:
                raise ValueError(f"KVCacheConfig.{name} must be an int >= 0, got {v!r}")

    @property
    def max_live_seqs(self) -> int:
        """Sequences that may hold a block-table row at once."""
        return self.max_seqs + self.table_row_headroom  # type: ignore[operator]

    @property
    def max_table_rows(self) -> int:
        """Block-table rows: the assignable ones, the capture rows and the pad row."""
        return self.max_live_seqs + self.capture_rows + 1

    @property
    def total_pages(self) -> int:
        """Pages per layer that attention may read: the assignable ones plus the capture pages."""
        return self.num_pages + self.capture_pages

    @property
    def max_seq_len(self) -> int:
        return self.max_pages_per_seq * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token position takes over all layers: K and V of every layer plus
        index-K of the sparse layers (what bounds how many tokens fit)."""
        kv = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return kv + len(self.sparse_layers) * self.index_dim * self.index_dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated caches: every page (assignable, capture, and the sink page)."""
        return (self.total_pages + 1) * self.page_size * self.bytes_per_token


class PagedKVCache:
    """Paged caches plus per-sequence page bookkeeping.

    Attributes:
        k_cache, v_cache: ``[num_layers, total_pages, page_size, num_kv_heads, head_dim]``
            (``total_pages = num_pages + capture_pages``).
        index_k_cache: ``[num_sparse_layers, total_pages, page_size, index_dim]``.
        block_tables: ``int32 [max_table_rows, max_pages_per_seq]`` on the cache device, ``-1``
            where unused; row ``pad_table_row`` is always all ``-1``.
    """

    def __init__(self, config: KVCacheConfig) -> None:
        c = config
        self.config = c
        self.page_size = c.page_size
        self.num_pages = c.num_pages
        dev = c.device
        # One extra page per layer: the sink that slot -1 writes land in (see module docstring).
        total = c.total_pages
        self._k_store = torch.zeros(c.num_layers, total + 1, c.page_size, c.num_kv_heads, c.head_dim,
                                    dtype=c.dtype, device=dev)
        self._v_store = torch.zeros_like(self._k_store)
        self._ik_store = torch.zeros(len(c.sparse_layers), total + 1, c.page_size, c.index_dim,
                                     dtype=c.index_dtype, device=dev)
        self.k_cache = self._k_store[:, :total]
        self.v_cache = self._v_store[:, :total]
        self.index_k_cache = self._ik_store[:, :total]
        self._sink_slot = total * c.page_size
        self.block_tables = torch.full((c.max_table_rows, c.max_pages_per_seq), -1, dtype=torch.int32, device=dev)
        self.pad_table_row = c.max_table_rows - 1
        self._sparse_ordinal = {layer: i for i, layer in enumerate(c.sparse_layers)}
        # Host mirror. Free lists are stacks so the most recently freed page/row is reused first.
        self._free_pages: list[int] = list(range(c.num_pages - 1, -1, -1))
        self._free_rows: list[int] = list(range(c.max_live_seqs - 1, -1, -1))
        # The capture reserve: rows after the assignable ones, pages after the assignable ones.
        self._capture_pages = list(range(c.num_pages, total))
        self._free_capture_rows: list[int] = list(range(c.max_live_seqs + c.capture_rows - 1, c.max_live_seqs - 1, -1))
        self._capture_seqs: set[Hashable] = set()
        self._pages: dict[Hashable, list[int]] = {}
        self._row: dict[Hashable, int] = {}
        self._written: dict[Hashable, int] = {}  # positions < this hold this sequence's K/V

    # ---- bookkeeping (host) -------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_live_seqs(self) -> int:
        return len(self._row)

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self._row

    def sparse_index(self, layer: int) -> int:
        """The ordinal of sparse layer ``layer`` in ``index_k_cache``."""
        try:
            return self._sparse_ordinal[layer]
        except KeyError:
            raise ValueError(
                f"layer {layer} is not a sparse layer (sparse_layers={self.config.sparse_layers}); "
                "it has no index-K cache"
            ) from None

    def _check_seq(self, seq_id: Hashable) -> list[int]:
        pages = self._pages.get(seq_id)
        if pages is None:
            raise ValueError(f"unknown sequence {seq_id!r}; call add_sequence({seq_id!r}) first")
        return pages

    def add_sequence(self, seq_id: Hashable) -> int:
        """Give ``seq_id`` a block-table row (all ``-1``) and return it.

        Raises:
            ValueError: ``seq_id`` is already live.
            RuntimeError: every assignable row is taken (free finished sequences first, or
                raise ``max_seqs``/``table_row_headroom``).
        """
        if seq_id in self._row:
            raise ValueError(f"sequence {seq_id!r} is already in the cache (block-table row {self._row[seq_id]})")
        if not self._free_rows:
            raise RuntimeError(
                f"too many sequences: all {self.config.max_live_seqs} block-table rows are in use "
                f"(max_seqs={self.config.max_seqs} + table_row_headroom={self.config.table_row_headroom}); "
                f"free finished sequences or raise those limits"
            )
        row = self._free_rows.pop()
        self._row[seq_id] = row
        self._pages[seq_id] = []
        self._written[seq_id] = 0
        return row

    def add_capture_sequence(self, seq_id: Hashable, first_page: int, num_written: int) -> int:
        """A dummy sequence for capture and validation on the capture reserve: a capture row
        whose pages are capture pages ``first_page, first_page + 1, ...`` (shared with the other
        capture sequences; never returned to the free list) with positions ``< num_written``
        counted as written. Returns its row.

        Raises:
            ValueError: ``seq_id`` is live, or ``first_page`` outside the capture pages.
            RuntimeError: every capture row is taken (raise ``capture_rows``).
        """
        c = self.config
        if seq_id in self._row:
            raise ValueError(f"sequence {seq_id!r} is already in the cache (block-table row {self._row[seq_id]})")
        if not 0 <= first_page < len(self._capture_pages):
            raise ValueError(f"capture page {first_page} is outside the {len(self._capture_pages)} capture pages "
                             f"(KVCacheConfig.capture_pages)")
        if not self._free_capture_rows:
            raise RuntimeError(f"all {c.capture_rows} capture rows are in use (KVCacheConfig.capture_rows); "
                               f"release the previous dummy requests first")
        pages = self._capture_pages[first_page : first_page + c.max_pages_per_seq]
        if num_written > len(pages) * self.page_size:
            raise ValueError(f"capture sequence {seq_id!r}: {num_written} written positions exceed its "
                             f"{len(pages) * self.page_size} capture positions")
        row = self._free_capture_rows.pop()
        self._row[seq_id], self._pages[seq_id], self._written[seq_id] = row, list(pages), num_written
        self._capture_seqs.add(seq_id)
        self.block_tables[row, : len(pages)] = _to_device(pages, self.block_tables.device)
        return row

    def table_row(self, seq_id: Hashable) -> int:
        """Block-table row of a live sequence."""
        self._check_seq(seq_id)
        return self._row[seq_id]

    def num_reserved_tokens(self, seq_id: Hashable) -> int:
        """Positions ``< this`` have pages."""
        return len(self._check_seq(seq_id)) * self.page_size

    def num_written(self, seq_id: Hashable) -> int:
        """Positions ``< this`` hold K/V written for ``seq_id``: the only positions attention of
        this sequence may read (a page's later slots may hold a previous owner's data)."""
        self._check_seq(seq_id)
        return self._written[seq_id]

    def set_written(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that positions ``< num_tokens`` now hold ``seq_id``'s K/V (after a step wrote
        them), or rewind to fewer (the later positions are dropped and rewritten later).

        Raises:
            ValueError: unknown sequence, or positions beyond its reserved pages.
        """
        pages = self._check_seq(seq_id)
        if not is_int(num_tokens) or not 0 <= num_tokens <= len(pages) * self.page_size:
            raise ValueError(f"sequence {seq_id!r}: {num_tokens!r} written positions do not fit its "
                             f"{len(pages) * self.page_size} reserved positions")
        self._written[seq_id] = num_tokens

    def pages_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """New pages ``reserve(seq_id, num_tokens)`` would take (0 if covered); changes nothing."""
        return max(0, -(-num_tokens // self.page_size) - len(self._check_seq(seq_id)))

    def pages(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's page ids (O(pages); for tests and debugging)."""
        return list(self._check_seq(seq_id))

    def reserve(self, seq_id: Hashable, num_tokens: int) -> None:
        """Make sure positions ``< num_tokens`` of ``seq_id`` have pages.

        Only the new page ids are written to the device block table (O(new pages)).

        Raises:
            ValueError: unknown sequence, or ``num_tokens`` above ``max_pages_per_seq * page_size``.
            RuntimeError: not enough free pages; nothing is changed.
        """
        pages = self._check_seq(seq_id)
        if not is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"reserve needs num_tokens >= 0, got {num_tokens!r}")
        if num_tokens > self.config.max_seq_len:
            raise ValueError(
                f"sequence {seq_id!r} needs {num_tokens} positions but a sequence holds at most "
                f"max_pages_per_seq * page_size = {self.config.max_pages_per_seq} * {self.page_size} = "
                f"{self.config.max_seq_len}; raise max_pages_per_seq"
            )
        need = self.pages_needed(seq_id, num_tokens)
        if need <= 0:
            return
        if seq_id in self._capture_seqs:
            raise ValueError(f"capture sequence {seq_id!r} needs {num_tokens} positions, beyond its capture pages; "
                             f"raise KVCacheConfig.capture_pages")
        if need > len(self._free_pages):
            raise RuntimeError(
                f"out of KV pages: sequence {seq_id!r} needs {need} more page(s) for {num_tokens} positions "
                f"but only {len(self._free_pages)} of {self.num_pages} are free; free finished sequences "
                f"or raise num_pages"
            )
        new = [self._free_pages.pop() for _ in range(need)]
        old = len(pages)
        pages.extend(new)
        row = self._row[seq_id]
        self.block_tables[row, old : old + need] = _to_device(new, self.block_tables.device)

    def free(self, seq_id: Hashable) -> None:
        """Return the sequence's pages and row; its block-table row goes back to ``-1``."""
        pages = self._check_seq(seq_id)
        row = self._row.pop(seq_id)
        del self._pages[seq_id]
        del self._written[seq_id]
        if pages:
            self.block_tables[row, : len(pages)] = -1
        if seq_id in self._capture_seqs:  # its pages are the shared capture pages: they stay reserved
            self._capture_seqs.discard(seq_id)
            self._free_capture_rows.append(row)
            return
        # Reversed so the sequence's first page is the next one handed out.
        self._free_pages.extend(reversed(pages))
        self._free_rows.append(row)

    def slots(self, seq_id: Hashable, start: int, n: int) -> list[int]:
        """Flat slot ids (``page * page_size + offset``) of positions ``start .. start+n-1``.

        O(n): only the pages those positions span are read.

        Raises:
            ValueError: unknown sequence, or positions beyond the reserved pages.
        """
        pages = self._check_seq(seq_id)
        if start < 0 or n < 0:
            raise ValueError(f"slots needs start >= 0 and n >= 0, got start={start}, n={n}")
        end = start + n
        if end > len(pages) * self.page_size:
            raise ValueError(
                f"positions {start}..{end - 1} of sequence {seq_id!r} are beyond its reserved "
                f"{len(pages) * self.page_size} positions; call reserve({seq_id!r}, {end}) first"
            )
        ps = self.page_size
        out: list[int] = []
        pos = start
        while pos < end:
            i, off = divmod(pos, ps)
            stop = min(end, (i + 1) * ps)
            base = pages[i] * ps
            out.extend(range(base + off, base + off + (stop - pos)))
            pos = stop
        return out

    # ---- device writes (capturable) -----------------------------------------------------

    def write(
        self,
        layer: int,
        slot_mapping: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_k: torch.Tensor | None = None,
    ) -> None:
        """Scatter one step's K/V (and index-K) into the caches.

        Capturable: fixed shapes, no host sync, no boolean indexing. Slot ``-1`` writes only
        the private sink page.

        Args:
            layer: decoder layer.
            slot_mapping: ``int64 [T]`` flat slots, ``-1`` for padded rows.
            k, v: ``[T, num_kv_heads, head_dim]``, any float dtype (cast with ``to_cache_dtype``:
                an fp8 cache stores ``x.clamp(-448, 448)`` in e4m3).
            index_k: ``[T, index_dim]`` for sparse layers, or ``None`` to skip index-K.
        """
        c = self.config
        if not 0 <= layer < c.num_layers:
            raise ValueError(f"layer {layer} is out of range [0, {c.num_layers})")
        t = slot_mapping.shape[0]
        if slot_mapping.dim() != 1 or k.shape != (t, c.num_kv_heads, c.head_dim) or v.shape != k.shape:
            raise ValueError(
                f"write expects slot_mapping [T], k/v [T, {c.num_kv_heads}, {c.head_dim}]; got "
                f"{tuple(slot_mapping.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        idx = torch.where(slot_mapping >= 0, slot_mapping, self._sink_slot).to(torch.int64)
        _scatter_rows(self._k_store[layer].view(-1, c.num_kv_heads, c.head_dim), idx, to_cache_dtype(k, c.dtype))
        _scatter_rows(self._v_store[layer].view(-1, c.num_kv_heads, c.head_dim), idx, to_cache_dtype(v, c.dtype))
        if index_k is not None:
            s = self.sparse_index(layer)
            if index_k.shape != (t, c.index_dim):
                raise ValueError(f"write expects index_k [T, {c.index_dim}], got {tuple(index_k.shape)}")
            _scatter_rows(self._ik_store[s].view(-1, c.index_dim), idx, to_cache_dtype(index_k, c.index_dtype))


def _to_device(pages: list[int], device: torch.device) -> torch.Tensor:
    """Page ids as an int32 device tensor, copied without a host sync: a blocking copy would
    wait for every step already queued and stall a scheduler that runs ahead of the GPU
    (a pageable source is staged by the driver before the call returns, so the temporary may
    die at once)."""
    return torch.tensor(pages, dtype=torch.int32).to(device, non_blocking=True)

