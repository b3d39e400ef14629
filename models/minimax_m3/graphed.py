"""MiniMax-M3 steps through graphcap: the runner's forward captured per bucket.

``GraphedM3Runner`` wraps an ``M3Runner`` with a ``CaptureManager``. The captured function is
the whole forward including lm_head on every row (a decode step samples every row anyway;
for mixed steps the extra rows cost one GEMM inside the graph). The attention splice points
run eagerly between segments, or inside whole decode graphs where the backend declares them
graph-safe. Turning graphs off (``CaptureConfig(enabled=False)``) runs exactly the same code
eagerly, which is what the profile example compares against.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from graphcap import CaptureConfig, CaptureManager, InputSpec, StaticInputs, Step

from .runner import M3Runner, StepOutput, TokenChunk


def _tensors_of(obj: object) -> dict[str, torch.Tensor]:
    """Tensor attributes of an object (a backend's persistent buffers)."""
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


class GraphedM3Runner:
    """Steps of an ``M3Runner`` replayed as CUDA graphs.

    Args:
        runner: model, cache, metadata builder and backend.
        config: capture settings; ``max_tokens`` must not exceed the runner's step capacity.
            Whole decode graphs are limited to the runner's request capacity (one token per
            request).
    """

    def __init__(self, runner: M3Runner, config: CaptureConfig) -> None:
        if config.max_tokens > runner.max_tokens:
            raise ValueError(
                f"CaptureConfig.max_tokens={config.max_tokens} exceeds the runner's step capacity "
                f"{runner.max_tokens}; build the runner with max_tokens >= the capture ceiling"
            )
        max_seqs = runner.builder.max_seqs
        limit = min(config.full_graph_max_tokens or max_seqs, max_seqs)
        self.runner = runner
        static = StaticInputs(
            [InputSpec("input_ids", torch.int64, 0), InputSpec("positions", torch.int64, 0), InputSpec("slot_mapping", torch.int64, -1)],
            config.max_tokens,
            runner.device,
        )
        self.manager = CaptureManager(
            self._forward, static, replace(config, full_graph_max_tokens=limit),
            prepare=runner.plan, dummy_step=runner.dummy_step,
        )
        cache = runner.cache
        self.manager.register("model", runner.model)
        self.manager.register(
            "kv_cache", lambda: {"k": cache.k_cache, "v": cache.v_cache, "index_k": cache.index_k_cache}, mutable=True
        )
        self.manager.register("block_tables", lambda: {"block_tables": cache.block_tables})
        self.manager.register("metadata", lambda: _tensors_of(runner.builder.buffers))
        self.manager.register("attention", lambda: _tensors_of(runner.backend))

    def _forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``[T, vocab]`` for every row: the captured function."""
        return self.runner.model.compute_logits(self.runner.forward(inputs))

    def capture(self) -> None:
        """Warm up and capture every bucket. Call before admitting requests: warm-up and capture
        run on private dummy sequences, which are freed afterwards."""
        try:
            self.manager.capture()
        finally:
            self.runner.release_dummies()

    def validate(self) -> dict:
        """Replay vs eager per bucket on random tokens (see ``CaptureManager.validate``)."""
        vocab = self.runner.model.config.vocab_size

        def sample(bucket: int, full: bool) -> Step:
            step = self.runner.dummy_step(bucket, full)
            step.inputs["input_ids"] = torch.randint(0, vocab, (step.num_tokens,), device=self.runner.device)
            return step

        try:
            return self.manager.validate(sample)
        finally:
            self.runner.release_dummies()

    def step(self, chunks: Sequence[TokenChunk], all_logits: bool = False) -> StepOutput:
        """One step: build metadata, replay (or run eagerly), sample greedily per chunk."""
        step = self.runner.make_step(chunks)
        logits = self.manager.run(step)
        if self.runner.has_dummies:  # a recapture (registered storage moved) ran on dummy sequences
            self.runner.release_dummies()
        last = (step.metadata.qo_indptr_host[1:].long() - 1).to(logits.device)
        rows = logits.index_select(0, last)
        return StepOutput(rows.argmax(-1).tolist(), logits.clone() if all_logits else rows)
