"""The producer op table of MiniMax-M3: which implementation each request-independent op
runs, chosen once per model (``make_ops``).

Every op has a plain-torch implementation (the reference, and the CPU path) and a fused CUDA
one behind the same signature; the model calls ``ops.<op>(...)`` with no branch.
``make_ops("auto", device)`` picks the fused kernels on CUDA and torch elsewhere.

Ops (``T`` tokens, hidden ``H``):
    norm_rope_write(attn, qkv, positions, inv_freq, slot_mapping, cache, q_out, iq_out): per-head
        Gemma norms of q, k (and iq, ik), partial NeoX RoPE, K/V (and index-K) cache writes
        (slot -1 writes nothing); ``q_out [T, Hq, D]`` and ``iq_out [T, Hidx, Di]`` (or None)
        receive the normed, rotated queries.
    rmsnorm(x, weight, eps) -> ``[T, H]``: Gemma RMSNorm (the first layer's input norm).
    add_rmsnorm(x, residual, weight, eps) -> (normed, residual): ``residual += x``, then the
        norm of the sum; the fused kernel works in place (flashinfer's semantics: the norm
        reads the unrounded fp32 sum).
    mlp(mlp, x) -> ``[T, H]``: the dense layers' SwiGLU-OAI MLP.
    moe(moe, x, num_real_tokens) -> ``[T, H]``: router, this rank's routed experts and the
        shared expert; rows ``>= num_real_tokens`` (padding) reach no routed expert.
    prepare(model, num_tokens): host work before a forward of ``num_tokens`` rows (kernel
        choices: every MoE configuration is validated against the torch reference on a probe
        input, the fastest valid one is kept, and the rejected ones are reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from graphcap.tuning import ChoiceStore, KernelTuner
from kvcache.paged import PagedKVCache

from .kernels.producer import norm_rope_cache_write, norm_rope_torch
from .layers import BlockSparseMoE, DenseMLP, route, swiglu_oai

if TYPE_CHECKING:
    from .model import M3Attention

PRODUCERS = ("auto", "torch", "triton")
MOE_IMPLS = ("auto", "grouped", "loop")


# ---- plain torch -------------------------------------------------------------------------

def norm_rope_write_torch(attn: M3Attention, qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                          slot_mapping: torch.Tensor, cache: PagedKVCache, q_out: torch.Tensor,
                          iq_out: torch.Tensor | None) -> None:
    """The plain-torch producer: ``norm_rope_torch`` then ``PagedKVCache.write`` (capturable)."""
    idx = (attn.index_q_norm.weight, attn.index_k_norm.weight) if attn.sparse else (None, None)
    r = norm_rope_torch(qkv, positions, attn.layout, inv_freq, attn.q_norm.weight, attn.k_norm.weight, *idx)
    cache.write(attn.layer, slot_mapping, r.k, r.v, r.ik)
    q_out.copy_(r.q)
    if iq_out is not None:
        iq_out.copy_(r.iq)


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rmsnorm_torch(residual, weight, eps), residual


def mlp_torch(mlp: DenseMLP, x: torch.Tensor) -> torch.Tensor:
    gu = mlp.gate_up_proj(x)
    return mlp.down_proj(swiglu_oai(gu[:, : mlp.inter], gu[:, mlp.inter :], mlp.alpha, mlp.limit))


def _moe_torch(moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None,
               grouped: bool) -> torch.Tensor:
    ids, w = route(x, moe.gate.weight, moe.e_score_correction_bias, moe.top_k, moe.scale, num_real_tokens)
    routed = moe.routed_grouped(x, ids, w) if grouped else moe.routed_loop(x, ids, w)
    return (routed + mlp_torch(moe.shared_experts, x).float()).to(x.dtype)


def moe_torch_grouped(moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None) -> torch.Tensor:
    return _moe_torch(moe, x, num_real_tokens, grouped=True)


def moe_torch_loop(moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None) -> torch.Tensor:
    return _moe_torch(moe, x, num_real_tokens, grouped=False)


# ---- fused CUDA kernels (Triton) -------------------------------------------------------------

def norm_rope_write_triton(attn: M3Attention, qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                           slot_mapping: torch.Tensor, cache: PagedKVCache, q_out: torch.Tensor,
                           iq_out: torch.Tensor | None) -> None:
    """The fused Triton producer: one launch for norms, RoPE and every cache write."""
    index = dict(index_q_norm=attn.index_q_norm.weight, index_k_norm=attn.index_k_norm.weight,
                 index_k_cache=cache.index_k_cache[cache.sparse_index(attn.layer)],
                 iq_out=iq_out) if attn.sparse else {}
    norm_rope_cache_write(qkv, positions, slot_mapping, attn.layout, inv_freq, attn.q_norm.weight, attn.k_norm.weight,
                          cache.k_cache[attn.layer], cache.v_cache[attn.layer], q_out=q_out, **index)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from .kernels.norm import gemma_rmsnorm

    out = torch.empty_like(x)
    gemma_rmsnorm(x, weight, eps, out)
    return out


def add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .kernels.norm import gemma_fused_add_rmsnorm

    gemma_fused_add_rmsnorm(x, residual, weight, eps)  # in place: x <- norm(residual + x), residual <- sum
    return x, residual


def mlp_triton(mlp: DenseMLP, x: torch.Tensor) -> torch.Tensor:
    from .kernels.activation import swiglu_oai_triton

    return mlp.down_proj(swiglu_oai_triton(mlp.gate_up_proj(x), mlp.alpha, mlp.limit))


class FusedMoE:
    """Triton router (two kernels) + fused MoE (four kernels, shared expert included), with a
    validated configuration per token count."""

    def __init__(self, tuner: KernelTuner) -> None:
        self.tuner = tuner
        self._configs: dict[int, object] = {}  # token count -> the validated MoEConfig

    def route(self, moe: BlockSparseMoE, x: torch.Tensor,
              num_real_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        from .kernels.router import route_triton

        T, K = x.shape[0], moe.top_k
        ids = torch.empty(T, K, dtype=torch.int32, device=x.device)
        w = torch.empty(T, K, dtype=torch.float32, device=x.device)
        route_triton(x, moe.gate.weight, moe.e_score_correction_bias, K, moe.scale, num_real_tokens,
                     moe.expert_offset, moe.experts.num_experts, ids, w)
        return ids, w

    def experts(self, moe: BlockSparseMoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                config: object | None = None) -> torch.Tensor:
        from .kernels.moe import fused_moe

        out = torch.empty_like(x)
        sh = moe.shared_experts
        return fused_moe(x, ids, w, moe.experts.w13, moe.experts.w2, sh.gate_up_proj.weight, sh.down_proj.weight,
                         moe.alpha, moe.limit, out, config=config or self._config(x.shape[0]))

    def __call__(self, moe: BlockSparseMoE, x: torch.Tensor, num_real_tokens: torch.Tensor | None) -> torch.Tensor:
        ids, w = self.route(moe, x, num_real_tokens)
        return self.experts(moe, x, ids, w)

    def _config(self, num_tokens: int) -> object:
        from .kernels.moe import default_moe_config

        # A shape prepare() never saw (direct calls in tests) runs the default configuration.
        return self._configs.get(num_tokens) or default_moe_config(num_tokens)

    def prepare(self, model: torch.nn.Module, num_tokens: int, extra: dict | None = None,
                tune: bool = True) -> None:
        """Choose the MoE configuration for ``num_tokens`` rows: every candidate runs on a probe
        (random hidden states routed by the first MoE layer's own router and weights) and is
        compared with the torch reference; ``extra`` adds candidates (tests inject bad ones).
        ``tune=False`` validates the default configuration alone (no timing): for row counts no
        graph has, which a serving loop meets by the hundred and must not autotune mid-run."""
        from .kernels.moe import fused_moe_torch, moe_config_candidates

        if num_tokens in self._configs:
            return
        probe = self._probe(model, num_tokens)
        if probe is None:
            return
        moe, x = probe
        dev, dtype = x.device, x.dtype
        ids, w = self.route(moe, x, None)
        sh = moe.shared_experts
        configs = moe_config_candidates(num_tokens)
        if dev.type != "cuda" or not tune:
            configs = configs[:1]  # the default only (and the interpreter is slow)
        by_name = {f"config{i}": c for i, c in enumerate(configs)}
        candidates = {name: (lambda c=c: self.experts(moe, x, ids, w, c)) for name, c in by_name.items()}
        candidates.update(extra or {})

        def reference() -> torch.Tensor:
            out = torch.empty_like(x)
            return fused_moe_torch(x, ids, w, moe.experts.w13, moe.experts.w2, sh.gate_up_proj.weight,
                                   sh.down_proj.weight, moe.alpha, moe.limit, out)

        e, two_i, h = moe.experts.w13.shape
        signature = f"E{e} 2I{two_i} H{h} k{moe.top_k} shared{sh.gate_up_proj.weight.shape[0]} {dtype}"
        name = self.tuner.choose("moe", num_tokens, candidates, reference,
                                 tol=2e-2 if dtype == torch.bfloat16 else 1e-4, signature=signature)
        self._configs[num_tokens] = by_name[name]

    def compile_kernels(self, model: torch.nn.Module, num_tokens: int) -> None:
        """Launch the router and every candidate configuration for ``num_tokens`` rows once on
        a probe, for ``graphcap.compile_ahead`` (inside it the launches compile only, many at
        once, so the ``prepare`` that follows finds every kernel built)."""
        from .kernels.moe import moe_config_candidates

        probe = self._probe(model, num_tokens) if num_tokens not in self._configs else None
        if probe is None:
            return
        moe, x = probe
        ids, w = self.route(moe, x, None)
        for config in moe_config_candidates(num_tokens):
            self.experts(moe, x, ids, w, config)

    @staticmethod
    def _probe(model: torch.nn.Module, num_tokens: int) -> tuple[BlockSparseMoE, torch.Tensor] | None:
        """The first MoE layer and random hidden states ``[num_tokens, H]`` (seeded by the row
        count), or ``None`` for a model without MoE layers."""
        moe = next((m for m in model.modules() if isinstance(m, BlockSparseMoE)), None)
        if moe is None:
            return None
        dev, dtype = moe.experts.w13.device, moe.experts.w13.dtype
        gen = torch.Generator(device=dev).manual_seed(num_tokens)
        return moe, torch.randn(num_tokens, moe.experts.w13.shape[2], generator=gen, device=dev).to(dtype)


# ---- the table ---------------------------------------------------------------------------

@dataclass(frozen=True)
class M3Ops:
    """One model's producer implementations (see the module docstring for the signatures)."""

    name: str
    norm_rope_write: Callable[..., None]
    rmsnorm: Callable[..., torch.Tensor]
    add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    mlp: Callable[..., torch.Tensor]
    moe: Callable[..., torch.Tensor]
    tuner: KernelTuner | None = None

    def prepare(self, model: torch.nn.Module, num_tokens: int, tune: bool = True) -> None:
        """Host work before a forward of ``num_tokens`` rows (outside any capture); ``tune``:
        time the candidate kernels (else the default is validated alone)."""
        if isinstance(self.moe, FusedMoE):
            self.moe.prepare(model, num_tokens, tune=tune)

    def compile_kernels(self, model: torch.nn.Module, num_tokens: int) -> None:
        """Launch the tunable kernels' candidates for ``num_tokens`` rows on probes, for
        ``graphcap.compile_ahead`` (see ``FusedMoE.compile_kernels``)."""
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

    from graphcap import jit_cache

    jit_cache.configure()
    namespace = f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|triton {triton.__version__}"
    return ChoiceStore(jit_cache.kernel_choices_file(), namespace)


def make_ops(producer: str, device: torch.device | str | None, dtype: torch.dtype, moe_impl: str = "auto") -> M3Ops:
    """The op table for ``producer``: ``triton`` (fused kernels; ``auto`` on CUDA) or ``torch``
    (``auto`` elsewhere). ``moe_impl`` picks the torch MoE: ``grouped`` (``torch._grouped_mm``
    where supported, the ``auto`` choice) or ``loop`` (see ``layers.BlockSparseMoE``).

    Raises:
        ValueError: unknown ``producer`` or ``moe_impl``.
    """
    if producer not in PRODUCERS:
        raise ValueError(f"producer={producer!r}: choose one of {PRODUCERS}")
    if moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl={moe_impl!r}: choose one of {MOE_IMPLS}")
    dev = torch.device(device or "cpu")
    if producer == "auto":
        producer = "triton" if dev.type == "cuda" else "torch"
    if producer == "triton":
        tuner = KernelTuner(time_candidates=dev.type == "cuda", store=choice_store(dev))
        return M3Ops("triton", norm_rope_write_triton, rmsnorm_triton, add_rmsnorm_triton, mlp_triton,
                     FusedMoE(tuner), tuner)
    if moe_impl == "auto":
        moe_impl = "grouped" if grouped_mm_supported(dev, dtype) else "loop"
    moe = moe_torch_grouped if moe_impl == "grouped" else moe_torch_loop
    return M3Ops(f"torch+{moe_impl}", norm_rope_write_torch, rmsnorm_torch, add_rmsnorm_torch, mlp_torch, moe)
