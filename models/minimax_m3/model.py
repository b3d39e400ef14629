"""MiniMax-M3 text model; module names follow the checkpoint keys (minus ``language_model.``).

Fused parameters (the loader fills them from the separate checkpoint tensors):
- ``self_attn.qkv_proj`` rows ``[q | k | v]`` on dense-attention layers and
  ``[q | k | v | index_q | index_k]`` on sparse layers;
- ``mlp.gate_up_proj`` and ``shared_experts.gate_up_proj``: gate rows, then up rows;
- ``block_sparse_moe.experts.w13 [E, 2I, H]`` (w1 = gate, then w3 = up) and ``w2 [E, H, I]``.

An MXFP8 model (``config.quantization``) holds every one of these projections in fp8 with E8M0
scales: ``mxfp8.MXFP8Linear`` (``weight`` + ``weight_scale_inv``) and ``w13/w2`` +
``w13_scale_inv/w2_scale_inv``; embeddings, lm_head, norms and the router stay unquantized.

The forward reads only its inputs, its weights, the KV cache (through the op table's cache
writes) and the attention splice points (``backend.dense`` / ``backend.sparse``); it never
looks at capture state or step metadata, so graphcap can record everything between splices.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import torch
from torch import nn

from attention.base import AttentionBackend
from attention.rope import rope_inv_freq
from distributed import ParallelGroup, vocab_parallel
from graphcap.splice_buffers import SpliceBuffers
from kvcache.paged import PagedKVCache

from .config import MiniMaxM3Config
from .kernels.producer import HeadNorms, QKVLayout
from .layers import BlockSparseMoE, DenseMLP, GemmaRMSNorm
from .mxfp8 import FP8, SCALE_SUFFIX, make_linear, quantize_mxfp8
from .ops import M3Ops, make_ops
from .routing import calibrate_routing_bias_


class LayerInputs(NamedTuple):
    """What every decoder layer of one forward reads besides the residual stream.

    Attributes:
        positions: int64 ``[T]`` (padding: 0).
        slot_mapping: int64 ``[T]`` flat cache slots (padding: -1, writes nothing).
        num_real_tokens: device int64 ``[1]``; rows ``>=`` it are padding and are kept out of
            the routed experts (``None``: every row is real).
        inv_freq: fp32 ``[rotary_dim // 2]`` rotary table.
        cache, backend, ops: the paged cache, the attention backend and the op table.
        buffers: the activations that cross the attention splice (``q``, ``index_q``,
            ``attn_out``), one set shared by every layer and every bucket.
        group: the ranks the model is sharded over; the row-parallel outputs (o_proj, MLP and
            MoE) are summed over it (no-ops for an unsharded model).
        padded: bool ``[T, 1]``, the padding rows zeroed before every collective (None: no
            collectives or no padding).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_real_tokens: torch.Tensor | None
    inv_freq: torch.Tensor
    cache: PagedKVCache
    backend: AttentionBackend
    ops: M3Ops
    buffers: SpliceBuffers
    group: ParallelGroup
    padded: torch.Tensor | None


class M3Attention(nn.Module):
    """Dense GQA (dense-attention layers) or MSA with its index branch (sparse layers)."""

    def __init__(self, c: MiniMaxM3Config, layer: int, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.layer, self.sparse = layer, c.is_sparse(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.num_index_heads, self.index_dim = c.sparse_num_index_heads, c.sparse_index_dim
        self.qkv_proj = make_linear(c.hidden_size, c.qkv_size(layer), c.quantization, dtype, device)
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        if self.sparse:
            self.index_q_norm = GemmaRMSNorm(c.sparse_index_dim, c.rms_norm_eps, dtype, device)
            self.index_k_norm = GemmaRMSNorm(c.sparse_index_dim, c.rms_norm_eps, dtype, device)
        self.o_proj = make_linear(c.q_size, c.hidden_size, c.quantization, dtype, device)
        self.layout = QKVLayout(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                c.sparse_num_index_heads if self.sparse else 0,
                                c.sparse_index_dim if self.sparse else 0, c.rotary_dim, c.rms_norm_eps)

    def head_norms(self) -> HeadNorms:
        """The per-head norm weights the producer reads (index ones on sparse layers)."""
        if self.sparse:
            return HeadNorms(self.q_norm.weight, self.k_norm.weight, self.index_q_norm.weight,
                             self.index_k_norm.weight)
        return HeadNorms(self.q_norm.weight, self.k_norm.weight)

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """x: normed hidden ``[T, H]`` -> the o_proj output ``[T, H]``."""
        t = x.shape[0]
        qkv = inputs.ops.linear(self.qkv_proj, x)
        # q, index-q and the attention output cross the splice: shared buffers, not per-layer
        # allocations a captured splice would keep alive (see graphcap.splice_buffers).
        q = inputs.buffers.view("q", t)
        iq = inputs.buffers.view("index_q", t) if self.sparse else None
        inputs.ops.norm_rope_write(qkv, inputs.positions, inputs.inv_freq, inputs.slot_mapping, self.layout,
                                   self.head_norms(), inputs.cache, self.layer, q, iq)
        # Rows the attention op leaves untouched (padding) must not carry garbage into o_proj.
        # (Cleared by the producer's programs instead of this fill: no faster, BENCHMARKS.md,
        # MXFP8 thirteenth round.)
        out = inputs.buffers.view("attn_out", t).zero_()
        if self.sparse:
            inputs.backend.sparse(self.layer, q, iq, out)
        else:
            inputs.backend.dense(self.layer, q, out)
        return inputs.ops.linear(self.o_proj, out.view(t, self.num_heads * self.head_dim))


class M3DecoderLayer(nn.Module):
    def __init__(self, c: MiniMaxM3Config, layer: int, dtype: torch.dtype, device: torch.device | str | None,
                 expert_offset: int = 0) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = M3Attention(c, layer, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.is_moe = c.is_moe(layer)
        if self.is_moe:
            self.block_sparse_moe = BlockSparseMoE(
                c.hidden_size, c.num_local_experts, c.num_experts_per_rank, c.num_experts_per_tok,
                c.intermediate_size, c.shared_width, c.routed_scaling_factor, c.swiglu_alpha, c.swiglu_limit,
                dtype, device, expert_offset, c.quantization,
            )
        else:
            self.mlp = DenseMLP(c.hidden_size, c.dense_intermediate_size, c.swiglu_alpha, c.swiglu_limit, dtype, device,
                                c.quantization)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                inputs: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream in fused-norm form: ``x`` is the previous layer's output (the
        embedding for layer 0, with ``residual=None``), added to ``residual`` by the fused
        add + norm that starts this layer. Returns this layer's MLP/MoE output and the residual
        stream ``[T, H]`` (the op table may update both in place). Under tensor parallelism
        the attention and MLP/MoE outputs are this rank's partial sums until the all-reduce."""
        ops, eps, n, pad = inputs.ops, self.input_layernorm.eps, inputs.num_real_tokens, inputs.padded
        if residual is None:
            residual, h = x, ops.rmsnorm(x, self.input_layernorm.weight, eps)
        else:
            h, residual = ops.add_rmsnorm(x, residual, self.input_layernorm.weight, eps)
        a = inputs.group.all_reduce_(self.self_attn(h, inputs), pad)
        b, residual = ops.add_rmsnorm(a, residual, self.post_attention_layernorm.weight, eps)
        out = ops.moe(self.block_sparse_moe, b, n) if self.is_moe else ops.mlp(self.mlp, b)
        return inputs.group.all_reduce_(out, pad), residual


class M3Model(nn.Module):
    def __init__(self, c: MiniMaxM3Config, dtype: torch.dtype, device: torch.device | str | None,
                 expert_offset: int = 0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(M3DecoderLayer(c, i, dtype, device, expert_offset)
                                    for i in range(c.num_hidden_layers))
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)


class MiniMaxM3ForCausalLM(nn.Module):
    """The text backbone plus lm_head. Entry points: ``hidden_states(inputs)`` (what graphcap
    captures) and ``compute_logits(hidden)``.

    Args:
        config: model shapes (a whole model, or one rank of a shard: see ``MiniMaxM3Config``).
        cache, backend: the paged KV cache and the attention backend; may be attached later
            with ``attach``.
        dtype: parameter dtype (default ``config.torch_dtype``); router gate and bias are fp32.
        device: where parameters live. Parameters are uninitialised: load a checkpoint
            (``weights.load_checkpoint``) or call ``init_random_``.
        producer: ``auto``, ``torch`` or ``triton``; moe_impl: ``auto``, ``grouped`` or ``loop``
            (the op table, ``models.minimax_m3.ops.make_ops``, chosen once here).
        group: the ranks of a sharded model (``config`` is then ``full.shard(W, W)`` for world
            size W, and this process is rank ``group.rank``): vocab-parallel embedding and
            logits, all-reduces after o_proj and the MLP/MoE, experts
            ``[rank * E/W, (rank+1) * E/W)``. Default: one process, no collectives (a sharded
            config then models one rank with the collectives left out, as ``rank_of_8``).
        routing: ``model`` (the router's choices), or for measurements ``uniform`` / ``balanced``
            (``routing.RoutingSimulation``: the router's ids replaced on the device).

    Raises:
        ValueError: a distributed ``group`` whose world size differs from the config's
            ``tp_size`` or ``ep_size``.
    """

    def __init__(self, config: MiniMaxM3Config, cache: PagedKVCache | None = None,
                 backend: AttentionBackend | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, moe_impl: str = "auto", producer: str = "auto",
                 group: ParallelGroup | None = None, routing: str = "model") -> None:
        super().__init__()
        group = group or ParallelGroup.single(device or "cpu")
        if group.distributed and not config.tp_size == config.ep_size == group.world_size:
            raise ValueError(
                f"the process group has {group.world_size} ranks but the config is sharded tp_size={config.tp_size}, "
                f"ep_size={config.ep_size}; build it with full_config.shard({group.world_size}, {group.world_size})"
            )
        self.config, self.group = config, group
        self.dtype = dtype or config.torch_dtype
        # MXFP8 weights: the fused MoE reads fp8 experts and their scales itself; the projections
        # are MXFP8Linear modules (dequantised per call: fp8 GEMM kernels are still to come).
        self.ops = make_ops(producer, device, self.dtype, moe_impl, routing)
        offset = group.rank * config.num_experts_per_rank if group.distributed else 0
        self.model = M3Model(config, self.dtype, device, offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=self.dtype, device=device)
        self.requires_grad_(False)  # inference only: no autograd graph through the forward
        self.register_buffer("rope_inv_freq", rope_inv_freq(config.rope_theta, config.rotary_dim, device),
                             persistent=False)
        self.cache: PagedKVCache | None = None
        self.backend: AttentionBackend | None = None
        self.splice_buffers: SpliceBuffers | None = None
        if cache is not None or backend is not None:
            self.attach(cache, backend)

    def attach(self, cache: PagedKVCache | None, backend: AttentionBackend | None) -> None:
        """Use ``cache`` and ``backend``; their shapes must match the config (checked here,
        once, so the forward needs no checks). Allocates the splice buffers for the backend's
        step capacity (``backend.dims.max_tokens`` rows)."""
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
        d = backend.dims
        if d.num_qo_heads != c.num_attention_heads or d.topk != c.sparse_topk_blocks:
            raise ValueError(
                f"backend num_qo_heads={d.num_qo_heads}, topk={d.topk} must be "
                f"{c.num_attention_heads}, {c.sparse_topk_blocks}"
            )
        if not math.isclose(d.scale, c.head_dim**-0.5):
            raise ValueError(f"backend scale={d.scale} must be head_dim**-0.5")
        self.cache, self.backend = cache, backend
        dev = cache.block_tables.device
        buf = self.splice_buffers
        if buf is None or buf.max_rows != d.max_tokens or buf.device != dev:
            buf = SpliceBuffers(d.max_tokens, dev)
            buf.add("q", (c.num_attention_heads, c.head_dim), self.dtype)
            buf.add("attn_out", (c.num_attention_heads, c.head_dim), self.dtype)
            if c.sparse_layers:
                buf.add("index_q", (c.sparse_num_index_heads, c.sparse_index_dim), self.dtype)
            self.splice_buffers = buf

    def hidden_states(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden_size]`` (model dtype).

        Args:
            inputs: ``input_ids`` int ``[T]`` (padding: 0), ``positions`` int64 ``[T]``
                (padding: 0), ``slot_mapping`` int64 ``[T]`` (padding: -1) and optionally
                ``num_real_tokens`` (device int64 ``[1]``; rows past it are padding).
        """
        cache, backend, buffers = self.cache, self.backend, self.splice_buffers
        if cache is None or backend is None or buffers is None:
            raise RuntimeError("attach(cache, backend) before running the forward")
        ids, n = inputs["input_ids"], inputs.get("num_real_tokens")
        pad = self.group.padded_rows(ids.shape[0], n, ids.device)
        shared = LayerInputs(inputs["positions"], inputs["slot_mapping"], n, self.rope_inv_freq, cache, backend,
                             self.ops, buffers, self.group, pad)
        x = vocab_parallel.embed(self.model.embed_tokens.weight, ids, self.group, pad)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, shared)
        norm = self.model.norm
        return self.ops.add_rmsnorm(x, residual, norm.weight, norm.eps)[0]

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts and logits it returns: the full vocabulary when sharded
        over a group, else the config's rows (a one-rank model keeps only its own)."""
        return self.config.vocab_size * (self.group.world_size if self.group.distributed else 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> ``[N, vocab_size]`` (lm_head, untied; gathered over the group)."""
        return vocab_parallel.logits(self.lm_head, hidden, self.group)

    @torch.no_grad()
    def init_random_(self, seed: int = 0, balance_routing: bool = True) -> None:
        """Fill every parameter with deterministic random values of a sensible scale:
        linear and expert weights ``N(0, 1/fan_in)``, embeddings ``N(0, 1)``, norm offsets
        ``N(0, 0.1^2)``. ``balance_routing``: the routing bias is then calibrated
        (``routing.calibrate_routing_bias_``: one eager prefill of random prompts) so that
        tokens spread over the experts as a trained model's do; else it is ``N(0, 0.1^2)``
        and a random router sends a batch to a few experts.

        Sharded over a group, the replicated parameters (norms, routing bias, router) are equal
        on every rank, so all ranks route alike; the sharded ones are drawn per rank (a valid
        model of the sharded shapes, not slices of one unsharded model: load a checkpoint for
        that)."""
        salt = self.group.rank * 7_919 if self.group.distributed else 0
        params = dict(self.named_parameters())
        for name, p in params.items():
            if name.endswith(SCALE_SUFFIX):
                continue  # MXFP8 scales: written with their weight
            replicated = p.dim() == 1 or name.endswith(".gate.weight")
            key = seed * 1_000_003 + _stable_hash(name) + (0 if replicated else salt)
            gen = torch.Generator(device=p.device).manual_seed(key)
            if p.dim() == 1:
                std = 0.1
            elif "embed_tokens" in name:
                std = 1.0
            else:
                std = p.shape[-1] ** -0.5
            value = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(std)
            if p.dtype == FP8:  # MXFP8: the same draw as unquantized, quantised into the weight and its scales
                q, scale = quantize_mxfp8(value)
                p.copy_(q)
                params[name + SCALE_SUFFIX].copy_(scale)
            else:
                p.copy_(value.to(p.dtype))
        if balance_routing:
            calibrate_routing_bias_(self, make_ops("torch", next(self.parameters()).device, self.dtype), seed)


def _stable_hash(s: str) -> int:
    """Process-independent hash (Python's ``hash`` of str is salted per process)."""
    h = 0
    for ch in s.encode():
        h = (h * 131 + ch) % 1_000_000_007
    return h
