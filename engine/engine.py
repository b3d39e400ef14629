"""The serving loop: admit, compose, launch, and complete steps, one step ahead of the host.

With ``overlap`` (the default) the engine launches step N+1 before it reads step N's tokens:
a request decoding in both steps gets its step-N token on the device (``TokenFeed``: the
sampled ids are gathered into step N+1's inputs by a kernel), so the host builds metadata,
plans attention and launches graphs while the GPU still runs step N, and waits only for
step N's few token ids (copied to pinned memory without blocking). A request that generates a
stop token in step N was already scheduled into step N+1; that extra token is dropped, and
its cache row is freed only after every step holding it completed (``RequestState.in_flight``).

A step that the runner refuses (``ValueError``/``RuntimeError`` from its checks, raised
before anything is reserved or written) fails the requests whose own chunks are refused, with
the runner's message, and runs again without them: the other requests and the cache are
untouched.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from steps import TokenChunk, TokenFeed

from .gc_pauses import pause_ms, timeline
from .protocol import StepRunner
from .request import Request, RequestState, Status
from .sampling import Sampler
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """Attributes:
        scheduler: admission and step limits.
        overlap: launch the next step before reading this one's tokens (see the module docstring).
        check_every: with a ``reference`` runner, run every k-th step there too (same chunks,
            same inputs, not committed) and compare logits bit for bit; 0 = never.
    """

    scheduler: SchedulerConfig = SchedulerConfig()
    overlap: bool = True
    check_every: int = 0


@dataclass
class StepRecord:
    """One launched step, for metrics: sizes, kind, launch and completion times."""

    step_id: int
    num_tokens: int
    num_seqs: int
    num_decodes: int
    t_launch: float
    t_done: float = 0.0
    checked: bool = False
    admitted: int = 0  # requests admitted by the engine step that launched this one
    context: int = 0  # end position of the step's longest-reaching prompt chunk (0: decodes only)
    compiles: int = 0  # kernel compiles while the runner launched it (each stalled the step)
    launch_ms: float = 0.0  # host time from composing its inputs to its last launch
    gc_ms: float = 0.0  # garbage collection since the previous completion (inside this step's wall)
    gc_full: int = 0  # of which full (generation 2) collections

    @property
    def kind(self) -> str:
        """``decode`` (every chunk one decode token), ``prefill`` (no decode) or ``mixed``."""
        if self.num_decodes == self.num_seqs:
            return "decode"
        return "prefill" if self.num_decodes == 0 else "mixed"


@dataclass
class _Launched:
    record: StepRecord
    chunks: list[ScheduledChunk]
    tokens: torch.Tensor  # int64 [n] on the device: sampled ids, fed to the next step
    host: torch.Tensor  # their pinned host copy, valid once ``done`` completed
    done: torch.cuda.Event | None
    logits: torch.Tensor | None = None  # kept on checked steps
    reference: torch.Tensor | None = None


@dataclass
class EngineStats:
    """Counters over the engine's life."""

    steps: list[StepRecord] = field(default_factory=list)
    checked_steps: int = 0
    mismatches: list[str] = field(default_factory=list)
    dropped_tokens: int = 0  # generated after a stop token by an already-launched step
    # Kernel compiles (builds and disk-cache loads) while this engine launched steps, after the
    # runner's capture (``StepRunner.compiles_after_capture``); ``counting_compiles`` False:
    # the runner counts none (never captured).
    compiles: list[Any] = field(default_factory=list)
    counting_compiles: bool = False


