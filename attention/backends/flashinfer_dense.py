"""Dense causal GQA over the paged cache with flashinfer (MiniMax-M3 layers 0..2).

Plan/run split: ``plan(meta)`` runs once per step on the host and serves every dense layer;
``run(layer, q, out)`` only launches kernels.

Two kinds of flashinfer wrapper share one float workspace and the persistent page buffers:

- Uniform decode at a capture batch size: ``BatchDecodeWithPagedKVCacheWrapper`` in CUDA-graph
  mode. A graph-mode wrapper's batch size is fixed (flashinfer takes it from the length of the
  ``last_page_len`` buffer), so there is one wrapper per batch size in ``decode_batch_sizes``,
  each given views (from offset 0) of the same indptr / indices / last_page_len buffers. A
  captured decode graph reads those fixed addresses plus the wrapper's plan workspace, which
  ``plan`` rewrites before every replay. Tensor cores (the fa2 prefill kernel) serve the large
  GQA groups (16 q heads per kv head at full width, 8 at rank-of-8) better than the CUDA-core
  decode kernel.
- Everything else (mixed prefill/decode chunks, decode at other batch sizes):
  ``BatchPrefillWithPagedKVCacheWrapper``, causal, in eager mode. Those steps never run inside
  a captured graph (the dense splice runs eagerly between graph segments), and eager mode lets
  the batch size change every step.

Host cost of ``plan`` is O(requests): indptr and last_page_len come from the metadata's host
copy of ``kv_lens``; the page ids themselves are gathered on the device from the cache's
block-table rows (``seq_slots``), so no per-page host walk ever happens. flashinfer's plan needs
only the host indptr (it schedules by pages per request); the indices tensor we hand it is a
view of its own indices buffer, so its copy in graph mode copies the data onto itself.

Padded request rows (``meta.pad_to(bucket)``) have no pages: flashinfer attends to nothing and
writes zeros to their output rows.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Sequence

import torch

from graphcap.buckets import default_buckets

from kvcache.paged import PagedKVCache
from attention.metadata import AttentionMetadata

_INSTALL_HINT = "install it with the 'cuda' extra: pip install 'graphcap[cuda]' (package flashinfer-python)"


def import_flashinfer() -> Any:
    """The flashinfer module.

    Raises:
        ImportError: flashinfer is not installed; says how to install it.
    """
    try:
        return importlib.import_module("flashinfer")
    except ImportError as e:
        raise ImportError(f"the flashinfer attention backend needs flashinfer: {_INSTALL_HINT} ({e})") from e


def flashinfer_available() -> bool:
    """True when flashinfer imports (says nothing about the GPU)."""
    try:
        import_flashinfer()
    except ImportError:
        return False
    return True


def paged_kv_layout(kv_lens: torch.Tensor, num_rows: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flashinfer's description of a step's pages, on the host, in O(requests).

    Args:
        kv_lens: CPU int32 ``[B]``, context length of each real request (>= 1).
        num_rows: requests flashinfer sees (``>= B``); rows past ``B`` are padding with no pages.
        page_size: positions per page.
    Returns:
        ``indptr`` int32 ``[num_rows + 1]`` (page offsets of each request) and
        ``last_page_len`` int32 ``[num_rows]`` (positions in each request's last page, in
        ``[1, page_size]``; 0 for padding).
    """
    b = kv_lens.shape[0]
    if num_rows < b:
        raise ValueError(f"num_rows={num_rows} is below the {b} real requests")
    kv_lens = kv_lens.to(torch.int32)
    pages = (kv_lens + page_size - 1) // page_size
    indptr = torch.zeros(num_rows + 1, dtype=torch.int32)
    indptr[1 : b + 1] = torch.cumsum(pages, 0, dtype=torch.int32)
    indptr[b + 1 :] = indptr[b]
    last_page_len = torch.zeros(num_rows, dtype=torch.int32)
    last_page_len[:b] = kv_lens - (pages - 1).clamp(min=0) * page_size
    return indptr, last_page_len


def gather_page_indices(indptr: torch.Tensor, seq_slots: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor) -> None:
    """Concatenated page ids of each request, gathered on the device from its block-table row.

    ``out[indptr[i] + j] = block_tables[seq_slots[i], j]`` for ``j < indptr[i+1] - indptr[i]``.
    A fixed handful of kernels whatever the batch: no host work per page.

    Args:
        indptr: int32 ``[R + 1]`` page offsets, on ``out``'s device.
        seq_slots: int32 ``[R]`` block-table rows.
        block_tables: int32 ``[max_seq_slots, max_pages_per_seq]``, contiguous.
        out: int32 ``[indptr[-1]]``, written in place.
    """
    n = out.shape[0]
    if n == 0:
        return
    pos = torch.arange(n, dtype=indptr.dtype, device=out.device)
    req = torch.searchsorted(indptr[1:], pos, right=True)  # request owning each output entry
    flat = seq_slots[req].long() * block_tables.shape[1] + (pos - indptr[req])
    torch.index_select(block_tables.view(-1), 0, flat, out=out)


