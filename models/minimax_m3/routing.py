"""Routing like a deployed model: the calibrated routing bias of random weights, the device-side
routing simulation for benchmarks, and the expert spread a step ran with.

A random router sends a whole batch to a handful of experts: the hidden states of a random
model share a large common direction, so every token's scores rank the same few experts first.
A trained model's routing bias (``e_score_correction_bias``, aux-loss-free balancing) keeps the
load even, and a step of T tokens reads the weights of about as many experts as uniform routing
would. Three tools here make measurements read those bytes:

- ``calibrate_routing_bias_``: after ``init_random_``, one prefill of random prompts through the
  model (eager, torch ops, a private cache); each MoE layer, when the forward reaches it, solves
  its bias so that the rows it sees spread evenly over the experts, then routes with it, so the
  later layers see the hidden states of the balanced model. Measured at rank-of-8 (60 layers,
  decode 32): 0.96x the experts of uniform routing for tokens over context the model wrote,
  0.75x for tokens over synthetic (random) context, whose hidden states are more alike: steps
  over synthetic context should run the ``uniform`` simulation.
- ``RoutingSimulation`` (``uniform`` | ``balanced``): the op table replaces the router's choices
  on the device, inside the captured graphs (``make_ops(..., routing=...)``).
- ``measure_routing_spread``: the distinct experts and (token, expert) pairs per layer of one
  eager decode step on this rank, beside the uniform expectation; ``RoutingSpread.describe``
  is the line every benchmark prints (with a warning below 0.8x).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from attention.dims import AttentionDims
from attention.registry import make_backend
from graphcap.config import CaptureConfig
from kvcache.paged import PagedKVCache
from models.runner.runner import ModelRunner
from steps import TokenChunk

from .layers import BlockSparseMoE, local_expert_keys, route, router_scores

ROUTINGS = ("model", "uniform", "balanced")
SPREAD_WARNING = 0.8  # below this fraction of the uniform expectation a figure is not a deployment's

MoEOp = Callable[[BlockSparseMoE, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_M32 = 0xFFFFFFFF
KEY_COLUMNS = 64  # hidden-state columns hashed into a token's key (enough to tell tokens apart)
MAX_SIMULATED_EXPERTS = 256


@dataclass(frozen=True)
class RoutingSimulation:
    """Replaces the router's expert ids on the device (graph-safe: fixed shapes, no host work,
    no RNG state; the same step gives the same ids in a graph and eagerly). The routing weights
    stay the router's.

    - ``uniform``: each token picks ``k`` distinct experts by a hash of its hidden state's bits:
      independent, uniform picks per token, as a trained, balanced router gives.
    - ``balanced``: the step's ``T * k`` picks walk the experts in a fixed permutation (a
      stride coprime with ``E``): perfectly even load, every rank equally busy (an upper bound
      on the experts a step touches).
    """

    strategy: str

    def __post_init__(self) -> None:
        if self.strategy not in ROUTINGS[1:]:
            raise ValueError(f"routing simulation {self.strategy!r}: choose one of {ROUTINGS[1:]} "
                             "(or routing='model' for the router's own choices)")

    @staticmethod
    def check_experts(num_experts: int) -> None:
        if num_experts > MAX_SIMULATED_EXPERTS:
            raise ValueError(f"the routing simulation handles at most {MAX_SIMULATED_EXPERTS} experts (the expert id "
                             f"rides in 8 bits of the hash), got {num_experts}; use routing='model'")

    def stride(self, num_experts: int) -> int:
        """The balanced walk's stride: the first at or above ``0.618 E`` coprime with ``E``
        (consecutive picks land far apart, so on different expert-parallel ranks)."""
        s = max(1, round(0.618 * num_experts))
        while math.gcd(s, num_experts) != 1:
            s += 1
        return s

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
        """x: ``[T, H]``; ids: global expert ids ``[T, k]`` (-1 on padded rows, kept) -> ids of
        the same dtype and shape."""
        self.check_experts(num_experts)
        t, k = ids.shape
        if self.strategy == "balanced":
            picks = torch.arange(t * k, device=ids.device).view(t, k) * self.stride(num_experts) % num_experts
        else:
            picks = torch.topk(_expert_hash(x, num_experts), k, dim=-1).indices
        return torch.where(ids >= 0, picks.to(ids.dtype), ids)


def _expert_hash(x: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[T, E]``: a 32-bit hash of (token key, expert) with the expert id in the low 8
    bits, so a row's values are distinct and top-k has no ties (the fused kernel,
    ``kernels.routing_sim``, computes the same values and picks the same experts in the same
    order). The key mixes the fp32 bits of the token's first hidden columns. Integer
    arithmetic, every product below 2**63."""
    cols = x[:, :KEY_COLUMNS].float().contiguous().view(torch.int32).to(torch.int64) & _M32
    mult = torch.arange(cols.shape[1], device=x.device, dtype=torch.int64) * 2_654_435 + 40_503
    key = ((cols * mult) & _M32).sum(-1) & 0x7FFFFFFF  # [T], 31 bits
    e = torch.arange(num_experts, device=x.device, dtype=torch.int64)
    h = (key[:, None] * 0x2F3A1B + e * 0x45D9F3B + 0x3C6EF372) & _M32
    for _ in range(2):  # two rounds of xor-shift-multiply mixing
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & _M32
    return ((h ^ (h >> 16)) << 8) | e