class Engine:
    """Serves requests on one runner.

    Args:
        runner: the model runner (``engine.protocol.StepRunner``).
        config: scheduling and overlap settings.
        sampler: token sampler (default: one on the runner's device).
        reference: a runner over the same model and cache for ``check_every`` (e.g. the
            graphed runner's ``with_capture(debug_eager=True)`` twin).
        clock: seconds (``time.perf_counter``).
    """

    def __init__(self, runner: StepRunner, config: EngineConfig = EngineConfig(), *, sampler: Sampler | None = None,
                 reference: StepRunner | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if config.check_every and reference is None:
            raise ValueError("EngineConfig.check_every needs a reference runner (Engine(..., reference=...))")
        self.runner, self.config, self.reference, self.clock = runner, config, reference, clock
        self.sampler = sampler or Sampler(runner.device)
        self.scheduler = Scheduler(config.scheduler, max_tokens=runner.max_tokens, max_seqs=runner.max_seqs,
                                   max_live_requests=runner.max_live_requests, num_pages=runner.num_pages,
                                   page_size=runner.page_size)
        self.cuda = torch.device(runner.device).type == "cuda"
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # holding a cache row, in admission order
        self.states: dict[Hashable, RequestState] = {}
        self.stats = EngineStats()
        self._inflight: _Launched | None = None
        self._next_id = 0
        before = runner.compiles_after_capture()  # an earlier engine's compiles are not this one's
        self.stats.counting_compiles = before is not None
        self._compiles_from = len(before or ())
        self._gc = timeline()
        self._last_done = time.perf_counter()  # the GC record's clock, whatever ``clock`` is

    # ---------------------------------------------------------------- requests
    def submit(self, request: Request) -> RequestState:
        """Queue a request. One the runner can never serve fails at once (``status`` FAILED,
        ``error`` says what to change); it never reaches a step.

        Raises:
            ValueError: a request id already submitted.
        """
        if request.request_id in self.states:
            raise ValueError(f"request id {request.request_id!r} was already submitted; ids must be unique")
        state = RequestState(request, t_submit=self.clock())
        self.states[request.request_id] = state
        error = self._refusal(request)
        if error:
            state.status, state.error, state.t_done = Status.FAILED, error, state.t_submit
        else:
            self.waiting.append(state)
        return state

    def _refusal(self, request: Request) -> str | None:
        r, rid = self.runner, request.request_id
        if not request.prompt:
            return f"request {rid!r}: the prompt is empty; send at least one token"
        bad = [t for t in request.prompt if not 0 <= t < r.vocab_size]
        if bad:
            return f"request {rid!r}: prompt token {bad[0]} is outside the vocabulary [0, {r.vocab_size})"
        bad = sorted(t for t in request.stop_token_ids if not 0 <= t < r.vocab_size)
        if bad:
            return (f"request {rid!r}: stop token id {bad[0]} is outside the vocabulary [0, {r.vocab_size}); "
                    f"the model can never generate it")
        if request.max_len > r.max_seq_len:
            return (f"request {rid!r}: prompt {len(request.prompt)} + max_new_tokens {request.max_new_tokens} needs "
                    f"{request.max_len} positions but a sequence holds {r.max_seq_len}; shorten it or raise "
                    f"max_seq_len")
        pages = -(-request.max_len // r.page_size)
        if pages > r.num_pages:
            return (f"request {rid!r} needs {pages} KV pages but the cache has {r.num_pages}; shorten it or raise "
                    f"num_pages")
        return None

    @property
    def has_work(self) -> bool:
        """Requests waiting or running, or a step still in flight."""
        return bool(self.waiting or self.running or self._inflight)

    # ------------------------------------------------------------------- steps
    def step(self) -> list[RequestState]:
        """Admit, compose and launch one step, and complete the previous one (or this one,
        without overlap). Returns the requests that finished or failed during the call."""
        ended: list[RequestState] = []
        now = self.clock()
        admitted = self.scheduler.admit(self.waiting, self.running, live=len(self.running))
        for s in admitted:
            self.runner.add_request(s.id)
            s.has_row, s.status, s.t_admit = True, Status.RUNNING, now
            self.running.append(s)
        chunks = self.scheduler.compose(self.running)
        launched = self._launch(chunks, ended) if chunks else None
        if launched is not None:
            launched.record.admitted = len(admitted)
        if self._inflight is not None:
            self._complete(self._inflight, ended)
        self._inflight = launched
        if launched is not None and not self.config.overlap:
            self._complete(launched, ended)
            self._inflight = None
        return ended

    def drain(self) -> list[RequestState]:
        """Run steps until every request finished or failed."""
        ended: list[RequestState] = []
        while self.has_work:
            ended += self.step()
        return ended

    def _launch(self, chunks: list[ScheduledChunk], ended: list[RequestState]) -> _Launched | None:
        t_start = self.clock()
        prev = self._inflight
        token_chunks, feed_rows, feed_src, row = [], [], [], 0
        for c in chunks:
            s = c.state
            if s.prompt_done:  # a decode: the newest token, on the device while unseen
                if s.pending is not None:
                    assert prev is not None and s.pending[0] == prev.record.step_id, "pending token of a completed step"
                    feed_rows.append(row)
                    feed_src.append(s.pending[1])
                    ids: Sequence[int] = (0,)
                else:
                    ids = (s.output[-1],)
            else:
                ids = s.request.prompt[s.prefilled : s.prefilled + c.num_tokens]
            token_chunks.append(TokenChunk(s.id, self.runner.num_written(s.id), ids))
            row += c.num_tokens
        feed = None
        if feed_rows:
            src = torch.tensor(feed_src, dtype=torch.int64).to(prev.tokens.device, non_blocking=True)
            feed = TokenFeed(tuple(feed_rows), prev.tokens.index_select(0, src))
        check = bool(self.config.check_every) and self._next_id % self.config.check_every == 0
        try:
            reference = self.reference.run_chunks(token_chunks, feed, commit=False) if check else None
            logits = self.runner.run_chunks(token_chunks, feed)
        except (ValueError, RuntimeError):
            self._new_compiles()
            bad = self._refused(token_chunks)
            if not bad:
                raise
            for c in chunks:
                if c.state.id in bad:
                    self._fail(c.state, bad[c.state.id], ended)
            rest = [c for c in chunks if c.state.id not in bad]
            return self._launch(rest, ended) if rest else None
        context = max((tc.end_pos for c, tc in zip(chunks, token_chunks) if not c.state.prompt_done), default=0)
        t_launch = self.clock()
        record = StepRecord(self._next_id, row, len(chunks), sum(c.state.prompt_done for c in chunks), t_launch,
                            checked=check, context=context, compiles=self._new_compiles(),
                            launch_ms=1e3 * (t_launch - t_start))
        self._next_id += 1
        params = [c.state.request.sampling for c in chunks]
        tokens = self.sampler.sample(logits, params, [c.state.scheduled for c in chunks])
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=self.cuda)
        host.copy_(tokens, non_blocking=self.cuda)
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
        for i, c in enumerate(chunks):
            s = c.state
            s.in_flight += 1
            if not s.prompt_done:
                s.prefilled += c.num_tokens
            if c.samples:
                s.scheduled += 1
                s.pending = (record.step_id, i)
        self.stats.steps.append(record)
        return _Launched(record, chunks, tokens, host, done, logits if check else None, reference)

    def _new_compiles(self) -> int:
        """Take the runner's compiles since the last look into the stats; how many."""
        if not self.stats.counting_compiles:
            return 0
        new = self.runner.compiles_after_capture(self._compiles_from + len(self.stats.compiles)) or ()
        self.stats.compiles.extend(new)
        return len(new)

    def _refused(self, chunks: list[TokenChunk]) -> dict[Hashable, str]:
        """The requests whose own chunk the runner refuses, with its message."""
        out = {}
        for ch in chunks:
            try:
                self.runner.check([ch])
            except (ValueError, RuntimeError) as e:
                out[ch.seq_id] = str(e)
        return out

    def _complete(self, launched: _Launched, ended: list[RequestState]) -> None:
        if launched.done is not None:
            launched.done.synchronize()
        tokens = launched.host.tolist()
        now = self.clock()
        launched.record.t_done = now
        done = time.perf_counter()
        pauses = self._gc.between(self._last_done, done)
        launched.record.gc_ms = pause_ms(pauses, self._last_done, done)
        launched.record.gc_full = sum(p.generation == 2 for p in pauses)
        self._last_done = done
        if launched.record.checked:
            self.stats.checked_steps += 1
            if not torch.equal(launched.logits, launched.reference):
                diff = (launched.logits.float() - launched.reference.float()).abs().max().item()
                self.stats.mismatches.append(f"step {launched.record.step_id}: logits differ from the reference "
                                             f"(max abs diff {diff:.3g})")
        for i, c in enumerate(launched.chunks):
            s = c.state
            s.in_flight -= 1
            if c.samples:
                if s.pending == (launched.record.step_id, i):
                    s.pending = None
                if s.stopped:
                    self.stats.dropped_tokens += s.status is Status.FINISHED
                else:
                    self._append(s, tokens[i], now, ended)
            if s.stopped and s.in_flight == 0 and s.has_row:
                self._free(s)

    def _append(self, s: RequestState, token: int, now: float, ended: list[RequestState]) -> None:
        s.output.append(token)
        if s.t_first is None:
            s.t_first = now
        if token in s.request.stop_token_ids or len(s.output) >= s.request.max_new_tokens:
            s.status, s.t_done = Status.FINISHED, now
            ended.append(s)

    def _fail(self, s: RequestState, error: str, ended: list[RequestState]) -> None:
        s.status, s.error, s.t_done = Status.FAILED, error, self.clock()
        ended.append(s)
        if s.in_flight == 0 and s.has_row:
            self._free(s)

    def _free(self, s: RequestState) -> None:
        self.runner.free_request(s.id)
        s.has_row = False
        self.scheduler.release(s)
        self.running.remove(s)


__all__ = ["Engine", "EngineConfig", "EngineStats", "StepRecord"]
