"""Tensor parallelism on GPUs through NCCL: world size 1 on one GPU (the same collectives, in
captured segments), and 2 ranks when the machine has 2 GPUs."""

from __future__ import annotations

import pytest
import torch
from helpers import tp_checks
from helpers.ranks import run_ranks

from models.minimax_m3.checkpoint_writer import write_synthetic_checkpoint
from models.minimax_m3.config import MiniMaxM3Config

pytestmark = pytest.mark.cuda

BF16 = 3e-2  # bf16 logits against another path's rounding


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m3_tiny_nccl")
    write_synthetic_checkpoint(MiniMaxM3Config.tiny(), folder, seed=5)
    return str(folder)


def check_captured(r: dict, world: int) -> None:
    assert r["failures"] == {}, r["failures"]  # replay == eager, no frozen value (NCCL nodes included)
    assert r["graphs"] > 0 and r["hits"] >= 3
    # Embedding, then o_proj and MLP/MoE of every layer: 1 + 2L all-reduces per captured graph.
    assert r["captured_all_reduces"] == r["graphs"] * (1 + 2 * r["layers"]), r
    if world > 1:  # world size 1: NCCL's in-place all-reduce launches nothing
        assert r["nccl_kernels"] > 0, f"no NCCL kernel among {r['kernels']} captured kernels"
    for name, v in r["steps"].items():
        assert v["vs_padded_eager"] < 1e-2, (name, v)  # same kernels, same shapes
        assert v["vs_unsharded"] < BF16, (name, v)


def test_world_size_one_through_nccl_is_captured():
    (r,) = run_ranks(tp_checks.nccl_captured, 1, backend="nccl", timeout_s=400)
    check_captured(r, 1)


@pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs (nvidia-h200-x2)")
def test_two_ranks_capture_with_all_reduces_inside_segments(ckpt):
    for r in run_ranks(tp_checks.nccl_captured, 2, ckpt, backend="nccl", timeout_s=400):
        check_captured(r, 2)


@pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs (nvidia-h200-x2)")
def test_two_rank_serving_with_recapture_does_not_hang(ckpt):
    a, b = run_ranks(tp_checks.nccl_serving_with_recapture, 2, ckpt, backend="nccl", timeout_s=400)
    assert a["captured"] and b["captured"] and a["steps"] > 6
    assert a["tokens"] == b["tokens"]  # every rank samples the gathered logits alike