def routing_simulation(routing: str) -> RoutingSimulation | None:
    """``model`` -> None (the router's choices); ``uniform`` / ``balanced`` -> the simulation.

    Raises:
        ValueError: another name.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: choose one of {ROUTINGS}")
    return None if routing == "model" else RoutingSimulation(routing)


def select_experts(moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None,
                   simulation: RoutingSimulation | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch router (``layers.route``), then the simulation if any: ids ``[T, k]``,
    weights fp32 ``[T, k]``."""
    ids, w = route(x, moe.gate.weight, moe.e_score_correction_bias, moe.top_k, moe.scale, num_real_tokens)
    return (ids if simulation is None else simulation(x, ids, moe.gate.weight.shape[0])), w


# ---- calibration -----------------------------------------------------------------------------

def balanced_bias(scores: torch.Tensor, top_k: int, iters: int = 200) -> torch.Tensor:
    """The selection bias that spreads ``topk(scores + bias)`` evenly over the experts.

    An iterative version of aux-loss-free balancing: each round moves every expert's bias
    against its load error (``load / target - 1``), with a step that shrinks from a tenth of the
    scores' spread to nothing, so it settles instead of oscillating.

    Args:
        scores: fp32 ``[N, E]`` router scores (sigmoid) of N real tokens.
    Returns:
        fp32 ``[E]``, mean zero.
    """
    n, e = scores.shape
    target = n * top_k / e
    bias = torch.zeros(e, dtype=torch.float32, device=scores.device)
    base = 0.1 * float(scores.std())
    for i in range(iters):
        picks = torch.topk(scores + bias, top_k, dim=-1).indices.flatten()
        load = torch.bincount(picks, minlength=e).float()
        bias -= base * (1 - i / iters) * (load / target - 1).clamp(-1, 1)
    return bias - bias.mean()


class CalibratingMoE:
    """An op-table ``moe`` that first sets the layer's routing bias from the rows it is given
    (``balanced_bias`` of their scores), then runs ``inner``: used by one eager forward."""

    def __init__(self, inner: MoEOp) -> None:
        self.inner = inner
        self.layers = 0

    def __call__(self, moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None) -> torch.Tensor:
        rows = x if num_real_tokens is None else x[: int(num_real_tokens)]
        moe.e_score_correction_bias.copy_(balanced_bias(router_scores(rows, moe.gate.weight), moe.top_k))
        self.layers += 1
        return self.inner(moe, x, num_real_tokens)


