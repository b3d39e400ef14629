"""MiniMax-M3 text model; module names follow the checkpoint keys (minus ``language_model.``).

Fused parameters (the loader fills them from the separate checkpoint tensors):
- ``self_attn.qkv_proj`` rows ``[q | k | v]`` on dense-attention layers and
  ``[q | k | v | index_q | index_k]`` on sparse layers;
- ``mlp.gate_up_proj`` and ``shared_experts.gate_up_proj``: gate rows, then up rows;
- ``block_sparse_moe.experts.w13 [E, 2I, H]`` (w1 = gate, then w3 = up) and ``w2 [E, H, I]``.

The forward reads only its inputs, its weights, the KV cache (``cache.write``) and the
attention splice points (``backend.dense`` / ``backend.sparse``); it never looks at capture
state or step metadata, so graphcap can record everything between two splices.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import torch
from torch import nn

from attention.base import AttentionBackend
from kvcache.paged import PagedKVCache
from attention.rope import rope_inv_freq

from .config import MiniMaxM3Config
from .layers import BlockSparseMoE, DenseMLP, GemmaRMSNorm, apply_rope, rope_cos_sin


def resolve_producer(producer: str, device: torch.device | str | None) -> str:
    """``auto`` -> the fused Triton producer on CUDA (one kernel for the per-head norms, RoPE
    and the K/V + index-K cache writes; measured far faster than the ~20 unfused torch ops,
    see BENCHMARKS.md), plain torch elsewhere."""
    if producer not in ("auto", "torch", "triton"):
        raise ValueError(f"producer={producer!r}: choose auto, torch or triton")
    if producer == "auto":
        return "triton" if torch.device(device or "cpu").type == "cuda" else "torch"
    return producer


class M3Attention(nn.Module):
    """Dense GQA (``sparse=False``) or MSA with its index branch (``sparse=True``).

    ``producer`` picks how q/k/v/iq/ik go from the fused projection to attention: ``torch``
    (norms, RoPE and ``cache.write`` as separate ops) or ``triton`` (one fused kernel).
    """

    def __init__(self, c: MiniMaxM3Config, layer: int, dtype: torch.dtype, device: torch.device | str | None,
                 producer: str = "torch") -> None:
        super().__init__()
        self.fused = producer == "triton"
        self.layer, self.sparse = layer, c.is_sparse(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.num_index_heads, self.index_dim = c.sparse_num_index_heads, c.sparse_index_dim
        self.split = [c.q_size, c.kv_size, c.kv_size] + ([c.index_q_size, c.sparse_index_dim] if self.sparse else [])
        self.qkv_proj = nn.Linear(c.hidden_size, c.qkv_size(layer), bias=False, dtype=dtype, device=device)
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        if self.sparse:
            self.index_q_norm = GemmaRMSNorm(c.sparse_index_dim, c.rms_norm_eps, dtype, device)
            self.index_k_norm = GemmaRMSNorm(c.sparse_index_dim, c.rms_norm_eps, dtype, device)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=False, dtype=dtype, device=device)
        if self.fused:
            from models.minimax_m3.kernels.producer import QKVLayout

            self.layout = QKVLayout(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                    c.sparse_num_index_heads if self.sparse else 0,
                                    c.sparse_index_dim if self.sparse else 0, c.rotary_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: "RopeInputs", slot_mapping: torch.Tensor,
                cache: PagedKVCache, backend: AttentionBackend) -> torch.Tensor:
        """x: normed hidden ``[T, H]``; rope: this step's positions and cos/sin; slot_mapping
        int64 ``[T]`` (-1 = padding). Returns the o_proj output ``[T, H]``."""
        if self.fused:
            return self._forward_fused(x, rope, slot_mapping, cache, backend)
        t = x.shape[0]
        cos, sin = rope.cos, rope.sin
        parts = self.qkv_proj(x).split(self.split, dim=-1)
        q = apply_rope(self.q_norm(parts[0].view(t, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(parts[1].view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = parts[2].view(t, self.num_kv_heads, self.head_dim)
        # Rows the attention op leaves untouched (padding) must not carry garbage into o_proj.
        out = torch.zeros(t, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        if self.sparse:
            iq = apply_rope(self.index_q_norm(parts[3].view(t, self.num_index_heads, self.index_dim)), cos, sin)
            ik = apply_rope(self.index_k_norm(parts[4].view(t, 1, self.index_dim)), cos, sin)
            cache.write(self.layer, slot_mapping, k, v, ik.view(t, self.index_dim))
            backend.sparse(self.layer, q, iq, out)
        else:
            cache.write(self.layer, slot_mapping, k, v)
            backend.dense(self.layer, q, out)
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))

    def _forward_fused(self, x: torch.Tensor, rope: "RopeInputs", slot_mapping: torch.Tensor,
                       cache: PagedKVCache, backend: AttentionBackend) -> torch.Tensor:
        from models.minimax_m3.kernels.producer import norm_rope_cache_write

        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q = torch.empty(t, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        iq = torch.empty(t, self.num_index_heads, self.index_dim, dtype=x.dtype, device=x.device) if self.sparse else None
        index = dict(index_q_norm=self.index_q_norm.weight, index_k_norm=self.index_k_norm.weight,
                     index_k_cache=cache.index_k_cache[cache.sparse_index(self.layer)], iq_out=iq) if self.sparse else {}
        norm_rope_cache_write(qkv, rope.positions, slot_mapping, self.layout, rope.inv_freq, self.q_norm.weight,
                              self.k_norm.weight, cache.k_cache[self.layer], cache.v_cache[self.layer], q_out=q, **index)
        out = torch.zeros_like(q)
        if self.sparse:
            backend.sparse(self.layer, q, iq, out)
        else:
            backend.dense(self.layer, q, out)
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))


class RopeInputs(NamedTuple):
    """One step's rotary inputs, shared by every layer: positions ``int64 [T]``, the fp32
    ``inv_freq [rotary_dim/2]`` table and ``cos``/``sin`` fp32 ``[T, rotary_dim/2]`` (``None``
    with the fused producer, which rotates in-kernel)."""

    positions: torch.Tensor
    inv_freq: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class M3DecoderLayer(nn.Module):
    def __init__(self, c: MiniMaxM3Config, layer: int, dtype: torch.dtype, device: torch.device | str | None,
                 moe_impl: str = "auto", producer: str = "torch") -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = M3Attention(c, layer, dtype, device, producer)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.is_moe = c.is_moe(layer)
        if self.is_moe:
            self.block_sparse_moe = BlockSparseMoE(
                c.hidden_size, c.num_local_experts, c.num_experts_per_rank, c.num_experts_per_tok,
                c.intermediate_size, c.shared_width, c.routed_scaling_factor, c.swiglu_alpha, c.swiglu_limit,
                dtype, device, impl=moe_impl,
            )
        else:
            self.mlp = DenseMLP(c.hidden_size, c.dense_intermediate_size, c.swiglu_alpha, c.swiglu_limit, dtype, device)

    def forward(self, x: torch.Tensor, rope: RopeInputs, slot_mapping: torch.Tensor,
                cache: PagedKVCache, backend: AttentionBackend, num_real_tokens: torch.Tensor | None) -> torch.Tensor:
        """x: residual stream ``[T, H]`` -> ``[T, H]``."""
        x = x + self.self_attn(self.input_layernorm(x), rope, slot_mapping, cache, backend)
        b = self.post_attention_layernorm(x)
        return x + (self.block_sparse_moe(b, num_real_tokens) if self.is_moe else self.mlp(b))


class M3Model(nn.Module):
    def __init__(self, c: MiniMaxM3Config, dtype: torch.dtype, device: torch.device | str | None,
                 moe_impl: str = "auto", producer: str = "torch") -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            M3DecoderLayer(c, i, dtype, device, moe_impl, producer) for i in range(c.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)


class MiniMaxM3ForCausalLM(nn.Module):
    """The text backbone plus lm_head.

    Args:
        config: model shapes (a whole model, or one rank of a shard: see ``MiniMaxM3Config``).
        cache, backend: the paged KV cache and the attention backend; may be attached later
            with ``attach``.
        dtype: parameter dtype (default ``config.torch_dtype``); router gate and bias are fp32.
        device: where parameters live. Parameters are uninitialised: load a checkpoint
            (``weights.load_checkpoint``) or call ``init_random_``.
        moe_impl: ``auto``, ``grouped`` or ``loop`` (see ``layers.BlockSparseMoE``).
        producer: ``auto``, ``torch`` or ``triton`` (see ``resolve_producer``).
    """

    def __init__(self, config: MiniMaxM3Config, cache: PagedKVCache | None = None,
                 backend: AttentionBackend | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, moe_impl: str = "auto", producer: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype or config.torch_dtype
        self.producer = resolve_producer(producer, device)
        self.model = M3Model(config, self.dtype, device, moe_impl, self.producer)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=self.dtype, device=device)
        self.requires_grad_(False)  # inference only: no autograd graph through the forward
        self.register_buffer("rope_inv_freq", rope_inv_freq(config.rope_theta, config.rotary_dim, device),
                             persistent=False)
        self.cache: PagedKVCache | None = None
        self.backend: AttentionBackend | None = None
        if cache is not None or backend is not None:
            self.attach(cache, backend)

    def attach(self, cache: PagedKVCache | None, backend: AttentionBackend | None) -> None:
        """Use ``cache`` and ``backend``; their shapes must match the config (checked here,
        once, so the forward needs no checks)."""
        if cache is None or backend is None:
            raise ValueError("attach needs both the cache and the attention backend")
        c, kc = self.config, cache.config
        want = dict(num_layers=c.num_hidden_layers, sparse_layers=c.sparse_layers, num_kv_heads=c.num_key_value_heads,
                    head_dim=c.head_dim, index_dim=c.sparse_index_dim, page_size=c.sparse_block_size)
        for name, val in want.items():
            if getattr(kc, name) != val:
                raise ValueError(f"cache {name}={getattr(kc, name)!r} does not match the model ({val!r}); "
                                 f"build the cache with MiniMaxM3Config.kv_cache_config")
        if backend.cache is not cache:
            raise ValueError("the backend reads a different cache than the one attached")
        if backend.num_qo_heads != c.num_attention_heads or backend.topk != c.sparse_topk_blocks:
            raise ValueError(
                f"backend num_qo_heads={backend.num_qo_heads}, topk={backend.topk} must be "
                f"{c.num_attention_heads}, {c.sparse_topk_blocks}"
            )
        if not math.isclose(backend.scale, c.head_dim**-0.5):
            raise ValueError(f"backend scale={backend.scale} must be head_dim**-0.5")
        self.cache, self.backend = cache, backend

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      num_real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states.

        Args:
            input_ids: int ``[T]`` (padding: 0).
            positions: int64 ``[T]`` (padding: 0).
            slot_mapping: int64 ``[T]`` flat cache slots (padding: -1, writes nothing).
            num_real_tokens: device int scalar; rows ``>=`` it are padding and are kept out
                of the routed experts. ``None``: every row is real.
        Returns:
            ``[T, hidden_size]`` in the model dtype.
        """
        cache, backend = self.cache, self.backend
        if cache is None or backend is None:
            raise RuntimeError("attach(cache, backend) before running the forward")
        # The fused producer rotates in-kernel from positions; only the torch path needs cos/sin.
        cos_sin = rope_cos_sin(positions, self.rope_inv_freq) if self.producer == "torch" else (None, None)
        rope = RopeInputs(positions, self.rope_inv_freq, *cos_sin)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, rope, slot_mapping, cache, backend, num_real_tokens)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> ``[N, vocab_size]`` (lm_head, untied)."""
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                num_real_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[T, vocab_size]`` for every row (see ``hidden_states`` for the arguments)."""
        return self.compute_logits(self.hidden_states(input_ids, positions, slot_mapping, num_real_tokens))

    def forward_inputs(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``hidden_states`` from a graphcap-style input dict: ``input_ids``, ``positions``,
        ``slot_mapping`` ``[T]`` and optionally ``num_real_tokens`` (0-d or ``[1]``)."""
        n = inputs.get("num_real_tokens")
        return self.hidden_states(inputs["input_ids"], inputs["positions"], inputs["slot_mapping"],
                                  None if n is None else n.reshape(()))

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> None:
        """Fill every parameter with deterministic random values of a sensible scale:
        linear and expert weights ``N(0, 1/fan_in)``, embeddings ``N(0, 1)``, norm offsets
        and the routing bias ``N(0, 0.1^2)``."""
        for name, p in self.named_parameters():
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + _stable_hash(name))
            if p.dim() == 1:
                std = 0.1
            elif "embed_tokens" in name:
                std = 1.0
            else:
                std = p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(std).to(p.dtype))


def _stable_hash(s: str) -> int:
    """Process-independent hash (Python's ``hash`` of str is salted per process)."""
    h = 0
    for ch in s.encode():
        h = (h * 131 + ch) % 1_000_000_007
    return h
