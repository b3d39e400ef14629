"""The sharding rules, the NCCL environment and the errors of a group that does not fit."""

from __future__ import annotations

import pytest

from distributed import ParallelGroup, configure_nccl, group_for_tp, head_slice, split_slice
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.model import MiniMaxM3ForCausalLM
from models.minimax_m3.weights import checkpoint_layout


def test_split_covers_the_dimension_once_in_rank_order():
    parts = [split_slice(12, r, 4) for r in range(4)]
    assert [(s.start, s.stop) for s in parts] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match="cannot be split evenly"):
        split_slice(10, 0, 4)
    with pytest.raises(ValueError, match="rank=4"):
        split_slice(12, 4, 4)


def test_heads_split_then_replicate_keeping_gqa_groups_whole():
    # 4 kv heads of width 2: TP2 splits them, TP8 puts ranks 2r and 2r+1 on head r.
    assert [(s.start, s.stop) for s in (head_slice(4, 2, r, 2) for r in range(2))] == [(0, 4), (4, 8)]
    tp8 = [head_slice(4, 2, r, 8) for r in range(8)]
    assert [s.start // 2 for s in tp8] == [0, 0, 1, 1, 2, 2, 3, 3] and all(s.stop - s.start == 2 for s in tp8)
    # Rank r's q heads (64 / 8 = 8 per rank) belong to the kv group it holds (16 q heads per kv head).
    for r in range(8):
        first_q_head = head_slice(64, 1, r, 8).start
        assert first_q_head // 16 == tp8[r].start // 2
    with pytest.raises(ValueError, match="replicated evenly"):
        head_slice(4, 2, 0, 6)


def test_layout_of_rank_of_8_matches_the_sharded_config_shapes():
    full = MiniMaxM3Config.real().first_layers(4)
    sh = full.shard(8, 8)
    layout = checkpoint_layout(full, rank=5, world=8)
    q = layout["model.layers.3.self_attn.q_proj.weight"]
    assert q.shape == (full.q_size, full.hidden_size) and q.source == (slice(5 * 1024, 6 * 1024),)
    k = layout["model.layers.3.self_attn.k_proj.weight"]
    assert k.source == (slice(2 * 128, 3 * 128),)  # kv head 5 // 2
    ik = layout["model.layers.3.self_attn.index_k_proj.weight"]
    assert ik.source == () and ik.index[0].stop == sh.qkv_size(3)  # replicated, last rows of qkv
    held = [e for e in range(128) if layout[f"model.layers.3.block_sparse_moe.experts.{e}.w2.weight"].param]
    assert held == list(range(80, 96))
    assert layout["lm_head.weight"].source == (slice(5 * 25008, 6 * 25008),)


def test_nccl_environment_is_graph_safe_and_keeps_an_explicit_choice():
    env: dict[str, str] = {}
    assert configure_nccl(env) == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    env = {"NCCL_CUMEM_ENABLE": "1"}
    assert configure_nccl(env)["NCCL_CUMEM_ENABLE"] == "1"


def test_a_group_that_does_not_fit_the_config_is_refused():
    group = ParallelGroup(rank=0, world_size=2, device=ParallelGroup.single().device, pg=object())
    with pytest.raises(ValueError, match=r"2 ranks but the config is sharded tp_size=1.*shard\(2, 2\)"):
        MiniMaxM3ForCausalLM(MiniMaxM3Config.tiny(), group=group)


def test_tp_flag_needs_torchrun_with_that_many_ranks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert group_for_tp(None, "cpu") is None
    with pytest.raises(SystemExit, match="torchrun --nproc-per-node 2"):
        group_for_tp(2, "cpu")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit, match="WORLD_SIZE is 4"):
        group_for_tp(2, "cpu")
