"""MiniMax-M3 building blocks: their parameters and their reference maths (plain torch).

GemmaRMSNorm, SwiGLU-OAI, the dense MLP, sigmoid routing and the block-sparse MoE. Each
formula is written once here; the op table (``models.minimax_m3.ops``) runs these as its
torch path and the fused kernels' torch twins (``kernels/``) reuse them, so nothing here
imports the op table or the kernels. RoPE is fused with the per-head norms and the cache
writes (``kernels/producer.py``).

Everything here is request-independent and capturable: fixed shapes for a given token
count, no host syncs, no boolean-mask indexing, no data-dependent output shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mxfp8 import BLOCK, FP8, MXFP8Config, dequantize_mxfp8, make_linear, scale_parameter


def gemma_rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim, in fp32 (the one Gemma
    RMSNorm formula). x: ``[..., dim]`` (any float dtype); weight: ``[dim]``, the checkpoint's
    offset (near zero), not ``1 + w``. Returns fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm cast back to ``x.dtype`` (the torch op table's ``rmsnorm``)."""
    return gemma_rms_normalize(x, weight, eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim, in fp32, cast back.

    The stored weight is the checkpoint's offset (near zero), not ``1 + w``.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., dim]`` -> same shape and dtype."""
        return gemma_rmsnorm(x, self.weight, self.eps)


def swiglu_oai_f32(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1)`` in fp32
    (the one SwiGLU-OAI formula). Shapes ``[..., I]`` -> fp32 ``[..., I]``."""
    g = gate.float().clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (up.float().clamp(-limit, limit) + 1.0)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """SwiGLU-OAI cast back to ``gate.dtype``."""
    return swiglu_oai_f32(gate, up, alpha, limit).to(gate.dtype)


class DenseMLP(nn.Module):
    """SwiGLU-OAI MLP with fused ``gate_up_proj [2I, H]`` (gate rows first) and ``down_proj``.

    Used for the dense layers' ``mlp`` and for ``block_sparse_moe.shared_experts``; ``forward``
    is the one dense-MLP path of the torch op table. With ``quantization`` both projections are
    ``mxfp8.MXFP8Linear`` (fp8 weights, dequantised in their forward).
    """

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float, dtype: torch.dtype,
                 device: torch.device | str | None = None, quantization: MXFP8Config | None = None) -> None:
        super().__init__()
        self.inter, self.alpha, self.limit = inter, alpha, limit
        self.gate_up_proj = make_linear(hidden, 2 * inter, quantization, dtype, device)
        self.down_proj = make_linear(inter, hidden, quantization, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[T, H]`` -> ``[T, H]``."""
        gu = self.gate_up_proj(x)
        return self.down_proj(swiglu_oai(gu[:, : self.inter], gu[:, self.inter :], self.alpha, self.limit))


def router_scores(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """``sigmoid(fp32(x) W^T)``: x ``[T, H]``, gate_weight fp32 ``[E, H]`` -> fp32 ``[T, E]``."""
    return torch.sigmoid(F.linear(x.float(), gate_weight.float()))


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    scale: float,
    num_real_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing with a selection-only correction bias.

    ``s = sigmoid(fp32(x) W^T)``; ``ids = topk(s + bias)``; ``w = s[ids] / sum * scale``.
    Rows ``>= num_real_tokens`` (padding) get id ``-1`` and weight 0.

    Args:
        x: ``[T, H]``; gate_weight: fp32 ``[E, H]``; bias: fp32 ``[E]``.
        num_real_tokens: device int scalar, or None (all rows real).
    Returns:
        ids int64 ``[T, top_k]`` (global expert ids), weights fp32 ``[T, top_k]``.
    """
    scores = router_scores(x, gate_weight)
    ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * scale
    if num_real_tokens is not None:
        real = (torch.arange(x.shape[0], device=x.device) < num_real_tokens)[:, None]
        ids = torch.where(real, ids, -1)
        w = torch.where(real, w, 0.0)
    return ids, w


class StackedExperts(nn.Module):
    """Routed experts held by this rank: ``w13 [E, 2I, H]`` (gate rows, then up), ``w2 [E, H, I]``.

    With ``quantization`` (MXFP8) both are fp8 e4m3, with uint8 E8M0 scales beside them:
    ``w13_scale_inv [E, 2I, H/32]`` and ``w2_scale_inv [E, H, I/32]``.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 device: torch.device | str | None = None, quantization: MXFP8Config | None = None) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.dtype = dtype  # the compute dtype (activations), also of fp8 experts
        self.quantized = quantization is not None
        wdt = FP8 if self.quantized else dtype
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=wdt, device=device))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=wdt, device=device))
        if self.quantized:
            self.w13_scale_inv = scale_parameter((num_experts, 2 * inter, hidden // BLOCK), device)
            self.w2_scale_inv = scale_parameter((num_experts, hidden, inter // BLOCK), device)

    def compute_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` for the torch MoE: the parameters themselves, or
        for MXFP8 experts both dequantised to ``dtype`` (fresh tensors every call, all ``E``
        experts: the torch path's cost; the fused MoE reads fp8 experts itself)."""
        if not self.quantized:
            return self.w13, self.w2
        return (dequantize_mxfp8(self.w13, self.w13_scale_inv, dtype),
                dequantize_mxfp8(self.w2, self.w2_scale_inv, dtype))


class BlockSparseMoE(nn.Module):
    """Router + routed experts + one (TP-sliced) shared expert, added unscaled.

    ``forward`` is the reference (the torch op table's MoE), in two capturable formulations of
    the routed part, both fixed-shape for a token count:

    - ``grouped`` (where ``torch._grouped_mm`` supports the device/dtype): sort the
      ``T * top_k`` (token, expert) pairs by local expert id (pairs for remote experts or
      padded rows get a sentinel id past the last expert and sort last), gather their rows,
      run two grouped GEMMs whose group ends come from ``searchsorted`` on the device, and
      ``index_add_`` the weighted rows back. Work and weight reads scale with the pairs
      actually routed here, as in a real fused-MoE kernel: at one decode token only 4
      experts' weights are read, not 128. Rows past the last group are never computed; they
      are masked with ``where`` (not multiplied by 0, since they hold uninitialised memory).
    - ``loop``: every local expert runs on all T rows and is combined with a dense
      ``[T, E]`` weight matrix (0 where not routed). Reads every expert's weights and does
      ``E / top_k`` times the work, so it is only the fallback (fp32 on CUDA) and a
      cross-check in tests.
    """

    def __init__(self, hidden: int, num_experts: int, num_local: int, top_k: int, inter: int, shared_inter: int,
                 scale: float, alpha: float, limit: float, dtype: torch.dtype,
                 device: torch.device | str | None = None, expert_offset: int = 0,
                 quantization: MXFP8Config | None = None) -> None:
        super().__init__()
        self.top_k, self.scale, self.alpha, self.limit = top_k, scale, alpha, limit
        self.expert_offset = expert_offset
        # Router weight and bias are fp32 in the checkpoint and stay fp32: bf16 scores would
        # flip near-tied selections.
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=torch.float32, device=device)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device))
        self.experts = StackedExperts(num_local, hidden, inter, dtype, device, quantization)
        self.shared_experts = DenseMLP(hidden, shared_inter, alpha, limit, dtype, device, quantization)

    def forward(self, x: torch.Tensor, num_real_tokens: torch.Tensor | None, grouped: bool = True) -> torch.Tensor:
        """x: ``[T, H]`` -> ``[T, H]``; padded rows (``>= num_real_tokens``) skip routed experts."""
        ids, w = route(x, self.gate.weight, self.e_score_correction_bias, self.top_k, self.scale, num_real_tokens)
        return self.routed_and_shared(x, ids, w, grouped)

    def routed_and_shared(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, grouped: bool) -> torch.Tensor:
        """The experts for given routing (ids ``[T, k]``, -1 on padded rows; weights fp32
        ``[T, k]``): this rank's routed experts plus the shared expert, ``[T, H]`` in x's dtype."""
        routed = self.routed_grouped(x, ids, w) if grouped else self.routed_loop(x, ids, w)
        return (routed + self.shared_experts(x).float()).to(x.dtype)

    def routed_grouped(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Sorted pairs + grouped GEMMs. Returns fp32 ``[T, H]``."""
        w13, w2 = self.experts.compute_weights(x.dtype)
        return routed_grouped(x, ids, w, w13, w2, self.alpha, self.limit, self.expert_offset)

    def routed_loop(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every local expert on every row, weighted by a dense combine matrix. fp32 ``[T, H]``."""
        ex = self.experts
        n = ex.num_experts
        w13, w2 = ex.compute_weights(x.dtype)
        comb = torch.zeros(x.shape[0], n + 1, dtype=torch.float32, device=x.device)
        comb.scatter_add_(1, local_expert_keys(ids, self.expert_offset, n), w)  # column n: remote/padded pairs
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(n):
            h = F.linear(x, w13[e])
            y = F.linear(swiglu_oai(h[:, : ex.inter], h[:, ex.inter :], self.alpha, self.limit), w2[e])
            out += comb[:, e : e + 1] * y.float()
        return out


def local_expert_keys(ids: torch.Tensor, expert_offset: int, num_local: int) -> torch.Tensor:
    """Global ids ``[T, k]`` -> local expert ids, or ``num_local`` for remote/padded pairs."""
    local = ids - expert_offset
    return torch.where((ids >= 0) & (local >= 0) & (local < num_local), local, num_local)


def routed_grouped(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   alpha: float, limit: float, expert_offset: int = 0) -> torch.Tensor:
    """This rank's routed experts by sorted pairs and two grouped GEMMs (a function of tensors,
    so ``torch.compile`` traces it once per shape for every layer). fp32 ``[T, H]``.

    x: ``[T, H]``; ids: global ``[T, k]`` (-1 padding); w: fp32 ``[T, k]``; w13 ``[E, 2I, H]``
    (gate rows, then up); w2 ``[E, H, I]``.
    """
    n, inter, k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    keys = local_expert_keys(ids, expert_offset, n).flatten()  # [P]
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys.index_select(0, order)
    token = torch.div(order, k, rounding_mode="floor")
    ends = torch.searchsorted(sorted_keys, torch.arange(n, device=x.device), right=True).to(torch.int32)
    xs = x.index_select(0, token)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
    a = swiglu_oai(h[:, :inter], h[:, inter:], alpha, limit)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=ends)
    ws = w.flatten().index_select(0, order)
    y = torch.where((sorted_keys < n)[:, None], y.float() * ws[:, None], 0.0)
    return torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, token, y)
