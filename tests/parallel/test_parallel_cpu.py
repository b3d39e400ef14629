"""Tensor and expert parallelism on CPU: gloo groups of 2 and 4 spawned processes.

Sharded MiniMax-M3 (tiny preset, fp32, from one synthetic checkpoint) against the unsharded
model: logits of prefill, mixed and decode steps, eager and padded; each rank's loaded slices;
the collectives' padding rule; graphcap's agreement on graphs; the engine on every rank. TP4
puts two ranks on each kv head (the tiny model has 2), as TP8 does for the real model."""

from __future__ import annotations

import pytest
from helpers import tp_checks
from helpers.ranks import run_ranks

from graphcap import GraphKey
from models.minimax_m3.checkpoint_writer import write_synthetic_checkpoint
from models.minimax_m3.config import MiniMaxM3Config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m3_tiny_tp")
    write_synthetic_checkpoint(MiniMaxM3Config.tiny(), folder, seed=5, shard_size_bytes=200_000)
    return str(folder)


def each_rank(fn, world, *args):
    return list(enumerate(run_ranks(fn, world, *args)))


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_zero_padding_and_gather_in_rank_order(world):
    for rank, r in each_rank(tp_checks.collectives, world):
        assert r == dict(real_rows_summed=True, padded_rows_zero=True, gathered_in_rank_order=True,
                         embed_equals_full=True), rank


@pytest.mark.parametrize("world", [2, 4])
def test_loader_reads_only_this_ranks_slices(ckpt, world):
    for rank, r in each_rank(tp_checks.loader_slices, world, ckpt):
        bad = [k for k, ok in r["checks"].items() if not ok]
        assert not bad, f"rank {rank}: {bad}"
        assert r["expert_offset"] == rank * r["experts_per_rank"]
        # Each rank reads exactly the bytes it holds (fp32 checkpoint into fp32 parameters):
        # its slices once each, no other rank's experts, vocab rows or heads.
        assert r["bytes_rank"] == r["bytes_held"] < r["bytes_full"], (rank, r)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_logits_equal_unsharded_fp32(ckpt, world):
    for rank, r in each_rank(tp_checks.sharded_logits, world, ckpt):
        assert r["padded padded rows"] > 0  # the padded path really padded
        for name, v in r.items():
            if "step" in name:
                assert v["shape"][1] == MiniMaxM3Config.tiny().vocab_size, (rank, name)
                assert v["rel_err"] < 1e-5 and v["same_argmax"], (rank, name, v)


def test_engine_on_two_ranks_serves_the_same_tokens(ckpt):
    for rank, r in each_rank(tp_checks.serving, 2, ckpt):
        assert r["same_tokens"] and r["tokens"] > 0, rank


def test_ranks_agree_on_dropped_graphs_and_refuse_different_buckets(ckpt):
    for rank, r in each_rank(tp_checks.agreement, 2, ckpt):
        assert list(r["union"]) == [GraphKey(16, False)], rank
        assert all(type(k) is GraphKey for k in r["union"]), rank
        assert ("on rank 0" in r["union"][GraphKey(16, False)]) == (rank == 1)
        assert r["all_ok"] is False
        assert "ranks disagree on graph keys" in r["refused"] and "rank 0:" in r["refused"], (rank, r["refused"])
