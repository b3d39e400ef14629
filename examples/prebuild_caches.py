"""Prebuild graphcap's JIT and kernel-choice caches for a deployment's shapes.

    GRAPHCAP_CACHE_DIR=/srv/graphcap-cache python examples/prebuild_caches.py --preset rank-of-8 \\
        --max-tokens 1054 --max-seqs 32

Builds the preset with only as many layers as it takes to hold every layer kind (dense and
sparse attention, dense MLP and MoE: kernels depend on shapes, not on the layer count), with
random weights, and runs one capture of the same buckets the server will capture: flashinfer
modules, Triton kernels and the validated kernel choices of every bucket size land in
``$GRAPHCAP_CACHE_DIR`` (default ``~/.cache/graphcap``). A server started afterwards with the
same directory, GPU and software versions skips those builds. CPU: nothing to build.
"""

from __future__ import annotations

import argparse
import time

import torch

from graphcap import CaptureConfig
from graphcap.startup import jit_cache
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config


def layers_covering_every_kind(config: MiniMaxM3Config) -> int:
    """The shortest prefix of layers with each (sparse?, MoE?) kind the model has."""
    kinds = {(config.is_sparse(i), config.is_moe(i)) for i in range(config.num_hidden_layers)}
    seen: set = set()
    for i in range(config.num_hidden_layers):
        seen.add((config.is_sparse(i), config.is_moe(i)))
        if seen == kinds:
            return i + 1
    return config.num_hidden_layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="rank-of-8")
    p.add_argument("--max-tokens", type=int, default=1054, help="the server's step capacity / capture ceiling")
    p.add_argument("--max-seqs", type=int, default=32, help="the server's request capacity")
    p.add_argument("--max-seq-len", type=int, default=4096)
    args = p.parse_args()
    root = jit_cache.configure()
    if not torch.cuda.is_available():
        print(f"no GPU: nothing to prebuild (cache directory {root})")
        return
    config = MiniMaxM3Config.preset(args.preset)
    config = config.first_layers(layers_covering_every_kind(config))
    t0 = time.perf_counter()
    runner = build_from_preset(config, "cuda", torch.bfloat16, backend="auto", max_tokens=args.max_tokens,
                               max_seqs=args.max_seqs, max_seq_len=args.max_seq_len,
                               capture=CaptureConfig.from_env(CaptureConfig(enabled=True, max_tokens=args.max_tokens)))
    runner.capture()
    s = runner.manager.stats
    print(f"prebuilt {args.preset} ({config.num_hidden_layers} layers, {len(s.buckets)} graphs) into {root} in "
          f"{time.perf_counter() - t0:.1f} s (JIT and tuning {s.jit_s:.1f} s, warm-up {s.warmup_s:.1f} s, "
          f"capture {s.capture_s:.1f} s)")


if __name__ == "__main__":
    main()
