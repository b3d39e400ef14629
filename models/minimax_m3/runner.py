"""Steps of MiniMax-M3: model + paged cache + metadata + attention backend + graphcap.

No scheduling policy: the caller decides which requests and chunks form a step::

    runner = build_from_preset("tiny", capture=CaptureConfig(enabled=True))   # the one flag
    runner.capture()                                  # before admitting requests (GPU)
    runner.add_request("a")
    out = runner.step([TokenChunk("a", 0, prompt)])   # prefill; out.next_tokens[0] is greedy
    out = runner.step([TokenChunk("a", len(prompt), [out.next_tokens[0]])])   # decode
    runner.free_request("a")

Every step runs through one ``graphcap.CaptureManager``: replayed CUDA graphs when capture is
enabled on a GPU, the same padded segment/splice path eagerly in debug-eager mode, or plain
eager. The captured function is ``model.hidden_states``; sampling (lm_head on each request's
last token, greedy argmax) runs after it, the same way for every mode.

A step's chunks are checked once, before anything is reserved or written
(``MetadataBuilder.check``): capacity, a known request at most once per step, ``start_pos``
continuing its sequence, token ids in the vocabulary. A request's written length advances
only after its step succeeded, so a failed step never lets attention read positions nobody
wrote.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from attention.backends.split import LayerSplit
from attention.backends.torch import TorchAttention
from attention.base import AttentionBackend
from attention.dims import AttentionDims
from attention.metadata import MetadataBuilder, TokenChunk, TokenFeed
from attention.registry import make_backend
from distributed import ParallelGroup
from graphcap import CaptureConfig, CaptureManager, InputSpec, Padding, StaticInputs, Step
from graphcap.compile_ahead import compile_ahead, default_workers
from graphcap.config import is_int
from graphcap.tuning import ChoiceStore
from kvcache.paged import PagedKVCache

from .config import MiniMaxM3Config
from .model import MiniMaxM3ForCausalLM
from .weights import load_checkpoint

DUMMY = "__graphcap_dummy__"


def _key_name(key: tuple[int, bool]) -> str:
    """``(64, True)`` -> ``"64w"`` (whole decode graph), ``(64, False)`` -> ``"64s"``."""
    return f"{key[0]}{'w' if key[1] else 's'}"


@dataclass(frozen=True)
class StepOutput:
    """Greedy next token per chunk (in step order) and the logits they came from:
    ``[num_chunks, vocab]`` for each chunk's last token, or ``[T, vocab]`` for every token
    when ``all_logits`` was asked for."""

    next_tokens: list[int]
    logits: torch.Tensor


class M3Runner:
    """Runs steps of a MiniMax-M3 model.

    Args:
        model: with weights; ``cache`` and ``backend`` are attached to it here.
        cache: the paged KV cache (built from ``config.kv_cache_config``).
        backend: attention backend on that cache.
        max_tokens, max_seqs: capacity of one step (metadata buffers).
        capture: graph settings (default: disabled, ceiling ``max_tokens``).
    """

    def __init__(self, model: MiniMaxM3ForCausalLM, cache: PagedKVCache, backend: AttentionBackend,
                 max_tokens: int, max_seqs: int, capture: CaptureConfig | None = None) -> None:
        model.attach(cache, backend)
        self.model, self.cache, self.backend = model, cache, backend
        self.device = cache.block_tables.device
        self.builder = MetadataBuilder(cache, max_tokens, max_seqs, self.device)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self._dummies: list[Hashable] = []
        self.prebuild_s: dict[str, float] = {}  # the last before_capture's parts (see _before_capture)
        self.compile_workers = default_workers()  # Triton compile threads before capture (0: compile on first launch)
        self._built_forwards: set[tuple[int, bool]] = set()  # graph keys whose forward kernels this process built
        self.manager = self._make_manager(capture or CaptureConfig(max_tokens=max_tokens))

    def _make_manager(self, capture: CaptureConfig) -> CaptureManager:
        if capture.max_tokens > self.max_tokens:
            raise ValueError(
                f"CaptureConfig.max_tokens={capture.max_tokens} exceeds the runner's step capacity "
                f"max_tokens={self.max_tokens}; build the runner with max_tokens >= the capture ceiling"
            )
        b = self.builder.buffers
        static = StaticInputs([InputSpec("input_ids", torch.int64, 0),
                               InputSpec.external("positions", b.positions),
                               InputSpec.external("slot_mapping", b.slot_mapping)],
                              self.max_tokens, self.device)
        m = CaptureManager(self.model.hidden_states, static, capture, prepare=self._prepare,
                           dummy_step=self.dummy_step, before_capture=self._before_capture,
                           request_capacity=self.max_seqs, gather=self.model.group.gather_object,
                           sample_step=lambda bucket, whole: self.dummy_step(bucket, whole, variant=1),
                           frozen_step=lambda bucket, whole: self.dummy_step(bucket, whole, variant=2))
        cache, builder, backend = self.cache, self.builder, self.backend
        m.register("model", self.model)
        m.register("kv_cache", lambda: {"k": cache.k_cache, "v": cache.v_cache, "index_k": cache.index_k_cache},
                   mutable=True)
        m.register("block_tables", lambda: {"block_tables": cache.block_tables})
        m.register("metadata", lambda: builder.buffers.tensors())
        m.register("attention", backend.graph_tensors)
        m.register("splice_buffers", lambda: self.model.splice_buffers.tensors())
        return m

    def with_capture(self, capture: CaptureConfig) -> "M3Runner":
        """A runner over the same model, cache, metadata and backend with other graph settings
        (e.g. eager and graphed side by side on one set of weights)."""
        other = copy.copy(self)
        other._dummies = []
        other.manager = other._make_manager(capture)
        return other

    def _prepare(self, step: Step, padding: Padding) -> None:
        """The manager's host hook before every run: kernel choices for this row count (made
        once, validated against the torch reference; timed only for bucket sizes, since eager
        steps of any other size must not autotune mid-serving), then the attention plan."""
        sizes = (self.manager.buckets, self.manager.whole_buckets)
        self.model.ops.prepare(self.model, padding.rows, tune=any(padding.rows in b for b in sizes))
        self.backend.plan(step, padding)

    def _before_capture(self, manager: CaptureManager) -> None:
        """Every build before warm-up and capture: the backend's graph state and flashinfer
        modules, the op table's kernel choices for every bucket size, and every Triton kernel
        the warm-up would otherwise compile one launch at a time.

        flashinfer's JIT builds run in a thread beside the rest (they are compiler
        subprocesses; the GIL is free meanwhile). This thread, with ``compile_workers``:
        1. compiles every MoE candidate of every bucket size at once (``compile_ahead``);
        2. validates and times the candidates (``ops.prepare``), all built by then;
        3. compiles every kernel of every graph key's forward (``manager.precompile``), its
           dense layers served by torch while flashinfer may still be building (the forward's
           Triton kernels are the same either way).
        With ``compile_workers == 0`` only step 2 runs and kernels compile on first launch.
        ``prebuild_s`` keeps each part's seconds."""
        backend = self.backend
        backend.init_capture(manager.whole_buckets, self.max_seqs)
        split = backend if isinstance(backend, LayerSplit) else None
        builds = [split.dense_part.warmup, split.sparse_part.warmup] if split else [backend.warmup]
        ahead = self.compile_workers if self.device.type == "cuda" else 0

        def attention() -> float:
            t0 = time.perf_counter()
            for build in builds:
                build()
            return time.perf_counter() - t0

        rows = sorted({b for b, _ in manager.keys()})
        with ThreadPoolExecutor(1, thread_name_prefix="graphcap-jit") as pool:
            built = pool.submit(attention)
            t0 = time.perf_counter()
            if ahead:
                with compile_ahead(ahead):
                    for r in rows:
                        self.model.ops.compile_kernels(self.model, r)
            t1 = time.perf_counter()
            for r in rows:
                self.model.ops.prepare(self.model, r)
            t2 = time.perf_counter()
            todo = self._forwards_to_build(manager.keys()) if ahead else []
            if todo and split is not None:
                with split.dense_served_by(TorchAttention(self.cache, backend.dims)):
                    manager.precompile(ahead, todo)
            elif todo:
                built.result()  # the forward's dense layers need the backend's modules
                manager.precompile(ahead, todo)
            self._forwards_built(todo)
            t3 = time.perf_counter()
            self.prebuild_s = {"attention_jit_s": built.result(), "compile_ahead_s": t1 - t0,
                               "kernel_choices_s": t2 - t1, "forward_compile_s": t3 - t2}

    def _forward_signature(self) -> str:
        """What the forward's Triton specializations depend on: the config, dtype, step
        capacity, cache layout and backend (a digest, for the choice store)."""
        what = (self.model.config, self.cache.config, self.max_tokens, self.max_seqs, self.backend.describe(),
                str(next(self.model.parameters()).dtype))
        return hashlib.sha1(repr(what).encode()).hexdigest()[:16]

    def _forward_record(self) -> tuple[ChoiceStore | None, str, set[str]]:
        """The choice store, its entry for this forward, and the graph keys (``_key_name``) it
        records as built into this cache directory (none without a store)."""
        store = self.model.ops.tuner.store if self.model.ops.tuner is not None else None
        entry = f"forward kernels|{self._forward_signature()}"
        return store, entry, set((store.get(entry) or "").split()) if store is not None else set()

    def _forwards_to_build(self, keys: list[tuple[int, bool]]) -> list[tuple[int, bool]]:
        """The graph keys whose forward kernels ``manager.precompile`` must build: not those
        this process built already (a recapture), nor those the choice store records as built
        into this cache directory for the same forward (a warm start, whose kernels load from
        Triton's disk cache on first launch). A stale record costs speed, never correctness:
        warm-up then compiles what is missing on first launch."""
        recorded = self._forward_record()[2]
        return [k for k in keys if k not in self._built_forwards and _key_name(k) not in recorded]

    def _forwards_built(self, keys: list[tuple[int, bool]]) -> None:
        if not keys:
            return
        self._built_forwards.update(keys)
        store, entry, recorded = self._forward_record()
        if store is not None:
            store.put(entry, " ".join(sorted(recorded | {_key_name(k) for k in keys})))

    # ---- capacity (what a scheduler reads) -----------------------------------------------
    @property
    def page_size(self) -> int:
        """Positions per KV page."""
        return self.cache.page_size

    @property
    def max_seq_len(self) -> int:
        """Most positions one request may hold."""
        return self.cache.config.max_seq_len

    @property
    def num_pages(self) -> int:
        """KV pages requests may hold (the capture reserve excluded)."""
        return self.cache.num_pages

    @property
    def num_free_pages(self) -> int:
        """KV pages not held by any request."""
        return self.cache.num_free_pages

    @property
    def max_live_requests(self) -> int:
        """Requests that may hold a cache row at once: ``max_seqs`` plus the slot headroom for
        finished requests not yet freed (see ``kvcache.paged``)."""
        return self.cache.config.max_live_seqs

    @property
    def vocab_size(self) -> int:
        """Token ids a step may hold (the full vocabulary under tensor parallelism)."""
        return self.model.vocab_size

    def destroy(self) -> None:
        """Free every graph, its pool and the capture stream (``CaptureManager.destroy``).
        Under a process group, call it on every rank before ``group.destroy()``: captured NCCL
        work must not outlive its communicator."""
        self.manager.destroy()

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, seq_id: Hashable) -> None:
        """Admit a request (a block-table row); its first chunk starts at position 0."""
        self.cache.add_sequence(seq_id)

    def free_request(self, seq_id: Hashable) -> None:
        """Return the request's pages and row."""
        self.cache.free(seq_id)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Positions written for the request: the ``start_pos`` its next chunk must have."""
        return self.cache.num_written(seq_id)

    def rewind_request(self, seq_id: Hashable, num_tokens: int) -> None:
        """Drop the request's positions ``>= num_tokens`` (e.g. rejected speculative tokens);
        its next chunk starts at ``num_tokens`` and rewrites them.

        Raises:
            ValueError: ``num_tokens`` above what was written.
        """
        written = self.cache.num_written(seq_id)
        if not is_int(num_tokens) or not 0 <= num_tokens <= written:
            raise ValueError(f"request {seq_id!r}: rewind to {num_tokens!r} must lie in [0, {written}]")
        self.cache.set_written(seq_id, num_tokens)

    # ---- capture ----------------------------------------------------------------------
    def capture(self) -> None:
        """Warm up and capture every bucket (no-op unless capture is enabled on a GPU). Call
        before admitting requests: warm-up and capture run on private dummy requests."""
        try:
            self.manager.capture()
        finally:
            self.release_dummies()

    def validate(self) -> dict:
        """Replay vs eager per bucket on other dummy data than the capture's (``dummy_step``
        variant 1), then frozen-value detection (variant 2) when the capture config asks for
        it (see ``CaptureManager.validate`` and ``detect_frozen``)."""
        try:
            return self.manager.validate()
        finally:
            self.release_dummies()

    def detect_frozen(self) -> dict:
        """Capture every graph again on variant-2 dummy data and compare kernel nodes (see
        ``CaptureManager.detect_frozen``); needs ``CaptureConfig(detect_frozen=True)``."""
        try:
            return self.manager.detect_frozen()
        finally:
            self.release_dummies()

    # ---- steps ------------------------------------------------------------------------
    def make_step(self, chunks: Sequence[TokenChunk]) -> Step:
        """Check the chunks, reserve their pages and build the step's metadata and inputs.

        Raises:
            ValueError, RuntimeError: see ``MetadataBuilder.check``; nothing is reserved then.
        """
        self.check(chunks)
        for ch in chunks:
            self.cache.reserve(ch.seq_id, ch.end_pos)
        meta = self.builder.build(chunks)
        ids = torch.tensor([t for ch in chunks for t in ch.token_ids], dtype=torch.int64)
        inputs = {"input_ids": ids, "positions": meta.positions, "slot_mapping": meta.slot_mapping}
        return Step(num_tokens=meta.num_tokens, num_seqs=meta.num_seqs, inputs=inputs,
                    uniform_decode=all(ch.num_tokens == 1 for ch in chunks), metadata=meta)

    def check(self, chunks: Sequence[TokenChunk]) -> None:
        """Raise the error ``step(chunks)`` would raise, before anything is reserved or written
        (see ``MetadataBuilder.check``); a scheduler uses it to find a step's faulty request."""
        self.builder.check(chunks, self.vocab_size)

    def _last_rows(self, step: Step) -> torch.Tensor:
        """``int64 [num_chunks]`` device index of each chunk's last token, from the device
        ``qo_indptr`` (a host copy would cost a sync)."""
        meta = step.metadata
        return meta.buffers.qo_indptr[1 : meta.num_seqs + 1].long() - 1

    def sample(self, hidden: torch.Tensor, step: Step, all_logits: bool = False) -> StepOutput:
        """lm_head on each chunk's last token (or every token) and greedy argmax."""
        last = self._last_rows(step)
        h = hidden[: step.num_tokens] if all_logits else hidden.index_select(0, last)
        logits = self.model.compute_logits(h)
        rows = logits.index_select(0, last) if all_logits else logits
        return StepOutput(rows.argmax(-1).tolist(), logits)

    def _run(self, chunks: Sequence[TokenChunk], feed: TokenFeed | None) -> tuple[Step, torch.Tensor]:
        try:
            self.manager.ensure_fresh()  # a (re)capture runs dummy steps: before this step is built
        finally:
            self.release_dummies()
        step = self.make_step(chunks)
        if feed is not None:
            ids = step.inputs["input_ids"].to(self.device, non_blocking=True)
            rows = torch.tensor(feed.rows, dtype=torch.int64).to(self.device, non_blocking=True)
            ids.index_copy_(0, rows, feed.tokens)
            step = dataclasses.replace(step, inputs={**step.inputs, "input_ids": ids})
        return step, self.manager.run(step, fresh=True)

    @torch.inference_mode()
    def step(self, chunks: Sequence[TokenChunk], all_logits: bool = False) -> StepOutput:
        """One step: check and build, run (replay or eager), sample greedily per chunk.

        The chunks' written lengths advance only when the step succeeds."""
        step, hidden = self._run(chunks, None)
        out = self.sample(hidden, step, all_logits)
        self._commit(chunks)
        return out

    @torch.inference_mode()
    def run_chunks(self, chunks: Sequence[TokenChunk], feed: TokenFeed | None = None,
                   commit: bool = True) -> torch.Tensor:
        """One step without a host sync: check and build, run, lm_head on each chunk's last
        token. Returns ``[num_chunks, vocab]`` logits on the device (sample them there).

        Args:
            feed: token ids on the device (e.g. the previous step's samples) for the rows the
                chunks hold placeholders at.
            commit: advance the chunks' written lengths (False: a reference run of a step that
                will run again, e.g. checking graphs against eager on the same inputs).
        """
        step, hidden = self._run(chunks, feed)
        logits = self.model.compute_logits(hidden.index_select(0, self._last_rows(step)))
        if commit:
            self._commit(chunks)
        return logits

    def _commit(self, chunks: Sequence[TokenChunk]) -> None:
        for ch in chunks:
            self.cache.set_written(ch.seq_id, ch.end_pos)

    # ---- dummy steps for warm-up, capture and validation -------------------------------
    def dummy_step(self, bucket: int, whole_graph: bool, variant: int = 0) -> Step:
        """A step of ``bucket`` rows over private requests on the cache's capture reserve
        (freed by ``release_dummies``; live requests' rows and pages are never used).

        Every token of the step sits at its own position of the shared capture pages (token
        ``g`` at capture position ``g``), so no two tokens write one slot, and each request
        reads only positions this step wrote.

        Args:
            bucket: token rows.
            whole_graph: ``bucket`` one-token requests (a uniform decode), else prefill chunks.
            variant: 0 for warm-up and capture (token 0, every row real); 1 for validation:
                random tokens, other positions, two chunks for a segmented bucket, every row
                real (graph and eager then run the same shapes and must agree to rounding);
                2 for frozen-value detection: variant 1 with a quarter fewer real tokens, so
                that any host value of the step baked into a graph differs from the capture's.

        Raises:
            ValueError: a whole-graph bucket above ``max_seqs``.
            RuntimeError: the cache's capture reserve is too small for the step.
        """
        self.release_dummies()
        if whole_graph and bucket > self.max_seqs:
            raise ValueError(f"a whole decode graph of {bucket} tokens needs {bucket} requests but max_seqs="
                             f"{self.max_seqs}; keep whole-graph buckets <= max_seqs")
        n = max(1, bucket - bucket // 4) if variant == 2 else bucket
        if whole_graph:  # request i at capture position i (variants 1, 2: reversed, at the top)
            spans = [(i if variant == 0 else bucket - 1 - i, 1) for i in range(n)]
        else:
            cuts = [0, n] if variant == 0 or n < 2 else [0, n // 2, n]
            spans = [(a, b - a) for a, b in zip(cuts, cuts[1:])]
        ps = self.cache.page_size
        spans = _fit_windows(spans, ps, self.cache.config.max_seq_len)
        gen = torch.Generator().manual_seed(bucket * 2 + variant)
        c = self.cache.config
        chunks = []
        for i, (g, m) in enumerate(spans):
            sid = (DUMMY, i)
            try:
                self.cache.add_capture_sequence(sid, g // ps, g % ps)
            except (RuntimeError, ValueError) as e:
                self.release_dummies()
                raise RuntimeError(
                    f"the KV cache's capture reserve (capture_rows={c.capture_rows}, capture_pages={c.capture_pages}) "
                    f"cannot hold the dummy step of bucket {bucket}: {e}. Build the cache with "
                    f"capture_reserve(max_tokens, max_seqs, page_size, max_seq_len) rows and pages"
                ) from None
            self._dummies.append(sid)
            ids = torch.randint(0, self.vocab_size, (m,), generator=gen) if variant else [0] * m
            chunks.append(TokenChunk(sid, g % ps, ids))
        return self.make_step(chunks)

    @property
    def has_dummies(self) -> bool:
        """Whether requests made by ``dummy_step`` are still in the cache."""
        return bool(self._dummies)

    def release_dummies(self) -> None:
        """Free the requests ``dummy_step`` made."""
        for sid in self._dummies:
            self.cache.free(sid)
        self._dummies = []


def _fit_windows(spans: list[tuple[int, int]], page_size: int, max_seq_len: int) -> list[tuple[int, int]]:
    """Split ``(first capture position, tokens)`` spans so each fits one request: a request
    starting at position ``g`` sees capture pages from ``g // page_size`` on, ``max_seq_len``
    positions in all."""
    out = []
    for g, m in spans:
        while m > 0:
            take = min(m, max_seq_len - g % page_size)
            out.append((g, take))
            g, m = g + take, m - take
    return out


def capture_reserve(max_tokens: int, max_seqs: int, page_size: int, max_seq_len: int) -> tuple[int, int]:
    """Block-table rows and pages ``M3Runner.dummy_step`` needs on the cache's capture reserve:
    a row per dummy request (a whole decode graph of ``max_seqs`` requests, or a segmented
    bucket's chunks) and a page per ``page_size`` capture positions (one per token)."""
    chunks = len(_fit_windows([(0, max_tokens // 2), (max_tokens // 2, max_tokens - max_tokens // 2)],
                              page_size, max_seq_len))
    return max(max_seqs, chunks), -(-max(max_tokens, max_seqs) // page_size)


def _build(model: MiniMaxM3ForCausalLM, device: torch.device | str, backend: str, max_tokens: int, max_seqs: int,
           max_seq_len: int, num_pages: int | None, capture: CaptureConfig | None) -> M3Runner:
    c = model.config
    pages_per_seq = -(-max_seq_len // c.sparse_block_size)
    rows, pages = capture_reserve(max_tokens, max_seqs, c.sparse_block_size, pages_per_seq * c.sparse_block_size)
    kv = c.kv_cache_config(num_pages=num_pages or pages_per_seq * max_seqs, max_seqs=max_seqs,
                           max_pages_per_seq=pages_per_seq, dtype=model.dtype, device=device,
                           capture_rows=rows, capture_pages=pages)
    cache = PagedKVCache(kv)
    dims = AttentionDims.for_cache(cache, c.num_attention_heads, c.sparse_topk_blocks, max_tokens)
    return M3Runner(model, cache, make_backend(backend, cache, dims), max_tokens, max_seqs, capture)


def sharded_for(config: MiniMaxM3Config, group: ParallelGroup | None) -> MiniMaxM3Config:
    """``config`` as one rank of ``group``: a whole model is sharded ``shard(W, W)``; an
    already sharded one is kept (the model checks that it fits the group)."""
    if group is None or not group.distributed or (config.tp_size, config.ep_size) != (1, 1):
        return config
    return config.shard(group.world_size, group.world_size)


def build_from_preset(name: str | MiniMaxM3Config, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                      *, seed: int = 0, backend: str = "torch", max_tokens: int = 512, max_seqs: int = 8,
                      max_seq_len: int = 4096, num_pages: int | None = None, moe_impl: str = "auto",
                      producer: str = "auto", capture: CaptureConfig | None = None,
                      group: ParallelGroup | None = None) -> M3Runner:
    """A runner over a preset (``tiny``, ``slice``, ``rank_of_8``, ``real``) or a config, with
    random weights (``init_random_(seed)``); with a distributed ``group``, this rank's shard of
    the whole config (``sharded_for``)."""
    config = name if isinstance(name, MiniMaxM3Config) else MiniMaxM3Config.preset(name)
    model = MiniMaxM3ForCausalLM(sharded_for(config, group), dtype=dtype, device=device, moe_impl=moe_impl,
                                 producer=producer, group=group)
    model.init_random_(seed)
    return _build(model, device, backend, max_tokens, max_seqs, max_seq_len, num_pages, capture)


def build_from_checkpoint(folder: str | os.PathLike, device: torch.device | str = "cpu",
                          dtype: torch.dtype | None = None,
                          *, num_layers: int | None = None, backend: str = "torch", max_tokens: int = 512,
                          max_seqs: int = 8, max_seq_len: int = 4096, num_pages: int | None = None,
                          moe_impl: str = "auto", producer: str = "auto",
                          capture: CaptureConfig | None = None, group: ParallelGroup | None = None) -> M3Runner:
    """A runner over a checkpoint folder; ``num_layers`` keeps only the first layers. With a
    distributed ``group``, each rank streams only its own slices of the checkpoint."""
    config = MiniMaxM3Config.from_hf(folder)
    truncate = num_layers is not None and num_layers != config.num_hidden_layers
    if truncate:
        config = config.first_layers(num_layers)  # type: ignore[arg-type]
    model = MiniMaxM3ForCausalLM(sharded_for(config, group), dtype=dtype, device=device, moe_impl=moe_impl,
                                 producer=producer, group=group)
    load_checkpoint(model, folder, truncate_layers=truncate)
    return _build(model, device, backend, max_tokens, max_seqs, max_seq_len, num_pages, capture)
