"""Building a MiniMax-M3 ``ModelRunner``: from a preset (random weights) or a checkpoint folder.

The runner is the generic one (``models.runner``); what is MiniMax-M3's here is the cache
layout (``MiniMaxM3Config.kv_cache_config``), the attention dims and the model itself.
"""

from __future__ import annotations

import os

import torch

from attention.dims import AttentionDims
from attention.registry import make_backend
from distributed import ParallelGroup
from graphcap import CaptureConfig
from kvcache.paged import PagedKVCache, cache_dtype
from models.runner import ModelRunner, capture_reserve

from .config import MiniMaxM3Config
from .model import MiniMaxM3ForCausalLM
from .weights import load_checkpoint


def runner_for(model: MiniMaxM3ForCausalLM, device: torch.device | str, backend: str, max_tokens: int,
               max_seqs: int, max_seq_len: int, num_pages: int | None, capture: CaptureConfig | None,
               *, kv_dtype: torch.dtype | str | None = None, index_dtype: torch.dtype | None = None) -> ModelRunner:
    """A runner over ``model``: a paged cache of ``num_pages`` pages (default: ``max_seqs`` full
    sequences) plus the capture reserve, and the attention ``backend`` on it. ``kv_dtype``: the
    storage dtype of main K/V and index-K (default the model dtype; ``"fp8"``/
    ``torch.float8_e4m3fn``: fp8 e4m3, unit scale); ``index_dtype`` overrides the index-K part."""
    c = model.config
    pages_per_seq = -(-max_seq_len // c.sparse_block_size)
    rows, pages = capture_reserve(max_tokens, max_seqs, c.sparse_block_size, pages_per_seq * c.sparse_block_size)
    kv = c.kv_cache_config(num_pages=num_pages or pages_per_seq * max_seqs, max_seqs=max_seqs,
                           max_pages_per_seq=pages_per_seq, kv_dtype=kv_dtype or model.dtype,
                           index_dtype=index_dtype, device=device, capture_rows=rows, capture_pages=pages)
    cache = PagedKVCache(kv)
    dims = AttentionDims.for_cache(cache, c.num_attention_heads, c.sparse_topk_blocks, max_tokens)
    return ModelRunner(model, cache, make_backend(backend, cache, dims), max_tokens, max_seqs, capture)


def sharded_for(config: MiniMaxM3Config, group: ParallelGroup | None) -> MiniMaxM3Config:
    """``config`` as one rank of ``group``: a whole model is sharded ``shard(W, W)``; an
    already sharded one is kept (the model checks that it fits the group)."""
    if group is None or not group.distributed or (config.tp_size, config.ep_size) != (1, 1):
        return config
    return config.shard(group.world_size, group.world_size)


def build_from_preset(name: str | MiniMaxM3Config, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                      *, seed: int = 0, backend: str = "auto", max_tokens: int = 512, max_seqs: int = 8,
                      max_seq_len: int = 4096, num_pages: int | None = None, moe_impl: str = "auto",
                      producer: str = "auto", capture: CaptureConfig | None = None,
                      group: ParallelGroup | None = None, routing: str = "model",
                      balance_routing: bool = True, kv_dtype: torch.dtype | str | None = None) -> ModelRunner:
    """A runner over a preset (``tiny``, ``slice``, ``rank_of_8``, ``real``) or a config, with
    random weights (``init_random_(seed, balance_routing)``: the routing bias calibrated so a
    batch spreads over the experts as a trained model's does); with a distributed ``group``,
    this rank's shard of the whole config (``sharded_for``). ``backend="auto"``: flashinfer
    (dense layers) and Triton (sparse) on CUDA, the torch reference elsewhere
    (``attention.registry``). ``routing``: ``model``, or a simulation (``uniform``,
    ``balanced``: see ``MiniMaxM3ForCausalLM``). ``kv_dtype``: the KV and index-K cache dtype
    (default the model dtype; ``"fp8"`` or ``torch.float8_e4m3fn``: fp8 e4m3, see ``runner_for``)."""
    config = name if isinstance(name, MiniMaxM3Config) else MiniMaxM3Config.preset(name)
    kv_dtype = None if kv_dtype is None else cache_dtype(kv_dtype)  # refuse before building the weights
    model = MiniMaxM3ForCausalLM(sharded_for(config, group), dtype=dtype, device=device, moe_impl=moe_impl,
                                 producer=producer, group=group, routing=routing)
    model.init_random_(seed, balance_routing)
    return runner_for(model, device, backend, max_tokens, max_seqs, max_seq_len, num_pages, capture,
                      kv_dtype=kv_dtype)


def build_dequantized_twin(runner: ModelRunner, backend: str = "auto", num_pages: int | None = None,
                           capture: CaptureConfig | None = None, producer: str = "auto") -> ModelRunner:
    """A runner (``runner``'s sizes) whose model is ``runner``'s MXFP8 model unquantized, holding
    its weights dequantised (the same values, in the runner's dtype) and routed the same way,
    on a cache of the runner's dtypes: the reference an MXFP8 model's logits and tokens are
    compared against. ``producer``: its op table (``make_ops``)."""
    from .mxfp8 import FP8, SCALE_SUFFIX, dequantize_mxfp8

    q = runner.model
    if q.config.quantization is None:
        raise ValueError("build_dequantized_twin needs an MXFP8 model; this one is not quantized")
    dev = next(q.parameters()).device
    routing = q.ops.routing.strategy if q.ops.routing is not None else "model"
    twin = MiniMaxM3ForCausalLM(q.config.with_quantization(None), dtype=q.dtype, device=dev, routing=routing,
                                producer=producer)
    params = dict(q.named_parameters())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            src = params[name]
            p.copy_(dequantize_mxfp8(src, params[name + SCALE_SUFFIX], p.dtype) if src.dtype == FP8 else src)
    kc = runner.cache.config
    return runner_for(twin, dev, backend, runner.max_tokens, runner.max_seqs, runner.max_seq_len, num_pages, capture,
                      kv_dtype=kc.dtype, index_dtype=kc.index_dtype)


def build_from_checkpoint(folder: str | os.PathLike, device: torch.device | str = "cpu",
                          dtype: torch.dtype | None = None,
                          *, num_layers: int | None = None, backend: str = "auto", max_tokens: int = 512,
                          max_seqs: int = 8, max_seq_len: int = 4096, num_pages: int | None = None,
                          moe_impl: str = "auto", producer: str = "auto",
                          capture: CaptureConfig | None = None, group: ParallelGroup | None = None,
                          routing: str = "model", kv_dtype: torch.dtype | str | None = None) -> ModelRunner:
    """A runner over a checkpoint folder; ``num_layers`` keeps only the first layers. With a
    distributed ``group``, each rank streams only its own slices of the checkpoint.
    ``routing``, ``kv_dtype``: as for ``build_from_preset`` (the checkpoint's own router and
    the model dtype by default)."""
    config = MiniMaxM3Config.from_hf(folder)
    kv_dtype = None if kv_dtype is None else cache_dtype(kv_dtype)  # refuse before loading the weights
    truncate = num_layers is not None and num_layers != config.num_hidden_layers
    if truncate:
        config = config.first_layers(num_layers)  # type: ignore[arg-type]
    model = MiniMaxM3ForCausalLM(sharded_for(config, group), dtype=dtype, device=device, moe_impl=moe_impl,
                                 producer=producer, group=group, routing=routing)
    load_checkpoint(model, folder, truncate_layers=truncate)
    return runner_for(model, device, backend, max_tokens, max_seqs, max_seq_len, num_pages, capture,
                      kv_dtype=kv_dtype)


__all__ = ["build_dequantized_twin", "build_from_checkpoint", "build_from_preset", "runner_for", "sharded_for"]
