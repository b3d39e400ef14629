"""MiniMaxM3Config: the text backbone's configuration, translated from HF once.

The fields describe the tensors *this process* holds. For a single-GPU (or CPU) model that is
the whole model; for the ``rank_of_8`` preset it is one rank of a TP8/EP8 deployment, with
``tp_size``/``ep_size`` recording how the global model was divided (see ``shard``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import torch

from common.values import as_float, int_tuple, is_int
from kvcache.paged import KVCacheConfig, cache_dtype

from .hf_config import read_config_json, translate_hf
from .mxfp8 import MXFP8Config, as_quantization, check_block_alignment

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class MiniMaxM3Config:
    """MiniMax-M3 text model (spec §1). Defaults are the real model (``real()``).

    Attributes (per rank when ``tp_size``/``ep_size`` > 1; global otherwise):
        hidden_size: residual width H.
        num_hidden_layers: decoder layers L.
        num_attention_heads: q heads.
        num_key_value_heads: kv heads (GQA groups); ``num_attention_heads`` is a multiple.
        head_dim: width of one q/k/v head.
        vocab_size: rows of embed_tokens and lm_head.
        max_position_embeddings: longest supported position (+1).
        rms_norm_eps: epsilon of every GemmaRMSNorm.
        rope_theta: RoPE base.
        rotary_dim: leading dims of each head that rotate (NeoX split-half); the rest pass.
        dense_intermediate_size: width of the dense MLP (non-MoE layers).
        intermediate_size: width of one routed expert.
        shared_intermediate_size: width of one shared expert.
        n_shared_experts: shared experts (their widths add up; M3 has one).
        num_local_experts: routed experts the router scores (HF's name; global count, 128,
            even per rank: routing always runs over all experts).
        num_experts_per_tok: top-k of the router.
        routed_scaling_factor: multiplies the renormalised top-k weights.
        swiglu_alpha, swiglu_limit: SwiGLU-OAI constants (1.702, 7.0).
        moe_layer_freq: per layer, 1 = MoE, 0 = dense MLP.
        sparse_attention_freq: per layer, 1 = sparse attention (MSA) with an index branch,
            0 = dense causal GQA.
        sparse_num_index_heads: index-query heads; equals ``num_key_value_heads`` (per-group
            block selection).
        sparse_index_dim: width of an index-query / index-key head.
        sparse_block_size: tokens per selectable block; also the KV page size.
        sparse_topk_blocks: blocks each (index head, query token) attends, forced ones included.
        sparse_init_block: forced leading (sink) blocks; only 0 is supported.
        sparse_local_block: forced trailing blocks (the query's own block); only 1 is supported.
        tie_word_embeddings: only False is supported (lm_head is its own tensor).
        dtype: parameter dtype of the checkpoint (router gate and bias are always fp32).
        tp_size: tensor-parallel degree this config is one rank of (1 = unsharded).
        ep_size: expert-parallel degree; this rank computes experts
            ``[0, num_local_experts // ep_size)`` and treats the rest as remote.
        quantization: the weight format of the linears (``mxfp8.MXFP8Config``: fp8 weights with
            E8M0 scales per [1, 32] block), or None for ``dtype`` weights. Kept by ``shard``,
            ``first_layers`` and the presets; ``with_quantization("mxfp8")`` or
            ``preset(name, "mxfp8")`` give the MXFP8 variant.
    """

    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 200064
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    rotary_dim: int = 64
    dense_intermediate_size: int = 12288
    intermediate_size: int = 3072
    shared_intermediate_size: int = 3072
    n_shared_experts: int = 1
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    moe_layer_freq: tuple[int, ...] = (0, 0, 0) + (1,) * 57
    sparse_attention_freq: tuple[int, ...] = (0, 0, 0) + (1,) * 57
    sparse_num_index_heads: int = 4
    sparse_index_dim: int = 128
    sparse_block_size: int = 128
    sparse_topk_blocks: int = 16
    sparse_init_block: int = 0
    sparse_local_block: int = 1
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    tp_size: int = 1
    ep_size: int = 1
    quantization: MXFP8Config | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantization", as_quantization(self.quantization))  # "mxfp8" -> MXFP8Config
        for name in ("moe_layer_freq", "sparse_attention_freq"):
            object.__setattr__(self, name, int_tuple(f"MiniMaxM3Config.{name}", getattr(self, name)))
        # Float constants: the RoPE base is raised to powers, eps is added under a root, the others
        # scale or clamp activations. A non-number, NaN, inf or (where listed) a value <= 0 would
        # build a model that only shows the mistake as NaN/inf outputs. Comparisons with NaN are
        # False, so the range tests below also refuse NaN.
        for name in ("rope_theta", "rms_norm_eps", "routed_scaling_factor", "swiglu_limit", "swiglu_alpha"):
            v = getattr(self, name)
            positive = name != "swiglu_alpha"
            f = as_float(v) if isinstance(v, (int, float)) else None
            if f is None or (positive and not f > 0):
                raise ValueError(f"{name} must be {'a finite number > 0' if positive else 'a finite number'}, "
                                 f"got {v!r}")
        _validate(self)

    # ----- derived shapes -------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def index_q_size(self) -> int:
        return self.sparse_num_index_heads * self.sparse_index_dim

    @property
    def num_experts_per_rank(self) -> int:
        """Routed experts whose weights this rank holds (ids ``0..num_experts_per_rank-1``)."""
        return self.num_local_experts // self.ep_size

    @property
    def shared_width(self) -> int:
        """Total shared-expert width (``shared_intermediate_size * n_shared_experts``)."""
        return self.shared_intermediate_size * self.n_shared_experts

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, f in enumerate(self.sparse_attention_freq) if f)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, f in enumerate(self.moe_layer_freq) if f)

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_attention_freq[layer])

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layer_freq[layer])

    def sparse_ordinal(self, layer: int) -> int:
        """Position of sparse ``layer`` among the sparse layers (index-K cache row)."""
        if not self.is_sparse(layer):
            raise ValueError(f"layer {layer} is a dense-attention layer; it has no index-K cache")
        return self.sparse_layers.index(layer)

    def qkv_size(self, layer: int) -> int:
        """Output width of the fused projection ``[q|k|v]`` or ``[q|k|v|iq|ik]``."""
        n = self.q_size + 2 * self.kv_size
        if self.is_sparse(layer):
            n += self.index_q_size + self.sparse_index_dim
        return n

    @property
    def page_size(self) -> int:
        """KV page size: always the sparse block, so a selected block is exactly one page."""
        return self.sparse_block_size

    def check_page_size(self, page_size: int) -> None:
        """Raise unless ``page_size`` equals the sparse block (the cache must follow the model)."""
        if page_size != self.sparse_block_size:
            raise ValueError(
                f"KV page_size={page_size} differs from sparse_block_size={self.sparse_block_size}; "
                f"MiniMax-M3 selects whole pages, so the page size must equal the sparse block"
            )

    def kv_cache_config(
        self,
        num_pages: int,
        max_seqs: int,
        max_pages_per_seq: int,
        dtype: torch.dtype | None = None,
        index_dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        page_size: int | None = None,
        table_row_headroom: int | None = None,
        capture_rows: int = 0,
        capture_pages: int = 0,
        kv_dtype: torch.dtype | str | None = None,
    ) -> KVCacheConfig:
        """The paged-cache sizes this model needs (kv heads, head dims, sparse layers, page
        size = sparse block). ``dtype`` (main K/V) and ``index_dtype`` (index-K) default to the
        model dtype; ``kv_dtype`` sets both at once (a dtype or a name: ``"fp8"`` is e4m3 with
        unit scale, see ``kvcache.paged``), and ``index_dtype`` still overrides the index-K
        part; ``capture_rows``/``capture_pages`` reserve room for capture's dummy steps.

        Raises:
            ValueError: ``page_size`` given and different from ``sparse_block_size``; both
                ``kv_dtype`` and ``dtype`` given; an unsupported cache dtype.
        """
        if page_size is not None:
            self.check_page_size(page_size)
        if kv_dtype is not None:
            if dtype is not None:
                raise ValueError(f"kv_cache_config got kv_dtype={kv_dtype!r} and dtype={dtype!r}; give kv_dtype "
                                 f"(main K/V and index-K) or dtype/index_dtype (each cache), not both")
            dtype = cache_dtype(kv_dtype)
        dt = dtype or self.torch_dtype
        return KVCacheConfig(
            num_layers=self.num_hidden_layers, sparse_layers=self.sparse_layers,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim, index_dim=self.sparse_index_dim,
            page_size=self.sparse_block_size, num_pages=num_pages, max_seqs=max_seqs,
            max_pages_per_seq=max_pages_per_seq, dtype=dt, index_dtype=index_dtype or dt, device=device,
            table_row_headroom=table_row_headroom, capture_rows=capture_rows, capture_pages=capture_pages,
        )

    # ----- presets ---------------------------------------------------------------------
    @classmethod
    def real(cls) -> "MiniMaxM3Config":
        """The released model, all 60 layers, unsharded (spec §1)."""
        return cls()

    @classmethod
    def tiny(cls, dtype: str = "float32", quantization: str | MXFP8Config | None = None) -> "MiniMaxM3Config":
        """CPU-test model: layer 0 dense attention + dense MLP, layers 1..3 sparse + MoE.

        Block size 4 and top-3 blocks: sparse attention equals dense for positions < 12 and
        differs beyond (when the scores drop a block). The index head width (64) differs from
        ``head_dim`` (32) so shape mix-ups between the two branches fail loudly. MXFP8
        (``quantization="mxfp8"``) widens the dense MLP (96) and shared expert (48) to 128, so
        every input width, and its slice up to TP4, is whole 32-column blocks.
        """
        wide = as_quantization(quantization) is not None
        return cls(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=256, max_position_embeddings=4096, rope_theta=10000.0,
            rotary_dim=16, dense_intermediate_size=128 if wide else 96, intermediate_size=32,
            shared_intermediate_size=128 if wide else 48, n_shared_experts=1, num_local_experts=8,
            num_experts_per_tok=2, moe_layer_freq=(0, 1, 1, 1), sparse_attention_freq=(0, 1, 1, 1),
            sparse_num_index_heads=2, sparse_index_dim=64, sparse_block_size=4,
            sparse_topk_blocks=3, dtype=dtype, quantization=quantization,
        )

    def with_quantization(self, quantization: str | MXFP8Config | None) -> "MiniMaxM3Config":
        """This config with MXFP8 weights (``"mxfp8"`` or an ``MXFP8Config``) or unquantized (None)."""
        return replace(self, quantization=as_quantization(quantization))

    @classmethod
    def slice(cls, num_layers: int = 7) -> "MiniMaxM3Config":
        """Real width, the first ``num_layers`` layers (0..2 dense, then sparse MoE)."""
        return cls.real().first_layers(num_layers)

    def first_layers(self, num_layers: int) -> "MiniMaxM3Config":
        """This config cut to its first ``num_layers`` layers."""
        if not is_int(num_layers) or not 1 <= num_layers <= self.num_hidden_layers:
            raise ValueError(f"num_layers={num_layers!r}: choose 1..{self.num_hidden_layers}")
        return replace(
            self, num_hidden_layers=num_layers, moe_layer_freq=self.moe_layer_freq[:num_layers],
            sparse_attention_freq=self.sparse_attention_freq[:num_layers],
        )

    @classmethod
    def rank_of_8(cls) -> "MiniMaxM3Config":
        """Per-GPU shapes of a TP8/EP8 deployment over all 60 layers (``real().shard(8, 8)``).

        Collectives are left out, so this rank computes only its own part of every layer.
        """
        return cls.real().shard(8, 8)

    def shard(self, tp_size: int, ep_size: int) -> "MiniMaxM3Config":
        """The shapes one rank holds under tensor parallelism ``tp_size`` (attention, dense MLP,
        shared expert, vocab) and expert parallelism ``ep_size`` (routed experts).

        Division, e.g. real model at TP8/EP8:
          - q heads ``64 / tp = 8``; o_proj input shrinks to ``8 * 128``.
          - kv heads ``max(1, 4 / tp) = 1``: above TP=4 each kv head is replicated (at TP8
            two ranks hold each kv head). Index heads follow kv heads (1); the single
            index-key head is replicated on every rank.
          - dense MLP ``12288 / tp = 1536``; shared expert ``3072 / tp = 384``.
          - vocab ``200064 / tp = 25008`` rows of embed_tokens and lm_head (vocab-parallel
            shards). Under a ``distributed.ParallelGroup`` the model runs the masked lookup and
            the logits gather; without one (``rank_of_8``) those collectives are left out and ids
            must fall in ``[0, 25008)``.
          - routed experts: the router still scores all 128 experts and picks the global
            top-4; this rank holds experts ``0..15`` (``128 / ep``) and computes only the
            (token, expert) pairs that land there; pairs routed to other ranks are skipped,
            as their results would arrive by the all-reduce that is left out. With
            attention replicated across TP ranks, every rank sees all T tokens, so a rank
            does about ``T * 4 / 8`` expert rows per layer, as in a real EP deployment.
          - hidden size, head_dim, layer count, norms and the index dim are unchanged.
        """
        if self.tp_size != 1 or self.ep_size != 1:
            raise ValueError("shard() takes an unsharded config (tp_size == ep_size == 1)")
        for name, val in (("tp_size", tp_size), ("ep_size", ep_size)):
            if not is_int(val) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        div = {
            "num_attention_heads": (self.num_attention_heads, tp_size),
            "dense_intermediate_size": (self.dense_intermediate_size, tp_size),
            "shared_intermediate_size": (self.shared_intermediate_size, tp_size),
            "vocab_size": (self.vocab_size, tp_size),
            "num_local_experts": (self.num_local_experts, ep_size),
        }
        for name, (n, d) in div.items():
            if n % d:
                raise ValueError(f"{name}={n} is not divisible by the parallel degree {d}")
        kv = self.num_key_value_heads
        if (kv % tp_size) if tp_size <= kv else (tp_size % kv):
            raise ValueError(f"num_key_value_heads={kv} cannot be split or replicated over tp_size={tp_size}")
        kv_local = max(1, kv // tp_size)
        return replace(
            self, num_attention_heads=self.num_attention_heads // tp_size,
            num_key_value_heads=kv_local, sparse_num_index_heads=kv_local,
            dense_intermediate_size=self.dense_intermediate_size // tp_size,
            shared_intermediate_size=self.shared_intermediate_size // tp_size,
            vocab_size=self.vocab_size // tp_size, tp_size=tp_size, ep_size=ep_size,
        )

    @classmethod
    def preset(cls, name: str, quantization: str | MXFP8Config | None = None) -> "MiniMaxM3Config":
        """``tiny``, ``slice`` (7 layers), ``rank_of_8`` (also ``rank-of-8``) or ``real``;
        ``quantization="mxfp8"``: its MXFP8 variant (tiny's is wider, see ``tiny``)."""
        table = {"tiny": cls.tiny, "slice": cls.slice, "rank_of_8": cls.rank_of_8, "real": cls.real}
        key = name.replace("-", "_")
        if key not in table:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(table)}")
        if key == "tiny":
            return cls.tiny(quantization=quantization)
        return table[key]().with_quantization(quantization)

    # ----- HF translation --------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "MiniMaxM3Config":
        """Translate an HF ``config.json`` (a folder, the file, or its parsed dict).

        Accepts the VL wrapper (``text_config`` inside) and a plain text config. Raises
        ValueError naming the field for anything inconsistent or unsupported.
        """
        return cls(**translate_hf(read_config_json(path_or_dict), fields(cls), _NOT_HF))

    def to_hf_text(self) -> dict[str, Any]:
        """The ``text_config`` dict that ``from_hf`` reads back to this config (unsharded)."""
        if self.tp_size != 1 or self.ep_size != 1:
            raise ValueError("to_hf_text() describes a whole model; this config is one rank of a shard")
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_HF}
        if (q := d.pop("quantization")) is not None:
            d["quantization_config"] = q.to_hf()
        sparse = {k: d.pop(k) for k in list(d) if k.startswith("sparse_")}
        for k in ("moe_layer_freq", "sparse_attention_freq"):
            (sparse if k in sparse else d)[k] = list(sparse.get(k, d.get(k)))
        sparse.update(use_sparse_attention=any(self.sparse_attention_freq), sparse_score_type="max",
                      sparse_disable_index_value=list(self.sparse_attention_freq))
        d.update(
            architectures=["MiniMaxM3SparseForCausalLM"], model_type="minimax_m3", torch_dtype=d.pop("dtype"),
            hidden_act="swigluoai", use_gemma_norm=True, use_qk_norm=True, qk_norm_type="per_head",
            attention_output_gate=False, partial_rotary_factor=self.rotary_dim / self.head_dim,
            scoring_func="sigmoid", use_routing_bias=True, sparse_attention_config=sparse,
        )
        return d


def _validate(c: MiniMaxM3Config) -> None:
    """Structural consistency; each failure names the field and what to change."""
    for f in fields(c):
        v = getattr(c, f.name)
        if f.type == "int" and (not is_int(v) or v < 0):
            raise ValueError(f"{f.name} must be a non-negative int, got {v!r}")
    positive = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "num_local_experts",
                "num_experts_per_tok", "sparse_block_size", "sparse_topk_blocks", "tp_size", "ep_size",
                "sparse_num_index_heads", "sparse_index_dim", "intermediate_size", "dense_intermediate_size")
    for name in positive:
        if getattr(c, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(c, name)}")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={c.num_attention_heads} is not divisible by num_key_value_heads="
            f"{c.num_key_value_heads}"
        )
    if c.rotary_dim > c.head_dim or c.rotary_dim % 2 or c.rotary_dim < 2:
        raise ValueError(f"rotary_dim={c.rotary_dim} must be even, >= 2 and <= head_dim={c.head_dim}")
    if c.rotary_dim > c.sparse_index_dim:
        raise ValueError(f"rotary_dim={c.rotary_dim} exceeds sparse_index_dim={c.sparse_index_dim}")
    for name in ("moe_layer_freq", "sparse_attention_freq"):
        v = getattr(c, name)
        if not isinstance(v, tuple) or len(v) != c.num_hidden_layers or any(x not in (0, 1) for x in v):
            raise ValueError(f"{name} must list 0/1 for each of the {c.num_hidden_layers} layers, got {v!r}")
    if c.sparse_num_index_heads != c.num_key_value_heads:
        raise ValueError(
            f"sparse_num_index_heads={c.sparse_num_index_heads} must equal num_key_value_heads="
            f"{c.num_key_value_heads} (block selection is per kv group)"
        )
    if c.sparse_init_block != 0:
        raise ValueError(f"sparse_init_block={c.sparse_init_block} is unsupported (only 0: no sink block)")
    if c.sparse_local_block != 1:
        raise ValueError(f"sparse_local_block={c.sparse_local_block} is unsupported (only 1)")
    if c.sparse_topk_blocks < c.sparse_local_block + c.sparse_init_block:
        raise ValueError(f"sparse_topk_blocks={c.sparse_topk_blocks} leaves no room for the forced blocks")
    if c.num_experts_per_tok > c.num_local_experts:
        raise ValueError(
            f"num_experts_per_tok={c.num_experts_per_tok} exceeds num_local_experts={c.num_local_experts}"
        )
    if any(c.moe_layer_freq) and (c.shared_intermediate_size < 1 or c.n_shared_experts < 1):
        raise ValueError("shared_intermediate_size and n_shared_experts must be >= 1 (M3 always has a shared expert)")
    if c.num_local_experts % c.ep_size:
        raise ValueError(f"num_local_experts={c.num_local_experts} is not divisible by ep_size={c.ep_size}")
    if c.tie_word_embeddings:
        raise ValueError("tie_word_embeddings=True is unsupported (M3 has its own lm_head)")
    if c.dtype not in _DTYPES:
        raise ValueError(f"dtype={c.dtype!r} is unsupported; choose one of {sorted(_DTYPES)}")
    if c.quantization is not None:
        check_block_alignment(c)


_NOT_HF = frozenset({"tp_size", "ep_size"})
