"""A model-agnostic serving loop over a runner protocol (``engine.protocol.StepRunner``):
request queue, admission by block-table rows and KV pages, chunked prefill mixed with decode
under a token budget, sampling, and host/GPU overlap."""

from .engine import Engine, EngineConfig, EngineStats, StepRecord
from .metrics import (
    STEP_LOG_COLUMNS,
    chunk_step_figures,
    compile_figures,
    gc_figures,
    request_figures,
    step_figures,
    step_log,
    summarize,
)
from .protocol import StepRunner
from .request import Request, RequestState, Status
from .sampling import Sampler, SamplingParams
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from .workload import make_requests, serve

__all__ = ["STEP_LOG_COLUMNS", "Engine", "EngineConfig", "EngineStats", "Request", "RequestState", "Sampler",
           "SamplingParams", "ScheduledChunk", "Scheduler", "SchedulerConfig", "Status", "StepRecord", "StepRunner",
           "chunk_step_figures", "compile_figures", "gc_figures", "make_requests", "request_figures", "serve",
           "step_figures", "step_log", "summarize"]