@torch.no_grad()
def calibrate_routing_bias_(model: torch.nn.Module, torch_ops: object, seed: int = 0, num_prompts: int = 8,
                            prompt_len: int = 128) -> int:
    """Set every MoE layer's routing bias so that random prompts spread evenly over its experts
    (see the module docstring). Runs one eager prefill of ``num_prompts`` random prompts of
    ``prompt_len`` tokens through the model on a private cache and the torch attention backend
    with ``torch_ops``, the model's torch op table (``ops.make_ops("torch", ...)``: no Triton
    kernel is built for it), then restores the model's cache, backend and op table. Returns the
    number of layers calibrated.

    Under a process group every rank calls it with the same seed: the router and the hidden
    states are replicated, so every rank reaches the same bias.
    """
    if not any(isinstance(m, BlockSparseMoE) for m in model.modules()):
        return 0
    c = model.config
    device = next(model.parameters()).device
    page = c.sparse_block_size
    pages_per_seq = -(-prompt_len // page)
    cache = PagedKVCache(c.kv_cache_config(num_pages=num_prompts * pages_per_seq, max_seqs=num_prompts,
                                           max_pages_per_seq=pages_per_seq, dtype=model.dtype, device=device))
    tokens = num_prompts * prompt_len
    dims = AttentionDims.for_cache(cache, c.num_attention_heads, c.sparse_topk_blocks, tokens)
    saved = (model.cache, model.backend, model.splice_buffers, model.ops)
    calibrating = CalibratingMoE(torch_ops.moe)
    runner = None
    try:
        runner = ModelRunner(model, cache, make_backend("torch", cache, dims), tokens, num_prompts)
        model.ops = dataclasses.replace(torch_ops, moe=calibrating)
        gen = torch.Generator().manual_seed(seed * 7_919 + 17)
        vocab = min(runner.vocab_size, c.vocab_size)  # ids every rank's embedding rows hold
        chunks = []
        for i in range(num_prompts):
            runner.add_request(("calibration", i))
            ids = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
            chunks.append(TokenChunk(("calibration", i), 0, ids))
        runner.run_chunks(chunks)
    finally:
        if runner is not None:
            runner.destroy()
        model.cache, model.backend, model.splice_buffers, model.ops = saved
    return calibrating.layers


# ---- the spread a step ran with --------------------------------------------------------------

@dataclass(frozen=True)
class RoutingSpread:
    """The experts one step's routing touched on this rank, per MoE layer, and the uniform
    expectation.

    Attributes:
        routing: ``model`` (the router, with its bias) or the simulation's name.
        tokens: real rows of the step; top_k, num_experts: picks per token, experts in all.
        local: the experts this rank holds.
        distinct: distinct local experts per layer; pairs: (token, local expert) pairs per layer.
    """

    routing: str
    tokens: int
    top_k: int
    num_experts: int
    local: int
    distinct: tuple[int, ...]
    pairs: tuple[int, ...]

    @property
    def uniform_distinct(self) -> float:
        """Expected distinct local experts under uniform routing: a token misses a given expert
        with probability ``1 - k/E``, so ``local * (1 - (1 - k/E)**T)``."""
        return self.local * (1 - (1 - self.top_k / self.num_experts) ** self.tokens)

    @property
    def uniform_pairs(self) -> float:
        """Expected local pairs under uniform routing: ``T * k * local / E``."""
        return self.tokens * self.top_k * self.local / self.num_experts

    @property
    def mean_distinct(self) -> float:
        return sum(self.distinct) / len(self.distinct)

    @property
    def mean_pairs(self) -> float:
        return sum(self.pairs) / len(self.pairs)

    @property
    def pairs_per_expert(self) -> float:
        """Mean pairs a touched local expert holds: the rows an MoE kernel's pair tiles see (a
        1054-token step of rank-of-8, 4 of 128 experts a token, gives each of its 16 ~33)."""
        return self.mean_pairs / self.mean_distinct if self.mean_distinct else 0.0

    @property
    def ratio(self) -> float:
        """Mean distinct local experts over the uniform expectation."""
        return self.mean_distinct / self.uniform_distinct

    @property
    def realistic(self) -> bool:
        return self.ratio >= SPREAD_WARNING

    def describe(self) -> str:
        line = (f"expert spread ({self.routing} routing, decode {self.tokens}, {len(self.distinct)} MoE layers): "
                f"{self.mean_distinct:.1f} distinct local experts per layer (of {self.local}; uniform routing "
                f"{self.uniform_distinct:.1f}: {self.ratio:.2f}x), {self.mean_pairs:.1f} local pairs per layer "
                f"(uniform {self.uniform_pairs:.1f}; {self.pairs_per_expert:.1f} per touched expert), "
                f"min {min(self.distinct)} / max {max(self.distinct)} experts")
        if not self.realistic:
            line += (f"\n*** WARNING: routing touches {self.ratio:.2f}x the experts uniform routing would (< "
                     f"{SPREAD_WARNING}x): MoE figures read too few weight bytes to stand for a deployment; run "
                     "with calibrated routing (init_random_) or --routing uniform ***")
        return line

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "uniform_distinct": self.uniform_distinct,
                "uniform_pairs": self.uniform_pairs, "mean_distinct": self.mean_distinct,
                "mean_pairs": self.mean_pairs, "pairs_per_expert": self.pairs_per_expert, "ratio": self.ratio}


class RecordingMoE:
    """An op-table ``moe`` that records each layer's expert ids (``select_experts``: the same
    choices the kernels make, recomputed in torch) before running ``inner``; eager runs only."""

    def __init__(self, inner: MoEOp, simulation: RoutingSimulation | None) -> None:
        self.inner, self.simulation = inner, simulation
        self.local: list[torch.Tensor] = []  # per layer: local expert ids of real pairs (-1 else)

    def __call__(self, moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None) -> torch.Tensor:
        ids, _ = select_experts(moe, x, num_real_tokens, self.simulation)
        n = x.shape[0] if num_real_tokens is None else int(num_real_tokens)
        held = moe.experts.num_experts
        keys = local_expert_keys(ids[:n], moe.expert_offset, held)  # ``held`` for another rank's or padding
        self.local.append(torch.where(keys < held, keys, -1).cpu())
        return self.inner(moe, x, num_real_tokens)