class _Plan(NamedTuple):
    wrapper: Any
    rows: int  # q rows the wrapper reads (padded batch for decode, real tokens otherwise)
    graph_safe: bool


class FlashinferDenseAttention:
    """flashinfer paged dense attention for the dense layers, planned once per step.

    Args:
        cache: the paged cache (CUDA, bf16 or fp16); layer ``l`` reads ``k_cache[l]``/``v_cache[l]``.
        num_qo_heads: query heads (a multiple of the cache's kv heads).
        scale: softmax scale; default ``head_dim ** -0.5``.
        max_seqs: request capacity of the metadata (default the cache's); buffers hold one
            padding row more, as the metadata's do.
        max_tokens: step capacity; sets the default ``decode_batch_sizes``.
        decode_batch_sizes: uniform-decode batch sizes that get a CUDA-graph decode wrapper
            (the capture buckets); default graphcap's default buckets for ``max_tokens`` up
            to ``max_seqs + 1``. Other sizes run through the eager wrapper.
        prefill_backend: flashinfer backend of the eager wrapper (``"fa2"``; ``"fa3"`` or
            ``"auto"`` on Hopper are faster for long chunks but JIT another module).
        workspace_bytes: flashinfer's float workspace (split-KV partial results).

    Raises:
        ImportError: flashinfer is not installed.
        RuntimeError: the cache is not on a CUDA device.
        ValueError: inconsistent sizes or an unsupported cache dtype.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        num_qo_heads: int,
        *,
        scale: float | None = None,
        max_seqs: int | None = None,
        max_tokens: int = 512,
        decode_batch_sizes: Sequence[int] | None = None,
        prefill_backend: str = "fa2",
        workspace_bytes: int = 128 << 20,
    ) -> None:
        self._fi = import_flashinfer()
        c = cache.config
        device = cache.block_tables.device
        if device.type != "cuda":
            raise RuntimeError(
                f"flashinfer runs on CUDA only but the cache is on {device}; use the 'torch' or 'triton' backend there"
            )
        if num_qo_heads < 1 or num_qo_heads % c.num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a positive multiple of num_kv_heads={c.num_kv_heads}")
        if c.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the flashinfer dense path reads bf16/fp16 caches, got {c.dtype}")
        self.cache = cache
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, c.num_kv_heads, c.head_dim
        self.page_size = c.page_size
        self.dtype = c.dtype
        self.scale = c.head_dim**-0.5 if scale is None else float(scale)
        self.max_seqs = c.max_seqs if max_seqs is None else max_seqs
        rows = self.max_seqs + 1  # metadata rows, padding row included
        if decode_batch_sizes is None:  # graphcap's default capture buckets that a decode batch can fill
            decode_batch_sizes = [b for b in default_buckets(max_tokens) if b <= rows]
        bad = [b for b in decode_batch_sizes if not 1 <= b <= rows]
        if bad:
            raise ValueError(f"decode_batch_sizes {bad} must lie in [1, max_seqs + 1 = {rows}]")
        self.decode_batch_sizes = frozenset(int(b) for b in decode_batch_sizes)
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)  # flashinfer: zero on first use
        self._indptr_buf = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self._last_page_len_buf = torch.zeros(rows, dtype=torch.int32, device=device)
        # A step's requests hold distinct pages, so a step never lists more than the pool
        # (warmup lists one page per decode row, hence the max).
        self._indices_buf = torch.zeros(max(c.num_pages, rows), dtype=torch.int32, device=device)
        self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=prefill_backend)
        self._decode: dict[int, Any] = {}
        self._planned: _Plan | None = None

    def _decode_wrapper(self, batch: int) -> Any:
        """The graph-mode decode wrapper for ``batch`` requests (made on first use, in plan)."""
        w = self._decode.get(batch)
        if w is None:
            w = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self._indptr_buf[: batch + 1],
                paged_kv_indices_buffer=self._indices_buf,
                paged_kv_last_page_len_buffer=self._last_page_len_buf[:batch],
                backend="fa2",  # pinned: "auto" may route graph plans to cuDNN/XQA on some GPUs
            )
            self._decode[batch] = w
        return w

    def plan(self, meta: AttentionMetadata) -> None:
        """Host work for one step; every dense layer then runs with it.

        For a captured uniform-decode bucket pass ``meta.pad_to(bucket)``: the decode wrapper's
        batch is the number of request rows of ``meta``, padding included.

        Raises:
            ValueError: metadata of another cache, or more request rows than ``max_seqs + 1``.
        """
        self._planned = None  # a failed plan leaves no stale plan for run() to use
        if meta.block_tables is not self.cache.block_tables:
            raise ValueError("metadata was built for a different cache than this flashinfer dense path's")
        rows, capacity = meta.seq_slots.shape[0], self._last_page_len_buf.shape[0]
        if rows > capacity:
            raise ValueError(f"step has {rows} request rows but the flashinfer buffers hold {capacity}; raise max_seqs")
        indptr, last_page_len = paged_kv_layout(meta.kv_lens_host, rows, self.page_size)
        total = int(indptr[-1])
        if total > self._indices_buf.shape[0]:
            raise ValueError(
                f"step lists {total} pages but the page buffer holds {self._indices_buf.shape[0]}; "
                f"kv_lens do not match the sequences' reserved pages"
            )
        indptr_dev = self._indptr_buf[: rows + 1]
        indptr_dev.copy_(indptr, non_blocking=True)
        indices = self._indices_buf[:total]
        gather_page_indices(indptr_dev, meta.seq_slots, meta.block_tables, indices)
        dims = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)
        kw = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        if meta.uniform_decode and rows in self.decode_batch_sizes:
            w = self._decode_wrapper(rows)
            w.plan(indptr, indices, last_page_len, *dims, **kw)
            self._planned = _Plan(w, rows, True)
        else:
            b = meta.num_seqs
            self._prefill.plan(meta.qo_indptr_host, indptr[: b + 1], indices, last_page_len[:b], *dims, causal=True, **kw)
            self._planned = _Plan(self._prefill, meta.num_tokens, False)

    def run(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """Causal GQA of one dense layer; kernels only.

        Args:
            layer: decoder layer (index into the cache).
            q: ``[T, num_qo_heads, head_dim]`` in the cache dtype, last dim contiguous;
                ``T`` at least the planned rows (a bucket's padded rows are fine).
            out: ``[T, num_qo_heads, head_dim]`` contiguous, same dtype. Rows of padded decode
                requests get zeros; rows past the planned ones are untouched.
        Raises:
            RuntimeError: no plan, or a CUDA-graph capture of a step planned on the eager
                wrapper (add its batch size to ``decode_batch_sizes``).
            ValueError: shapes or dtypes that do not match.
        """
        p = self._planned
        if p is None:
            raise RuntimeError("flashinfer dense attention ran before plan(meta); plan every step before the forward")
        if not p.graph_safe and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"a CUDA graph is capturing flashinfer dense attention planned on the eager wrapper ({p.rows} tokens); "
                f"only uniform decode steps with a batch in decode_batch_sizes={sorted(self.decode_batch_sizes)} "
                f"can be captured: plan with meta.pad_to(bucket) and add the bucket to decode_batch_sizes"
            )
        want = (self.num_qo_heads, self.head_dim)
        if q.dim() != 3 or tuple(q.shape[1:]) != want or out.shape != q.shape or q.shape[0] < p.rows:
            raise ValueError(f"q and out must be [T >= {p.rows}, {want[0]}, {want[1]}]; got {tuple(q.shape)}, {tuple(out.shape)}")
        if q.dtype != self.dtype or out.dtype != self.dtype:
            raise ValueError(f"q and out must be {self.dtype} (the cache dtype); got {q.dtype}, {out.dtype}")
        if q.stride(-1) != 1 or not out.is_contiguous():
            raise ValueError("flashinfer needs q with a contiguous last dim and a contiguous out")
        kv = (self.cache.k_cache[layer], self.cache.v_cache[layer])
        p.wrapper.run(q[: p.rows], kv, out=out[: p.rows])

    def warmup(self) -> None:
        """JIT-compile flashinfer's kernel and make every decode wrapper before any capture.

        flashinfer builds a module per (dtype, head_dim, ...) the first time it is planned
        (about 20 s on an H200); a capture must never trigger that. Plans and runs one
        single-token request per decode batch size and one through the eager wrapper, all
        reading page 0 of layer 0 (the cache is only read). Leaves no plan behind.
        """
        sizes = sorted(self.decode_batch_sizes)
        n = max(sizes, default=1)
        q = torch.zeros(n, self.num_qo_heads, self.head_dim, dtype=self.dtype, device=self._workspace.device)
        out = torch.empty_like(q)
        kv = (self.cache.k_cache[0], self.cache.v_cache[0])
        kw = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        dims = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)
        self._indices_buf[:n].zero_()
        for b in sizes:
            w = self._decode_wrapper(b)
            w.plan(torch.arange(b + 1, dtype=torch.int32), self._indices_buf[:b], torch.ones(b, dtype=torch.int32), *dims, **kw)
            w.run(q[:b], kv, out=out[:b])
        one = torch.tensor([0, 1], dtype=torch.int32)
        self._prefill.plan(one, one, self._indices_buf[:1], one[1:], *dims, causal=True, **kw)
        self._prefill.run(q[:1], kv, out=out[:1])
        torch.cuda.synchronize(self._workspace.device)
        self._planned = None
