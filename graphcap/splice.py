"""Splice points and the step context.

A splice point is a request-dependent op (attention, index top-k) that runs eagerly between
captured graph segments. It is declared once, where it is defined::

    @splice("attention.sparse", graph_safe_decode=True)
    def sparse_attention(self, layer: int, q: Tensor, out: Tensor) -> None: ...

Its contract: it reads only the tensors it was passed (fixed addresses while graphs live) and
this step's metadata, read through ``current_step()`` (the one channel graphcap watches: a
read from captured producer code raises, naming the read); it writes its result into a
caller-owned buffer and returns ``None``, so no Python value crosses a break.

Outside a graphcap step the decorator costs one context-variable lookup and calls the op.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import traceback
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Protocol, TypeVar, Union

import torch

from common.values import is_int

from .buckets import Padding


@dataclass(frozen=True)
class Step:
    """One forward's worth of work, as the caller hands it to ``CaptureManager.run``.

    Attributes:
        num_tokens: real (unpadded) tokens in the flattened batch.
        num_seqs: requests in the batch (request rows of the attention metadata).
        inputs: per-token input tensors keyed by static-input name, each with ``num_tokens``
            leading rows (e.g. ``input_ids [T]``, ``positions [T]``, ``slot_mapping [T]``);
            stored read-only.
        uniform_decode: every request contributes exactly one query token and the attention
            backends can read all per-request state from fixed device buffers, so a whole
            decode graph may run the step. The one place this fact lives.
        metadata: whatever the splice points need for this step (e.g. attention metadata);
            graphcap never looks inside it.
    """

    num_tokens: int
    num_seqs: int
    inputs: Mapping[str, torch.Tensor]
    uniform_decode: bool = False
    metadata: Any = None

    def __post_init__(self) -> None:
        if not is_int(self.num_tokens) or self.num_tokens < 1:
            raise ValueError(f"Step.num_tokens must be a positive int, got {self.num_tokens!r}")
        if not is_int(self.num_seqs) or not 1 <= self.num_seqs <= self.num_tokens:
            raise ValueError(f"Step.num_seqs must be an int in [1, num_tokens={self.num_tokens}], "
                             f"got {self.num_seqs!r}")
        if self.uniform_decode and self.num_seqs != self.num_tokens:
            raise ValueError(f"a uniform decode step has one token per request; got {self.num_tokens} tokens for "
                             f"{self.num_seqs} requests")
        object.__setattr__(self, "inputs", MappingProxyType(dict(self.inputs)))


GraphSafety = Union[bool, Callable[[Any, Padding], bool]]


@dataclass(frozen=True)
class SpliceOp:
    """What a splice point declares about itself.

    ``graph_safe_decode`` is a bool, or ``f(owner, padding) -> bool`` asked per bucket (``owner``
    is the object whose method is the splice): an op may be graph-safe for some decode
    graphs and not others (a backend with graph-mode state for a fixed set of batch sizes).
    """

    name: str
    graph_safe_decode: GraphSafety = False

    def graph_safe(self, args: tuple, padding: Padding) -> bool:
        """Whether a decode graph of ``padding`` may capture this call."""
        safe = self.graph_safe_decode
        if callable(safe):
            if not args:
                raise TypeError(f"splice {self.name!r} asks its owner about graph safety but was called without one")
            return bool(safe(args[0], padding))
        return safe


class SpliceDriver(Protocol):
    """Whoever runs a forward under graphcap (eager runner or capture) receives each splice."""

    def on_splice(self, op: SpliceOp, fn: Callable[..., None], args: tuple, kwargs: dict) -> None: ...


@dataclass
class _StepState:
    step: Step
    padding: Padding
    driver: SpliceDriver | None
    capturing: bool = False  # producer code is being recorded: step reads must happen in splices
    splice_depth: int = 0


_STATE: contextvars.ContextVar[_StepState | None] = contextvars.ContextVar("graphcap_step", default=None)


@contextlib.contextmanager
def step_context(step: Step, padding: Padding, driver: SpliceDriver | None = None,
                 capturing: bool = False) -> Iterator[_StepState]:
    """Make ``step`` (run as ``padding``) current and route splice calls to ``driver``."""
    state = _StepState(step=step, padding=padding, driver=driver, capturing=capturing)
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


@contextlib.contextmanager
def inside_splice() -> Iterator[None]:
    """Mark the running code as a splice body: step reads are allowed here."""
    state = _STATE.get()
    if state is None:
        yield
        return
    state.splice_depth += 1
    try:
        yield
    finally:
        state.splice_depth -= 1


def _user_frame(skip: int) -> str:
    """The innermost frame outside graphcap, after ``skip`` more (accessors that wrap the read)."""
    frames = [f for f in reversed(traceback.extract_stack())
              if os.sep + "graphcap" + os.sep not in f.filename and "contextlib" not in f.filename]
    if len(frames) <= skip:
        return "<unknown>"
    f = frames[skip]
    return f"{f.filename}:{f.lineno} ({f.name}: {f.line})"


def _state(what: str, skip: int = 0) -> _StepState:
    """The active step for a read of ``what``; the one check every step read goes through.

    Raises:
        RuntimeError: no step is active, or captured producer code made the read (its value
            would be frozen into the graph).
    """
    state = _STATE.get()
    if state is None:
        raise RuntimeError(f"{what} read outside a step; run the forward through CaptureManager.run")
    if state.capturing and state.splice_depth == 0:
        raise RuntimeError(
            f"{what} was read by captured producer code at {_user_frame(skip)}; the value would be frozen "
            f"into the graph. Move that read into an op decorated with @graphcap.splice"
        )
    return state


def current_step(what: str = "graphcap.current_step()", skip_frames: int = 0) -> Step:
    """This step, for splice bodies and ``prepare``/``plan`` code (the one metadata channel).

    Args:
        what: how the caller names the read in errors (e.g. ``"AttentionBackend.meta"``).
        skip_frames: frames of accessors between the read and the code to blame in errors.
    Raises:
        RuntimeError: see ``_state``.
    """
    return _state(what, skip_frames).step


def current_padding(what: str = "graphcap.current_padding()", skip_frames: int = 0) -> Padding:
    """This step's padding decision (rows, request rows, decode graph); same rules as ``current_step``."""
    return _state(what, skip_frames).padding


