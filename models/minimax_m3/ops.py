"""The producer op table of MiniMax-M3: which implementation each request-independent op
runs, chosen once per model (``make_ops``).

Every op has a plain-torch implementation (the reference maths of ``layers``, and the CPU
path) and a fused CUDA one behind the same signature; the model calls ``ops.<op>(...)`` with
no branch, handing each op what it needs (the op table never reaches into the model).
``make_ops("auto", device)`` picks the fused kernels on CUDA and torch elsewhere.

Ops (``T`` tokens, hidden ``H``):
    norm_rope_write(qkv, positions, inv_freq, slot_mapping, layout, norms, cache, layer, q_out,
        iq_out): per-head Gemma norms of q, k (and iq, ik), partial NeoX RoPE, K/V (and index-K)
        cache writes of ``layer`` (slot -1 writes nothing) in the cache's dtypes (an fp8 e4m3
        cache stores ``x.clamp(-448, 448)`` cast, both implementations bit for bit alike given
        the same fp32 values: ``kvcache.paged.to_cache_dtype``); ``q_out [T, Hq, D]`` and
        ``iq_out [T, Hidx, Di]`` (or None) receive the normed, rotated queries (model dtype).
    rmsnorm(x, weight, eps) -> ``[T, H]``: Gemma RMSNorm (the first layer's input norm).
    add_rmsnorm(x, residual, weight, eps) -> (normed, residual): ``residual += x``, then the
        norm of the sum; the fused kernel works in place (flashinfer's semantics: the norm
        reads the unrounded fp32 sum).
    mlp(mlp, x) -> ``[T, H]``: the dense layers' SwiGLU-OAI MLP.
    linear(linear, x) -> ``[T, N]``: the projections (attention qkv_proj and o_proj, the dense
        MLP's); for MXFP8 weights the fused table runs the fp8 kernel where the tuner chose it.
    moe(moe, x, num_real_tokens) -> ``[T, H]``: router, this rank's routed experts and the
        shared expert; rows ``>= num_real_tokens`` (padding) reach no routed expert.
    choose_kernels(model, num_tokens, tune): host work before a forward of ``num_tokens`` rows
        (kernel choices: every MoE configuration is validated against the torch reference on a
        probe input, the fastest valid one is kept, and the rejected ones are reported).
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from graphcap.startup.tuning import ChoiceStore, KernelTuner
from kvcache.paged import PagedKVCache
from models.runner.protocol import OpTable

from .kernels.producer import HeadNorms, QKVLayout, norm_rope_cache_write, norm_rope_torch
from .layers import BlockSparseMoE, DenseMLP, gemma_rmsnorm
from .mxfp8 import MXFP8Linear
from .routing import RoutingSimulation, routing_simulation, select_experts

if TYPE_CHECKING:  # the kernels import Triton; the torch op table must not need it
    from .kernels.moe import MoEScales
    from .kernels.moe_align import MoEAlignment

PRODUCERS = ("auto", "torch", "triton")
MOE_IMPLS = ("auto", "grouped", "loop")


# ---- plain torch -------------------------------------------------------------------------

def norm_rope_write_torch(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                          slot_mapping: torch.Tensor, layout: QKVLayout, norms: HeadNorms, cache: PagedKVCache,
                          layer: int, q_out: torch.Tensor, iq_out: torch.Tensor | None) -> None:
    """The plain-torch producer: ``norm_rope_torch`` then ``PagedKVCache.write`` (capturable),
    which casts the fp32 K, index-K and raw V into the cache dtypes (clamped for fp8)."""
    r = norm_rope_torch(qkv, positions, layout, inv_freq, *norms)
    cache.write(layer, slot_mapping, r.k, r.v, r.ik)
    q_out.copy_(r.q)
    if iq_out is not None:
        iq_out.copy_(r.iq)


def add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return gemma_rmsnorm(residual, weight, eps), residual


def mlp_torch(mlp: DenseMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp(x)


def linear_torch(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return linear(x)


class TorchMoE:
    """The torch MoE (``layers.BlockSparseMoE``): ``grouped`` GEMMs or the ``loop``, with the
    router's choices or a ``routing.RoutingSimulation``'s."""

    def __init__(self, grouped: bool, simulation: RoutingSimulation | None = None) -> None:
        self.grouped, self.simulation = grouped, simulation

    def __call__(self, moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None) -> torch.Tensor:
        ids, w = select_experts(moe, x, num_real_tokens, self.simulation)
        return moe.routed_and_shared(x, ids, w, self.grouped)


# ---- fused CUDA kernels (Triton) -------------------------------------------------------------

def norm_rope_write_triton(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                           slot_mapping: torch.Tensor, layout: QKVLayout, norms: HeadNorms, cache: PagedKVCache,
                           layer: int, q_out: torch.Tensor, iq_out: torch.Tensor | None) -> None:
    """The fused Triton producer: one launch for norms, RoPE and every cache write."""
    index = {}
    if layout.has_index:
        index = dict(index_q_norm=norms.index_q, index_k_norm=norms.index_k,
                     index_k_cache=cache.index_k_cache[cache.sparse_index(layer)], iq_out=iq_out)
    norm_rope_cache_write(qkv, positions, slot_mapping, layout, inv_freq, norms.q, norms.k, cache.k_cache[layer],
                          cache.v_cache[layer], q_out=q_out, **index)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from .kernels.norm import gemma_rmsnorm as gemma_rmsnorm_kernel

    out = torch.empty_like(x)
    gemma_rmsnorm_kernel(x, weight, eps, out)
    return out


def add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .kernels.norm import gemma_fused_add_rmsnorm

    gemma_fused_add_rmsnorm(x, residual, weight, eps)  # in place: x <- norm(residual + x), residual <- sum
    return x, residual


def mlp_triton(mlp: DenseMLP, x: torch.Tensor, linear: Callable[..., torch.Tensor] = linear_torch) -> torch.Tensor:
    """The dense MLP with the fused activation; ``linear(module, x)`` runs its two projections
    (the fused table hands its ``FusedLinear``: the fp8 kernel for MXFP8 weights)."""
    from .kernels.activation import swiglu_oai_triton

    return linear(mlp.down_proj, swiglu_oai_triton(linear(mlp.gate_up_proj, x), mlp.alpha, mlp.limit))


class FusedLinear:
    """Projections (attention qkv and o_proj, the dense MLP's two): an MXFP8 weight runs the
    Triton fp8 kernel (``kernels.fp8_linear``: one of its tile candidates or, at one or two
    rows, its weight-row form) or, at prefill sizes, the Triton dequantise + ``F.linear``,
    where the tuner validated it against the module's own forward (torch dequantise +
    ``F.linear``) and timed it fastest; everything else runs the module."""

    OP = "mxfp8_linear"
    DEQUANTIZE = "triton dequantise + F.linear"

    def __init__(self, tuner: KernelTuner) -> None:
        self.tuner = tuner
        # (N, K, rows) -> the LinearConfig that won, or DEQUANTIZE
        self._kernel_rows: dict[tuple[int, int, int], object] = {}

    def __call__(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if isinstance(linear, MXFP8Linear):
            choice = self._kernel_rows.get((linear.out_features, linear.in_features, x.shape[0]))
            if choice is not None:
                return self._run(choice, linear, x)
        return linear(x)

    @classmethod
    def _run(cls, choice: object, mod: MXFP8Linear, x: torch.Tensor) -> torch.Tensor:
        from .kernels.fp8_linear import dequantized_linear, mxfp8_linear

        if choice == cls.DEQUANTIZE:
            return dequantized_linear(x, mod.weight, mod.weight_scale_inv)
        return mxfp8_linear(x, mod.weight, mod.weight_scale_inv, config=choice)

    def choose(self, model: torch.nn.Module, num_tokens: int, tune: bool = True) -> None:
        """For each MXFP8 projection shape, validate and time the candidates at ``num_tokens``
        rows (``tune=False``: keep the module's path, no kernel is tried mid-run)."""
        if not tune:
            return
        from .kernels.fp8_linear import DECODE_MAX_TOKENS, gemv_config_candidates, linear_config_candidates
        from .kernels.fp8_tiles import scale_words

        shapes: dict[tuple[int, int], list[MXFP8Linear]] = {}
        for m in model.modules():
            if isinstance(m, MXFP8Linear):
                shapes.setdefault((m.out_features, m.in_features), []).append(m)
        dtype = getattr(model, "dtype", torch.float32)
        for (n, k), mods in shapes.items():
            key = (n, k, num_tokens)
            if self.tuner.get(self.OP, key) is not None:
                continue
            mod, rotation = mods[0], cold_rotation(mods)
            gen = torch.Generator(device=mod.weight.device).manual_seed(num_tokens)
            x = torch.randn(num_tokens, k, generator=gen, device=mod.weight.device).to(dtype)
            configs = linear_config_candidates(num_tokens, n, k)
            if scale_words(mod.weight_scale_inv) is not None:  # the weight-row form reads scale words
                configs += gemv_config_candidates(num_tokens, k)
            choices: dict[str, object] = {f"triton fp8 {c}": c for c in configs}
            if num_tokens > DECODE_MAX_TOKENS:
                choices[self.DEQUANTIZE] = self.DEQUANTIZE
            candidates = {"dequantise + F.linear": lambda mod=mod, x=x: mod(x)}
            candidates.update({name: lambda mod=mod, x=x, c=c: self._run(c, mod, x) for name, c in choices.items()})
            timed = {"dequantise + F.linear": lambda x=x, r=rotation: [m(x) for m in r]}
            timed.update({name: lambda x=x, c=c, r=rotation: [self._run(c, m, x) for m in r]
                          for name, c in choices.items()})
            name = self.tuner.choose(self.OP, key, candidates, lambda mod=mod, x=x: mod(x),
                                     tol=2e-2 if dtype == torch.bfloat16 else 1e-4, signature=f"N{n} K{k} {dtype}",
                                     timed=timed, calls_per_timed=len(rotation))
            if name in choices:
                self._kernel_rows[key] = choices[name]


# Bytes of weights a linear candidate is timed over: more than an H200's 50 MB L2 holds, so
# the timing reads them from HBM as the model does (each layer's weights once per step).
# Timed on one 6-10 MB weight, which stays in L2 across the replays, the tile kernels' latency
# was hidden and the choice at one row flipped between the weight-row form and the tiles from
# one start to the next (decode 1 on the H200: 76.5 vs 81.6 us per layer).
TIMED_WEIGHT_BYTES = 128 << 20


def cold_rotation(mods: list[MXFP8Linear]) -> list[MXFP8Linear]:
    """The first of ``mods`` (one shape, e.g. every layer's qkv) whose weights and scales add
    up to :data:`TIMED_WEIGHT_BYTES`, or all of them where they hold less."""
    w = mods[0].weight
    per = w.numel() * w.element_size() + mods[0].weight_scale_inv.numel() * mods[0].weight_scale_inv.element_size()
    return mods[: max(1, -(-TIMED_WEIGHT_BYTES // per))]


def moe_scales(moe: BlockSparseMoE) -> MoEScales | None:
    """The MXFP8 scales of an fp8 MoE (routed and shared experts) for the fused kernels, or None."""
    if not moe.experts.quantized:
        return None
    from .kernels.moe import MoEScales

    ex, sh = moe.experts, moe.shared_experts
    return MoEScales(ex.w13_scale_inv, ex.w2_scale_inv, sh.gate_up_proj.weight_scale_inv,
                     sh.down_proj.weight_scale_inv)


class FusedMoE:
    """Triton router (two kernels) + fused MoE (four kernels, shared expert included), with a
    validated configuration per token count."""

    def __init__(self, tuner: KernelTuner, simulation: RoutingSimulation | None = None) -> None:
        self.tuner, self.simulation = tuner, simulation
        # model -> the MXFP8 candidate families its weights allow (f16, fp8_mma): read once
        self._fits: weakref.WeakKeyDictionary[torch.nn.Module, tuple[bool, bool]] = weakref.WeakKeyDictionary()
        self._configs: dict[int, object] = {}  # token count -> the validated MoEConfig

    def route(self, moe: BlockSparseMoE, x: torch.Tensor,
              num_real_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._route(moe, x, num_real_tokens, self.simulation)[:2]

    @staticmethod
    def _route(moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None,
               simulation: RoutingSimulation | None,
               align: bool = False) -> tuple[torch.Tensor, torch.Tensor, MoEAlignment | None]:
        """The router, the simulation if any inside its top-k kernel (``kernels.routing_sim``).
        Returns this rank's local ids int32 ``[T, k]`` (-1: padding or another rank's expert),
        the weights fp32 ``[T, k]`` (0 where the id is -1) and, with ``align`` where one
        program holds every pair (decode steps), the fused MoE's alignment of the ids, made in
        the top-k kernel's last program (else None: ``fused_moe`` aligns)."""
        from .kernels.moe_align import alignment_buffers, aligns_in_one_program
        from .kernels.router import route_triton

        T, K, E = x.shape[0], moe.top_k, moe.experts.num_experts
        ids = torch.empty(T, K, dtype=torch.int32, device=x.device)
        w = torch.empty(T, K, dtype=torch.float32, device=x.device)
        aligned = alignment_buffers(T, K, E, x.device) if align and aligns_in_one_program(T, K, E) else None
        route_triton(x, moe.gate.weight, moe.e_score_correction_bias, K, moe.scale, num_real_tokens,
                     moe.expert_offset, E, ids, w, simulation=simulation, align_out=aligned)
        return ids, w, aligned

    def experts(self, moe: BlockSparseMoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                config: object | None = None, aligned: MoEAlignment | None = None) -> torch.Tensor:
        from .kernels.moe import fused_moe

        out = torch.empty_like(x)
        sh = moe.shared_experts
        return fused_moe(x, ids, w, moe.experts.w13, moe.experts.w2, sh.gate_up_proj.weight, sh.down_proj.weight,
                         moe.alpha, moe.limit, out, config=config or self._config(x.shape[0]), scales=moe_scales(moe),
                         aligned=aligned)

    def __call__(self, moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None) -> torch.Tensor:
        ids, w, aligned = self._route(moe, x, num_real_tokens, self.simulation, align=True)
        return self.experts(moe, x, ids, w, aligned=aligned)

    def _config(self, num_tokens: int) -> object:
        from .kernels.moe import default_moe_config

        # A shape choose() never saw (direct calls in tests) runs the default configuration.
        return self._configs.get(num_tokens) or default_moe_config(num_tokens)

    def choose(self, model: torch.nn.Module, num_tokens: int, extra: dict | None = None, tune: bool = True) -> None:
        """Choose the MoE configuration for ``num_tokens`` rows: every candidate runs on the
        probes (random hidden states routed by MoE layers' own routers, uniform ids, and run on
        their weights: ``moe_probe_count`` of them where timed on the GPU, else one) and is
        compared with the torch reference; ``extra`` adds candidates (tests inject bad ones;
        each returns the probes' outputs stacked, ``[probes * num_tokens, H]``).
        ``tune=False``: row counts no graph has, which a serving loop meets by the hundred and
        must not probe mid-run (a probe run, the reference and their host sync would stall the
        step). Such a count takes the configuration chosen for the nearest count of its kind
        (decode-sized or prefill-sized tiles, as ``default_moe_config`` tells them apart): the
        smallest chosen count above it, else the largest below; the kernels take the count at
        run time, so a configuration validated at one count serves another. Only a count with
        no chosen count of its kind validates the default alone (no timing), once: the
        counts after it take that. (Taking the default wherever it had passed missed starts
        that read their choices from the store, which validates only the stored choice.)"""
        from .kernels.moe import default_moe_config, moe_config_candidates

        if num_tokens in self._configs:
            return
        if not tune:
            kind = default_moe_config(num_tokens)
            chosen = sorted(n for n in self._configs if default_moe_config(n) == kind)
            if chosen:
                near = next((n for n in chosen if n > num_tokens), chosen[-1])
                self._configs[num_tokens] = self._configs[near]
                return
        timing = tune and next(model.parameters()).device.type == "cuda"
        probes = self._probes(model, num_tokens, moe_probe_count(num_tokens) if timing else 1)
        if not probes:
            return
        moe, dtype = probes[0].moe, probes[0].x.dtype  # the first probe's layer names the shapes
        sh = moe.shared_experts
        configs = moe_config_candidates(num_tokens, *self._fp8_paths(model, moe))
        if not timing:
            configs = configs[:1]  # the default only (and the interpreter is slow)
        by_name = {f"config{i}": c for i, c in enumerate(configs)}

        def run_all(c: object) -> list[torch.Tensor]:
            return [self.experts(p.moe, p.x, p.ids, p.w, c) for p in probes]

        candidates = {name: (lambda c=c: torch.cat(run_all(c))) for name, c in by_name.items()}
        candidates.update(extra or {})
        timed = {name: (lambda c=c: run_all(c)) for name, c in by_name.items()}

        def reference() -> torch.Tensor:
            return torch.cat([p.reference() for p in probes])

        e, two_i, h = moe.experts.w13.shape
        weights = "mxfp8" if moe.experts.quantized else str(dtype)
        # The candidate list too: a stored name ("config5") means another config once the list changes.
        listed = hashlib.sha1(repr(configs).encode()).hexdigest()[:8]
        signature = (f"E{e} 2I{two_i} H{h} k{moe.top_k} shared{sh.gate_up_proj.weight.shape[0]} {weights} "
                     f"probe uniform x{len(probes)} candidates {listed}")
        name = self.tuner.choose("moe", num_tokens, candidates, reference,
                                 tol=2e-2 if dtype == torch.bfloat16 else 1e-4, signature=signature,
                                 timed=timed, calls_per_timed=len(probes))
        self._configs[num_tokens] = by_name[name]

    def compile_kernels(self, model: torch.nn.Module, num_tokens: int) -> None:
        """Launch the router and every candidate configuration for ``num_tokens`` rows once on
        a probe, for ``graphcap.startup.compile_ahead`` (inside it the launches compile only,
        many at once, so the ``choose`` that follows finds every kernel built)."""
        from .kernels.moe import moe_config_candidates

        probes = self._probes(model, num_tokens, 1) if num_tokens not in self._configs else []
        for p in probes:
            for config in moe_config_candidates(num_tokens, *self._fp8_paths(model, p.moe)):
                self.experts(p.moe, p.x, p.ids, p.w, config)

    def _fp8_paths(self, model: torch.nn.Module, moe: BlockSparseMoE) -> tuple[bool, bool]:
        """Which MXFP8 candidate families every MoE layer allows, ``(f16, fp8_mma)``: f16 math
        where the scales fit (``scales_fit_f16``), fp8 tensor-core dots where the shapes do
        (``fits_fp8_mma``); both False for bf16 experts. Read on the host once per model, not
        once per token count."""
        from .kernels.moe import scales_fit_f16
        from .kernels.moe_fp8_mma import fits_fp8_mma

        if not moe.experts.quantized:
            return False, False
        if model not in self._fits:
            layers = [m for m in model.modules() if isinstance(m, BlockSparseMoE)]
            scales = [moe_scales(m) for m in layers]
            ok = bool(scales) and all(sc is not None for sc in scales)
            f16 = ok and all(scales_fit_f16(sc) for sc in scales)
            mma = ok and all(fits_fp8_mma(m.experts.w13.shape[2], m.experts.w13.shape[1] // 2,
                                          m.shared_experts.gate_up_proj.weight.shape[0] // 2, tuple(sc))
                             for m, sc in zip(layers, scales))
            self._fits[model] = (f16, mma)
        return self._fits[model]

    def _probes(self, model: torch.nn.Module, num_tokens: int, count: int) -> list[MoEProbe]:
        """``count`` probes of ``num_tokens`` random hidden states (each seeded by the row count
        and its index), probe ``i`` on the ``i``-th MoE layer (cycling), routed as
        ``_PROBE_ROUTING`` routes: the router's weights, uniform expert ids, so candidates are
        timed on the expert spread a balanced, trained model gives, not on the few experts a
        random router may favour. Empty for a model without MoE layers."""
        layers = [m for m in model.modules() if isinstance(m, BlockSparseMoE)]
        probes = []
        for i in range(count if layers else 0):
            moe = layers[i % len(layers)]
            dev, dtype = moe.experts.w13.device, moe.experts.dtype
            gen = torch.Generator(device=dev).manual_seed(num_tokens + (i << 20))
            x = torch.randn(num_tokens, moe.experts.w13.shape[2], generator=gen, device=dev).to(dtype)
            ids, w = self._route(moe, x, None, _PROBE_ROUTING)[:2]
            probes.append(MoEProbe(moe, x, ids, w))
        return probes


@dataclass(frozen=True)
class MoEProbe:
    """One probe of the MoE tuner: a layer, hidden states ``[T, H]`` and their routing (local
    ids int32 ``[T, k]``, weights fp32 ``[T, k]``)."""

    moe: BlockSparseMoE
    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor

    def reference(self) -> torch.Tensor:
        """The probe through ``fused_moe_torch`` on only the local experts it routes to, ``[T, H]``
        (at least one: none routed runs expert 0 with every id -1; all routed runs the layer's
        tensors as they are, no copy). The same sums in the same order as over every expert (an
        expert no row picks adds exact zeros), so the same values up to the sign of a zero. Why:
        ``dequantize_mxfp8`` takes a whole MXFP8 layer's experts through fp32 (about 5 GB at
        rank-of-8), for a decode-sized probe that reaches one to four of them; the tuner runs
        ``moe_probe_count`` probes per decode size and again at every start that validates a
        stored choice."""
        from .kernels.moe import MoEScales, fused_moe_torch

        ex, sh = self.moe.experts, self.moe.shared_experts
        w13, w2, ids, scales = ex.w13, ex.w2, self.ids, moe_scales(self.moe)
        used = torch.unique(ids[ids >= 0]).long()  # a host sync: start-up work, never captured
        if used.numel() < w13.shape[0]:
            if used.numel() == 0:
                used = torch.zeros(1, dtype=torch.long, device=ids.device)
            local = torch.full((w13.shape[0],), -1, dtype=torch.int32, device=ids.device)
            local[used] = torch.arange(used.numel(), dtype=torch.int32, device=ids.device)
            ids = torch.where(ids >= 0, local[ids.clamp(min=0).long()], -1).to(torch.int32).contiguous()
            w13, w2 = w13[used], w2[used]
            if scales is not None:
                scales = MoEScales(scales.w13[used], scales.w2[used], scales.shared_gate_up, scales.shared_down)
        return fused_moe_torch(self.x, ids, self.w, w13, w2, sh.gate_up_proj.weight, sh.down_proj.weight,
                               self.moe.alpha, self.moe.limit, torch.empty_like(self.x), scales=scales)


# Rows the MoE tuner's probes hold together at decode sizes. One token's 4 picks of 128
# experts find none of a rank's 16 in 58% of draws (the gate/up launch then streams the shared
# expert alone), one or more in the rest, and the candidates rank differently in the two cases
# (H100, kernels alone, ``benchmarks/results/mxfp8_round20/``): a single probe timed one case,
# so the choice at decode 1 could follow its seed. Probes of 16 rows in all, each on another
# layer's weights, time the mix a step meets, read from HBM as the model reads them (a probe
# that routes to no local expert reads 7 MB, which would stay in L2 across the replays).
MOE_PROBE_ROWS = 16


def moe_probe_count(num_tokens: int) -> int:
    """How many probes of ``num_tokens`` rows the MoE tuner times (``MOE_PROBE_ROWS``)."""
    return max(1, -(-MOE_PROBE_ROWS // num_tokens))


_PROBE_ROUTING = RoutingSimulation("uniform")


# ---- the table ---------------------------------------------------------------------------

@dataclass(frozen=True)
class M3Ops(OpTable):
    """One model's producer implementations (see the module docstring for the signatures)."""

    name: str
    norm_rope_write: Callable[..., None]
    rmsnorm: Callable[..., torch.Tensor]
    add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    mlp: Callable[..., torch.Tensor]
    moe: Callable[..., torch.Tensor]
    tuner: KernelTuner | None = None
    routing: RoutingSimulation | None = None  # what replaced the router's choices (None: the router)
    linear: Callable[..., torch.Tensor] = linear_torch  # linear(module, x): the attention projections

    def choose_kernels(self, model: torch.nn.Module, num_tokens: int, tune: bool = True) -> None:
        """Host work before a forward of ``num_tokens`` rows (outside any capture); ``tune``:
        time the candidate kernels (else the default is validated alone)."""
        if isinstance(self.moe, FusedMoE):
            self.moe.choose(model, num_tokens, tune=tune)
        if isinstance(self.linear, FusedLinear):
            self.linear.choose(model, num_tokens, tune=tune)

    def compile_kernels(self, model: torch.nn.Module, num_tokens: int) -> None:
        """Launch the tunable kernels' candidates for ``num_tokens`` rows on probes, for
        ``graphcap.startup.compile_ahead`` (see ``FusedMoE.compile_kernels``)."""
        if isinstance(self.moe, FusedMoE):
            self.moe.compile_kernels(model, num_tokens)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` exists for the device and dtype (CPU any float dtype; CUDA bf16)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return dtype == torch.bfloat16 if device.type == "cuda" else True


def choice_store(device: torch.device) -> ChoiceStore | None:
    """The on-disk kernel choices for this GPU and software versions (CUDA only)."""
    if device.type != "cuda":
        return None
    import triton

    from graphcap.startup import jit_cache

    jit_cache.configure()
    namespace = f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|triton {triton.__version__}"
    return ChoiceStore(jit_cache.kernel_choices_file(), namespace)


def make_ops(producer: str, device: torch.device | str | None, dtype: torch.dtype, moe_impl: str = "auto",
             routing: str = "model") -> M3Ops:
    """The op table for ``producer``: ``triton`` (fused kernels; ``auto`` on CUDA) or ``torch``
    (``auto`` elsewhere). ``moe_impl`` picks the torch MoE: ``grouped`` (``torch._grouped_mm``
    where supported, the ``auto`` choice) or ``loop`` (see ``layers.BlockSparseMoE``).
    ``routing``: ``model`` (the router's choices) or a simulation for measurements,
    ``uniform`` or ``balanced`` (``routing.RoutingSimulation``, on the device, in the graphs).

    Raises:
        ValueError: unknown ``producer``, ``moe_impl`` or ``routing``.
    """
    if producer not in PRODUCERS:
        raise ValueError(f"producer={producer!r}: choose one of {PRODUCERS}")
    if moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl={moe_impl!r}: choose one of {MOE_IMPLS}")
    dev = torch.device(device or "cpu")
    sim = routing_simulation(routing)
    if producer == "auto":
        producer = "triton" if dev.type == "cuda" else "torch"
    if producer == "triton":
        tuner = KernelTuner(time_candidates=dev.type == "cuda", store=choice_store(dev))
        linear = FusedLinear(tuner)
        return M3Ops("triton", norm_rope_write_triton, rmsnorm_triton, add_rmsnorm_triton,
                     functools.partial(mlp_triton, linear=linear), FusedMoE(tuner, sim), tuner, sim, linear)
    if moe_impl == "auto":
        moe_impl = "grouped" if grouped_mm_supported(dev, dtype) else "loop"
    return M3Ops(f"torch+{moe_impl}", norm_rope_write_torch, gemma_rmsnorm, add_rmsnorm_torch, mlp_torch,
                 TorchMoE(moe_impl == "grouped", sim), routing=sim)