@contextlib.contextmanager
def recorded_routing(model: torch.nn.Module) -> Iterator[RecordingMoE]:
    """Within the block, the model's eager forwards record their expert ids."""
    saved = model.ops
    recorder = RecordingMoE(saved.moe, getattr(saved, "routing", None))
    model.ops = dataclasses.replace(saved, moe=recorder)
    try:
        yield recorder
    finally:
        model.ops = saved


@contextlib.contextmanager
def _eager_twin(runner: ModelRunner) -> Iterator[ModelRunner]:
    """A runner without graphs over ``runner``'s model and cache, its manager destroyed after."""
    eager = runner.with_capture(CaptureConfig(enabled=False, max_tokens=runner.max_tokens))
    try:
        yield eager
    finally:
        eager.manager.destroy()


@torch.inference_mode()
def measure_routing_spread(runner: ModelRunner, batch: int = 32, prompt_len: int = 16, seed: int = 0,
                           step: Sequence[TokenChunk] | None = None) -> RoutingSpread | None:
    """The expert spread of one decode step of ``batch`` requests (random prompts of
    ``prompt_len`` tokens, prefilled first), run eagerly on ``runner``'s model and cache (a twin
    runner without graphs; the requests are freed after, other requests are untouched).
    ``batch`` is capped by the runner's step capacity, free request slots and free pages.
    Returns None for a model without MoE layers.

    ``step``: instead, the spread of this step of the caller's requests, run eagerly without
    committing (a benchmark's own decode step, on the context it really has).

    Raises:
        RuntimeError: no request slot or pages free.
    """
    model = runner.model
    moes = [m for m in model.modules() if isinstance(m, BlockSparseMoE)]
    if not moes:
        return None
    if step is not None:
        with _eager_twin(runner) as eager, recorded_routing(model) as rec:
            eager.run_chunks(step, commit=False)
        return _spread(model, moes[0], sum(ch.num_tokens for ch in step), rec)
    prompt_len = max(1, min(prompt_len, runner.max_tokens, runner.max_seq_len - 1))  # what one step holds
    page = runner.page_size
    per_request = -(-(prompt_len + 1) // page)
    free_rows = runner.max_live_requests - runner.cache.num_live_seqs
    batch = min(batch, runner.max_seqs, free_rows, runner.num_free_pages // per_request)
    if batch < 1:
        raise RuntimeError(f"measuring the expert spread needs a free request slot and {per_request} free KV pages; "
                           f"the runner has {free_rows} slots and {runner.num_free_pages} pages free")
    gen = torch.Generator().manual_seed(seed * 104_729 + 3)
    vocab = min(runner.vocab_size, model.config.vocab_size)
    names = [("routing-spread", i) for i in range(batch)]
    with _eager_twin(runner) as eager:
        try:
            prompts = []
            for name in names:
                eager.add_request(name)
                prompts.append(TokenChunk(name, 0, torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()))
            per_step = max(1, runner.max_tokens // prompt_len)
            for i in range(0, batch, per_step):
                eager.run_chunks(prompts[i : i + per_step])
            decode = [TokenChunk(name, prompt_len, [int(torch.randint(0, vocab, (1,), generator=gen))])
                      for name in names]
            with recorded_routing(model) as rec:
                eager.run_chunks(decode)
        finally:
            for name in names:
                if eager.cache.has_sequence(name):
                    eager.free_request(name)
    return _spread(model, moes[0], batch, rec)


def _spread(model: torch.nn.Module, first: BlockSparseMoE, tokens: int, rec: RecordingMoE) -> RoutingSpread:
    sim = getattr(model.ops, "routing", None)
    return RoutingSpread(
        routing=sim.strategy if sim is not None else "model", tokens=tokens, top_k=first.top_k,
        num_experts=first.gate.weight.shape[0], local=first.experts.num_experts,
        distinct=tuple(int(torch.unique(ids[ids >= 0]).numel()) for ids in rec.local),
        pairs=tuple(int((ids >= 0).sum()) for ids in rec.local))


__all__ = ["ROUTINGS", "RoutingSimulation", "RoutingSpread", "balanced_bias", "calibrate_routing_bias_",
           "measure_routing_spread", "recorded_routing", "routing_simulation", "select_experts"]
