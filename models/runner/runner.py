"""ModelRunner: steps of any ``RunnerModel`` on a paged cache, an attention backend and graphcap.

No scheduling policy: the caller decides which requests and chunks form a step::

    runner = build_from_preset("tiny", capture=CaptureConfig(enabled=True))   # the one flag
    runner.capture()                                  # before admitting requests (GPU)
    runner.add_request("a")
    out = runner.step([TokenChunk("a", 0, prompt)])   # prefill; out.next_tokens[0] is greedy
    out = runner.step([TokenChunk("a", len(prompt), [out.next_tokens[0]])])   # decode
    runner.free_request("a")

Every step runs through one ``graphcap.CaptureManager``: replayed CUDA graphs when capture is
enabled on a GPU, the same padded segment/splice path eagerly in debug-eager mode, or plain
eager. The captured function is ``model.hidden_states``; lm_head on each request's last token
runs after it, the same way for every mode. ``run_chunks`` is the one way a step runs (no
host sync: the engine launches the next step before reading this one's tokens); ``step`` is
the synchronous greedy wrapper.

A step's chunks are checked once, before anything is reserved or written
(``MetadataBuilder.check``): capacity, a known request at most once per step, ``start_pos``
continuing its sequence, token ids in the vocabulary. A request's written length advances
only after its step was queued, so a refused step never lets attention read positions nobody
wrote.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from itertools import accumulate
from typing import Hashable, Sequence

import torch

from attention.base import AttentionBackend
from attention.metadata import MetadataBuilder
from common.deprecation import warn_renamed
from common.values import is_int
from graphcap import CaptureConfig, CaptureManager, GraphKey, InputSpec, StaticInputs, Step
from graphcap.startup.compile_ahead import default_workers
from graphcap.startup.compile_counter import CompileEvent, compile_counter
from kvcache.paged import PagedKVCache
from steps import TokenChunk, TokenFeed

from .prebuild import KernelPrebuild, forward_signature
from .protocol import RunnerModel
from .source import RunnerSource


@dataclass(frozen=True)
class StepOutput:
    """Greedy next token per chunk (in step order) and the logits they came from:
    ``[num_chunks, vocab]`` for each chunk's last token, or ``[T, vocab]`` for every token
    when ``all_logits`` was asked for."""

    next_tokens: list[int]
    logits: torch.Tensor


class ModelRunner:
    """Runs steps of a model.

    Args:
        model: a ``RunnerModel`` with weights; ``cache`` and ``backend`` are attached to it here.
        cache: the paged KV cache (with a capture reserve for the dummy steps:
            ``models.runner.capture_reserve``).
        backend: attention backend on that cache.
        max_tokens, max_seqs: capacity of one step (metadata buffers).
        capture: graph settings (default: disabled, ceiling ``max_tokens``).

    Attributes:
        compile_workers: Triton compile threads before capture (default: the cores, at most 8;
            0: kernels compile on their first launch).
    """

    def __init__(self, model: RunnerModel, cache: PagedKVCache, backend: AttentionBackend,
                 max_tokens: int, max_seqs: int, capture: CaptureConfig | None = None) -> None:
        model.attach(cache, backend)
        self.model, self.cache, self.backend = model, cache, backend
        self.device = cache.block_tables.device
        self.builder = MetadataBuilder(cache, max_tokens, max_seqs, self.device)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.kernel_prebuild = KernelPrebuild(default_workers())  # shared by with_capture twins
        self.manager = self._make_manager(capture or CaptureConfig(max_tokens=max_tokens))
        # Positions of the process's compile counter when capture() began and returned.
        self._compile_marks: tuple[int, int] | None = None
        self._choices_at_capture: frozenset | None = None  # the op table's kernel choices then

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
        self.source = RunnerSource(self)
        m = CaptureManager(self.model.hidden_states, static, capture, self.source, request_capacity=self.max_seqs,
                           gather=self.model.group.gather_object)
        cache, builder, backend, model = self.cache, self.builder, self.backend, self.model
        m.register("model", model)
        m.register("kv_cache", lambda: {"k": cache.k_cache, "v": cache.v_cache, "index_k": cache.index_k_cache},
                   mutable=True)
        m.register("block_tables", lambda: {"block_tables": cache.block_tables})
        m.register("metadata", lambda: builder.buffers.tensors())
        m.register("attention", backend.graph_tensors)
        m.register("splice_buffers", lambda: model.splice_buffers.tensors())
        return m

    def with_capture(self, capture: CaptureConfig) -> "ModelRunner":
        """A runner over the same model, cache, metadata and backend with other graph settings
        (e.g. eager and graphed side by side on one set of weights)."""
        other = copy.copy(self)
        other.manager = other._make_manager(capture)
        other._compile_marks = None  # "after capture" means after the twin's own capture
        other._choices_at_capture = None
        return other

    @property
    def compile_workers(self) -> int:
        return self.kernel_prebuild.workers

    @compile_workers.setter
    def compile_workers(self, workers: int) -> None:
        self.kernel_prebuild.workers = workers

    @property
    def prebuild_s(self) -> dict[str, float]:
        """The last capture's start-up builds, in seconds (``KernelPrebuild.seconds``)."""
        return self.kernel_prebuild.seconds

    def forward_signature(self) -> str:
        """What the forward's Triton specializations depend on (a digest, for the choice store)."""
        return forward_signature(self.model.config, self.cache.config, self.max_tokens, self.max_seqs,
                                 self.backend.describe(), str(next(self.model.parameters()).dtype))

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
        """Requests that may hold a cache row at once: ``max_seqs`` plus the row headroom for
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
    def _known(self, seq_id: Hashable) -> None:
        if not self.cache.has_sequence(seq_id):
            raise ValueError(f"request {seq_id!r} is unknown; add it first with runner.add_request({seq_id!r})")

    def add_request(self, seq_id: Hashable) -> None:
        """Admit a request (a block-table row); its first chunk starts at position 0."""
        self.cache.add_sequence(seq_id)

    def free_request(self, seq_id: Hashable) -> None:
        """Return the request's pages and row."""
        self._known(seq_id)
        self.cache.free(seq_id)

    def num_written(self, seq_id: Hashable) -> int:
        """Positions written for the request: the ``start_pos`` its next chunk must have."""
        self._known(seq_id)
        return self.cache.num_written(seq_id)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Deprecated spelling of ``num_written``."""
        warn_renamed("runner.num_tokens(seq_id)", "runner.num_written(seq_id)")
        return self.num_written(seq_id)

    def rewind_request(self, seq_id: Hashable, num_written: int) -> None:
        """Drop the request's positions ``>= num_written`` (e.g. rejected speculative tokens);
        its next chunk starts at ``num_written`` and rewrites them.

        Raises:
            ValueError: an unknown request, or ``num_written`` above what was written.
        """
        written = self.num_written(seq_id)
        if not is_int(num_written) or not 0 <= num_written <= written:
            raise ValueError(f"request {seq_id!r}: rewind to {num_written!r} must lie in [0, {written}]")
        self.cache.set_written(seq_id, num_written)

    # ---- capture ----------------------------------------------------------------------
    def capture(self) -> None:
        """Prebuild, warm up and capture every graph (GPU; debug-eager: probe the decode graphs
        and arm invalidation). Call before admitting requests: warm-up and capture run on
        private dummy requests on the cache's capture reserve. Triton compiles are counted
        from here on (``compiles_during_capture``, ``compiles_after_capture``)."""
        counter = compile_counter()
        counter.install()  # again: a tool may have taken Triton's listener slot since
        start = counter.count
        self.manager.capture()
        self._compile_marks = (start, counter.count)
        self._choices_at_capture = frozenset(self._kernel_choices())

    def compiles_during_capture(self) -> list[CompileEvent]:
        """Triton builds and disk-cache loads of the last ``capture()``: compile-ahead, kernel
        choices and warm-up (empty before a capture)."""
        if self._compile_marks is None:
            return []
        start, end = self._compile_marks
        return compile_counter().since(start)[: end - start]

    def compiles_after_capture(self, start: int = 0) -> list[CompileEvent] | None:
        """Triton builds and disk-cache loads since ``capture()`` returned, from the
        ``start``-th on (``None`` before a capture). Each stalled a step: every kernel a
        serving step needs should be built by then. The counter is the process's: it also
        counts another runner's or thread's compiles of that time (a recapture's included)."""
        if self._compile_marks is None:
            return None
        return compile_counter().since(self._compile_marks[1] + start)

    def _kernel_choices(self) -> set:
        tuner = getattr(self.model.ops, "tuner", None)
        return set(tuner.choices) if tuner is not None else set()

    def kernel_choices_after_capture(self) -> list[str] | None:
        """The kernel choices (``op shape``) the op table validated since ``capture()`` returned
        (``None`` before a capture). Each ran a probe, the reference and a host sync inside a
        serving step, a stall like a compile's: the capture should have made every choice a
        step needs. The tuner is the model's: a twin's choices of that time count too."""
        if self._choices_at_capture is None:
            return None
        return sorted(f"{op} {key}" for op, key in self._kernel_choices() - self._choices_at_capture)

    def validate(self) -> dict[GraphKey, str]:
        """Replay vs eager per graph on validation data, then frozen-value detection when the
        capture config asks for it (``CaptureManager.validate``)."""
        return self.manager.validate()

    def detect_frozen(self) -> dict[GraphKey, str]:
        """Capture every graph again on other dummy data and compare kernel nodes (needs
        ``CaptureConfig(detect_frozen=True)``)."""
        return self.manager.detect_frozen()

    @property
    def has_dummies(self) -> bool:
        """Whether dummy requests of a capture or check are still in the cache."""
        return self.source.dummies.alive

    # ---- steps ------------------------------------------------------------------------
    def check(self, chunks: Sequence[TokenChunk]) -> None:
        """Raise the error running ``chunks`` would raise, before anything is reserved or written
        (see ``MetadataBuilder.check``); a scheduler uses it to find a step's faulty request."""
        self.builder.check(chunks, self.vocab_size)

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

    @torch.inference_mode()
    def run_chunks(self, chunks: Sequence[TokenChunk], feed: TokenFeed | None = None, commit: bool = True,
                   all_logits: bool = False) -> torch.Tensor:
        """One step without a host sync: check and build, run (replay or eager), lm_head on each
        chunk's last token (or on every token). Returns ``[num_chunks, vocab]`` (or
        ``[T, vocab]``) logits on the device (sample them there).

        Args:
            feed: token ids on the device (e.g. the previous step's samples) for the rows the
                chunks hold placeholders at.
            commit: advance the chunks' written lengths (False: a reference run of a step that
                will run again, e.g. checking graphs against eager on the same inputs).
        """
        self.manager.ensure_fresh()  # a (re)capture runs dummy steps: before this step is built
        step = self.make_step(chunks)
        if feed is not None:
            ids = step.inputs["input_ids"].to(self.device, non_blocking=True)
            rows = torch.tensor(feed.rows, dtype=torch.int64).to(self.device, non_blocking=True)
            ids.index_copy_(0, rows, feed.tokens)
            step = dataclasses.replace(step, inputs={**step.inputs, "input_ids": ids})
        hidden = self.manager.run(step, fresh=True)
        if not all_logits:
            # Each chunk's last row from the device qo_indptr (a host copy would cost a sync).
            last = step.metadata.buffers.qo_indptr[1 : step.num_seqs + 1].long() - 1
            hidden = hidden.index_select(0, last)
        logits = self.model.compute_logits(hidden)
        if commit:
            for ch in chunks:
                self.cache.set_written(ch.seq_id, ch.end_pos)
        return logits

    def step(self, chunks: Sequence[TokenChunk], all_logits: bool = False) -> StepOutput:
        """``run_chunks``, then the greedy next token of each chunk (reads them on the host)."""
        logits = self.run_chunks(chunks, all_logits=all_logits)
        rows = logits
        if all_logits:
            last = [n - 1 for n in accumulate(ch.num_tokens for ch in chunks)]
            rows = logits.index_select(0, torch.tensor(last, device=logits.device))
        return StepOutput(rows.argmax(-1).tolist(), logits)


__all__ = ["ModelRunner", "StepOutput"]