def splice(name: str, *,
           graph_safe_decode: GraphSafety = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Declare a request-dependent op as a splice point.

    Args:
        name: shown in errors, stats and NVTX ranges (e.g. ``"attention.sparse"``).
        graph_safe_decode: the op reads all per-request state from fixed-size device buffers
            and launches grids fixed by shape for uniform decode steps, so decode graphs
            may capture through it: a bool, or ``f(owner, padding) -> bool`` answered per
            bucket (see ``SpliceOp``).
    """
    op = SpliceOp(name, graph_safe_decode)

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            state = _STATE.get()
            if state is None or state.driver is None or state.splice_depth > 0:
                result = fn(*args, **kwargs)
            else:
                result = state.driver.on_splice(op, fn, args, kwargs)
            if result is not None:
                raise RuntimeError(
                    f"splice point {name!r} returned a value; a splice must write into a caller-owned "
                    f"output buffer and return None, so that no Python value crosses a graph break"
                )

        wrapper.graphcap_splice = op  # type: ignore[attr-defined]
        return wrapper

    return decorate


T = TypeVar("T")


def call_splice(op: SpliceOp, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
    """Run a splice body with metadata reads allowed and an NVTX range around it."""
    with inside_splice(), nvtx_range(f"splice:{op.name}"), profiler_range(f"graphcap.splice:{op.name}"):
        return fn(*args, **kwargs)


@contextlib.contextmanager
def profiler_range(label: str) -> Iterator[None]:
    """A torch.profiler range, only while a profiler runs (``graphcap.report`` attributes
    kernels to splices by these)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(label):
            yield
    else:
        yield


@contextlib.contextmanager
def nvtx_range(label: str) -> Iterator[None]:
    """An NVTX range when CUDA is up (profilers show segments and splices by name)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.nvtx.range_push(label)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield
