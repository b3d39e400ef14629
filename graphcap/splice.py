"""Splice points and the step context.

A splice point is a request-dependent op (attention, index top-k) that runs eagerly between
captured graph segments. It is declared once, where it is defined::

    @splice("attention.sparse", graph_safe_decode=True)
    def sparse_attention(self, layer: int, q: Tensor, out: Tensor) -> None: ...

Its contract: it reads only the tensors it was passed (fixed addresses while graphs live) and
this step's metadata (``current_step()`` or backend state set by ``plan``); it writes its
result into a caller-owned buffer and returns ``None``, so no Python value crosses a break.

Outside a graphcap step the decorator costs one context-variable lookup and calls the op.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, TypeVar

import torch


@dataclass
class Step:
    """One forward's worth of work, as the caller hands it to ``CaptureManager.run``.

    Attributes:
        num_tokens: real (unpadded) tokens in the flattened batch.
        inputs: per-token input tensors keyed by static-input name, each with ``num_tokens``
            leading rows (e.g. ``input_ids [T]``, ``positions [T]``, ``slot_mapping [T]``).
        uniform_decode: every request contributes the same small number of query tokens and
            the attention backends can read all per-request state from fixed device buffers,
            so a whole-graph capture is allowed.
        metadata: whatever the splice points need for this step (e.g. attention metadata);
            graphcap never looks inside it.
    """

    num_tokens: int
    inputs: Mapping[str, torch.Tensor]
    uniform_decode: bool = False
    metadata: Any = None


@dataclass(frozen=True)
class SpliceOp:
    """What a splice point declares about itself."""

    name: str
    graph_safe_decode: bool = False


class SpliceDriver(Protocol):
    """Whoever runs a forward under graphcap (eager runner or capture) receives each splice."""

    def on_splice(self, op: SpliceOp, fn: Callable[..., None], args: tuple, kwargs: dict) -> None: ...


@dataclass
class _StepState:
    step: Step
    driver: SpliceDriver | None
    capturing: bool = False  # inside a breakable capture: metadata reads must happen in splices
    splice_depth: int = 0
    seen: list[SpliceOp] = field(default_factory=list)


_STATE: contextvars.ContextVar[_StepState | None] = contextvars.ContextVar("graphcap_step", default=None)


@contextlib.contextmanager
def step_context(step: Step, driver: SpliceDriver | None, capturing: bool = False) -> Iterator[_StepState]:
    """Make ``step`` current and route splice calls to ``driver`` for the duration."""
    state = _StepState(step=step, driver=driver, capturing=capturing)
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


@contextlib.contextmanager
def inside_splice() -> Iterator[None]:
    """Mark the running code as a splice body: metadata reads are allowed here."""
    state = _STATE.get()
    if state is None:
        yield
        return
    state.splice_depth += 1
    try:
        yield
    finally:
        state.splice_depth -= 1


def current_step() -> Step:
    """This step, for splice bodies and ``plan`` code.

    Raises:
        RuntimeError: no step is active, or the call comes from captured producer code (a
            metadata read there would be frozen into the graph).
    """
    state = _STATE.get()
    if state is None:
        raise RuntimeError("graphcap.current_step() called outside a step; run the forward through CaptureManager.run")
    if state.capturing and state.splice_depth == 0:
        raise RuntimeError(
            "step metadata was read by captured producer code; the value would be frozen into the "
            "graph. Move that read into an op decorated with @graphcap.splice"
        )
    return state.step


def splice(name: str, *, graph_safe_decode: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Declare a request-dependent op as a splice point.

    Args:
        name: shown in errors, stats and NVTX ranges (e.g. ``"attention.sparse"``).
        graph_safe_decode: the op reads all per-request state from fixed-size device buffers
            and launches grids fixed by shape for uniform decode steps, so whole decode graphs
            may capture through it.
    """
    op = SpliceOp(name, graph_safe_decode)

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            state = _STATE.get()
            if state is None or state.driver is None or state.splice_depth > 0:
                result = fn(*args, **kwargs)
            else:
                state.seen.append(op)
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
