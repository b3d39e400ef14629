"""FlashinferAttention: dense causal GQA over the paged cache with flashinfer (MiniMax-M3 layers 0..2).

A dense-only backend: combine it with a sparse one (``LayerSplit(dense=FlashinferAttention,
sparse=TritonAttention)``, the ``flashinfer`` kind of ``attention.registry``).

Plan/run split: ``plan(step, padding)`` runs once per step on the host and serves every dense
layer; the op only launches kernels.

Two kinds of flashinfer wrapper share one float workspace and the persistent page buffers:

- Decode graphs: ``BatchDecodeWithPagedKVCacheWrapper`` in CUDA-graph mode, one per
  decode-graph size the manager captures (``init_capture``). A graph-mode wrapper's batch size
  is fixed (flashinfer takes it from the length of the ``last_page_len`` buffer); all of them
  get views (from offset 0) of the same indptr / indices / last_page_len buffers. A captured
  decode graph reads those fixed addresses plus the wrapper's own int workspace, which ``plan``
  rewrites before every replay, so every wrapper stays alive (and registered through
  ``graph_tensors``) for as long as graphs may use it. Tensor cores (the fa2 prefill kernel)
  serve the large GQA groups (16 q heads per kv head at full width, 8 at rank-of-8) better
  than the CUDA-core decode kernel.
- Everything else (mixed prefill/decode chunks, decode of other batch sizes):
  ``BatchPrefillWithPagedKVCacheWrapper``, causal, in eager mode. Those steps never run
  inside a captured graph (the dense splice runs eagerly between graph segments).

fp8 KV: a ``torch.float8_e4m3fn`` cache is planned with ``kv_data_type=torch.float8_e4m3fn`` and
``q_data_type`` the query's dtype (bf16 by default; q and out stay 16-bit); unit scale, so
``run`` passes no ``k_scale``/``v_scale`` (flashinfer's default 1.0).

Host cost of ``plan`` is O(requests): indptr and last_page_len come from the metadata's host
copy of ``kv_lens``; the page ids are gathered on the device from the cache's block-table
rows, so no per-page host walk ever happens. Padded request rows have no pages: flashinfer
attends to nothing and writes zeros to their output rows.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Sequence

import torch

from attention.base import AttentionBackend, device_tensors
from attention.dims import AttentionDims
from graphcap import Padding, Step
from graphcap.startup import jit_cache
from kvcache.paged import FP8_E4M3, PagedKVCache

_INSTALL_HINT = "install it with the 'cuda' extra: pip install 'graphcap[cuda]' (package flashinfer-python)"


def import_flashinfer() -> Any:
    """The flashinfer module.

    Raises:
        ImportError: flashinfer is not installed; says how to install it.
    """
    try:
        jit_cache.configure()  # flashinfer reads its JIT cache location when imported
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


def gather_page_indices(indptr: torch.Tensor, table_rows: torch.Tensor, block_tables: torch.Tensor,
                        out: torch.Tensor) -> None:
    """Concatenated page ids of each request, gathered on the device from its block-table row.

    ``out[indptr[i] + j] = block_tables[table_rows[i], j]`` for ``j < indptr[i+1] - indptr[i]``.
    A fixed handful of kernels whatever the batch: no host work per page.

    Args:
        indptr: int32 ``[R + 1]`` page offsets, on ``out``'s device.
        table_rows: int32 ``[R]`` block-table rows.
        block_tables: int32 ``[max_table_rows, max_pages_per_seq]``, contiguous.
        out: int32 ``[indptr[-1]]``, written in place.
    """
    n = out.shape[0]
    if n == 0:
        return
    pos = torch.arange(n, dtype=indptr.dtype, device=out.device)
    req = torch.searchsorted(indptr[1:], pos, right=True)  # request owning each output entry
    flat = table_rows[req].long() * block_tables.shape[1] + (pos - indptr[req])
    torch.index_select(block_tables.view(-1), 0, flat, out=out)


class _Plan(NamedTuple):
    wrapper: Any
    rows: int  # q rows the wrapper reads (padded batch for decode, real tokens otherwise)


class FlashinferAttention(AttentionBackend):
    """flashinfer paged dense attention for the dense layers, planned once per step.

    Args:
        cache: the paged cache (CUDA; main K/V bf16, fp16 or fp8 e4m3); layer ``l`` reads
            ``k_cache[l]``/``v_cache[l]``.
        dims: attention shapes.
        prefill_backend: flashinfer backend of the eager wrapper (``"fa2"``; ``"fa3"`` or
            ``"auto"`` on Hopper are faster for long chunks but JIT another module).
        workspace_bytes: flashinfer's float workspace (split-KV partial results).
        q_dtype: dtype of q and out (the model's); default the cache dtype for a 16-bit cache,
            bf16 for an fp8 one.

    Raises:
        ImportError: flashinfer is not installed (before anything is allocated).
        RuntimeError: the cache is not on a CUDA device.
        ValueError: an unsupported cache or query dtype.
    """

    needs_jit = True  # every wrapper's module is built on first plan (about 20 s on an H200)

    def __init__(self, cache: PagedKVCache, dims: AttentionDims, *, prefill_backend: str = "fa2",
                 workspace_bytes: int = 128 << 20, q_dtype: torch.dtype | None = None) -> None:
        self._fi = import_flashinfer()  # fail first, so "auto" moves on without allocating anything
        device = cache.block_tables.device
        if device.type != "cuda":
            raise RuntimeError(
                f"flashinfer runs on CUDA only but the cache is on {device}; use the 'torch' or 'triton' backend there"
            )
        super().__init__(cache, dims)
        c = cache.config
        half = (torch.bfloat16, torch.float16)
        if c.dtype not in half + (FP8_E4M3,):
            raise ValueError(f"the flashinfer dense path reads bf16, fp16 or fp8 e4m3 caches, got {c.dtype}; "
                             f"use the 'torch' or 'triton' backend for it")
        q_dtype = q_dtype or (c.dtype if c.dtype in half else torch.bfloat16)
        if q_dtype not in half:
            raise ValueError(f"flashinfer's q and out are bf16 or fp16, got q_dtype={q_dtype}")
        if c.dtype in half and q_dtype != c.dtype:
            raise ValueError(f"q_dtype={q_dtype} differs from the {c.dtype} cache; flashinfer mixes dtypes only "
                             f"for an fp8 cache")
        self.kv_dtype = c.dtype  # what the wrappers are planned with (kv_data_type)
        self.dtype = q_dtype  # q and out
        rows = c.max_seqs + 1  # metadata request rows, padding row included
        self._workspace_buf = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)  # zero on first use
        # flashinfer's plan writes its schedule into one pinned host buffer per wrapper and
        # copies it to the device without waiting. A scheduler that runs ahead of the GPU may
        # plan step N+1 while step N's copy is still queued: wait for that copy first.
        self._plan_copied: torch.cuda.Event | None = None
        self._indptr_buf = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self._last_page_len_buf = torch.zeros(rows, dtype=torch.int32, device=device)
        # A step's requests hold distinct pages, so a step never lists more than the pool
        # (warmup lists one page per decode row, hence the max).
        self._indices_buf = torch.zeros(max(c.total_pages, rows), dtype=torch.int32, device=device)
        self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace_buf, "NHD",
                                                                     backend=prefill_backend)
        self._decode: dict[int, Any] = {}
        self._planned: _Plan | None = None

    @property
    def decode_batch_sizes(self) -> list[int]:
        """Batch sizes with a graph-mode decode wrapper."""
        return sorted(self._decode)

    def init_capture(self, decode_sizes: Sequence[int], max_seqs: int) -> None:
        """One graph-mode decode wrapper per decode-graph size (kept across recaptures)."""
        cap = self._last_page_len_buf.shape[0]
        bad = [b for b in decode_sizes if not 1 <= b <= cap]
        if bad:
            raise ValueError(f"decode graphs of {bad} requests exceed the flashinfer buffers ({cap} request "
                             f"rows = max_seqs + 1); keep decode-graph buckets <= max_seqs")
        for b in decode_sizes:
            if b not in self._decode:
                self._decode[b] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace_buf,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=True,
                    paged_kv_indptr_buffer=self._indptr_buf[: b + 1],
                    paged_kv_indices_buffer=self._indices_buf,
                    paged_kv_last_page_len_buffer=self._last_page_len_buf[:b],
                    backend="fa2",  # pinned: "auto" may route graph plans to cuDNN/XQA on some GPUs
                )

    def dense_graph_safe(self, padding: Padding) -> bool:
        return padding.request_rows in self._decode

    def plan(self, step: Step, padding: Padding) -> None:
        """Host work for one step; every dense layer then runs with it.

        A decode graph plans its size's graph-mode wrapper (request rows padded to the
        bucket); a uniform decode step of a size with a wrapper uses it too; anything else
        plans the eager prefill wrapper over the real requests.

        Raises:
            ValueError: metadata of another cache, or a decode graph without a wrapper (its
                size was not given to ``init_capture``).
        """
        self._planned = None  # a failed plan leaves no stale plan for the op to use
        meta = self.check_plan(step, padding)
        rows = padding.request_rows
        wrapper = self._decode.get(rows) if step.uniform_decode else None
        if padding.decode_graph and wrapper is None:
            raise ValueError(
                f"a decode graph of {rows} requests has no graph-mode flashinfer wrapper (have "
                f"{self.decode_batch_sizes}); call init_capture with the manager's decode-graph sizes"
            )
        indptr, last_page_len = paged_kv_layout(meta.kv_lens_host, rows, self.dims.block_size)
        total = int(indptr[-1])
        if total > self._indices_buf.shape[0]:
            raise ValueError(
                f"step lists {total} pages but the page buffer holds {self._indices_buf.shape[0]}; "
                f"kv_lens do not match the sequences' reserved pages"
            )
        indptr_dev = self._indptr_buf[: rows + 1]
        indptr_dev.copy_(indptr, non_blocking=True)
        indices = self._indices_buf[:total]
        gather_page_indices(indptr_dev, meta.buffers.table_rows[:rows], meta.block_tables, indices)
        d = self.dims
        dims = (d.num_qo_heads, d.num_kv_heads, d.head_dim, d.block_size)
        kw = dict(q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=d.scale)
        if self._plan_copied is not None:
            self._plan_copied.synchronize()  # free in steady state: the GPU is past that copy
        if wrapper is not None:
            wrapper.plan(indptr, indices, last_page_len, *dims, **kw)
            self._planned = _Plan(wrapper, rows)
        else:
            b = meta.num_seqs
            self._prefill.plan(meta.qo_indptr_host, indptr[: b + 1], indices, last_page_len[:b], *dims, causal=True,
                               **kw)
            self._planned = _Plan(self._prefill, meta.num_tokens)
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()

    def _dense(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """Causal GQA of one dense layer; kernels only.

        q: ``[T, num_qo_heads, head_dim]`` in ``self.dtype`` (the cache dtype, or bf16/fp16 over
        an fp8 cache), last dim contiguous, ``T`` at least the planned rows; out: same shape
        and dtype, contiguous. Rows of padded decode requests
        get zeros; rows past the planned ones are untouched.
        """
        p = self._planned
        if p is None:
            raise RuntimeError("flashinfer dense attention ran before plan; plan every step before the forward")
        d = self.dims
        want = (d.num_qo_heads, d.head_dim)
        if q.dim() != 3 or tuple(q.shape[1:]) != want or out.shape != q.shape or q.shape[0] < p.rows:
            raise ValueError(f"q and out must be [T >= {p.rows}, {want[0]}, {want[1]}]; "
                             f"got {tuple(q.shape)}, {tuple(out.shape)}")
        if q.dtype != self.dtype or out.dtype != self.dtype:
            raise ValueError(f"q and out must be {self.dtype} (the dtype the wrappers were planned with; "
                             f"pass q_dtype for another); got {q.dtype}, {out.dtype}")
        if q.stride(-1) != 1 or not out.is_contiguous():
            raise ValueError("flashinfer needs q with a contiguous last dim and a contiguous out")
        kv = (self.cache.k_cache[layer], self.cache.v_cache[layer])
        p.wrapper.run(q[: p.rows], kv, out=out[: p.rows])

    def warmup(self) -> None:
        """JIT-compile flashinfer's kernels and run every decode wrapper once, before any capture.

        flashinfer builds a module per (dtype, head_dim, ...) the first time it is planned
        (about 20 s on an H200); a capture must never trigger that. Plans and runs one
        single-token request per decode wrapper and one through the eager wrapper, all
        reading page 0 of layer 0 (the cache is only read). Leaves no plan behind.
        """
        d = self.dims
        sizes = self.decode_batch_sizes
        n = max(sizes, default=1)
        q = torch.zeros(n, d.num_qo_heads, d.head_dim, dtype=self.dtype, device=self._workspace_buf.device)
        out = torch.empty_like(q)
        kv = (self.cache.k_cache[0], self.cache.v_cache[0])
        kw = dict(q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=d.scale)
        dims = (d.num_qo_heads, d.num_kv_heads, d.head_dim, d.block_size)
        self._indices_buf[:n].zero_()
        for b in sizes:
            w = self._decode[b]
            w.plan(torch.arange(b + 1, dtype=torch.int32), self._indices_buf[:b], torch.ones(b, dtype=torch.int32),
                   *dims, **kw)
            w.run(q[:b], kv, out=out[:b])
        one = torch.tensor([0, 1], dtype=torch.int32)
        self._prefill.plan(one, one, self._indices_buf[:1], one[1:], *dims, causal=True, **kw)
        self._prefill.run(q[:1], kv, out=out[:1])
        torch.cuda.synchronize(self._workspace_buf.device)
        self._planned = None

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The shared workspace and page buffers, and each decode wrapper's own device buffers."""
        out = {"workspace": self._workspace_buf, "indptr": self._indptr_buf, "indices": self._indices_buf,
               "last_page_len": self._last_page_len_buf}
        for b, w in self._decode.items():
            out.update(device_tensors(w, prefix=f"decode{b}."))
        return out


__all__ = ["FlashinferAttention", "flashinfer_available", "gather_page_indices", "import_flashinfer", "paged_kv_layout"]
