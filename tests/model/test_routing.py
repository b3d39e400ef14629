"""Routing like a deployment: the calibrated bias of random weights, the routing simulation and
the expert spread (``models.minimax_m3.routing``), on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.paged import DEV

from graphcap import CaptureConfig
from graphcap.startup.tuning import KernelTuner
from models.minimax_m3 import build_from_preset
from models.minimax_m3.config import MiniMaxM3Config
from models.minimax_m3.layers import BlockSparseMoE
from models.minimax_m3.ops import FusedMoE, TorchMoE, make_ops
from models.minimax_m3.routing import (
    RoutingSimulation,
    RoutingSpread,
    balanced_bias,
    measure_routing_spread,
    routing_simulation,
    select_experts,
)
from steps import TokenChunk


def many_experts(num_layers: int = 4) -> MiniMaxM3Config:
    """The tiny model with 64 experts, top-4: enough experts that a concentrated router shows."""
    c = MiniMaxM3Config.tiny()
    return dataclasses.replace(c, num_local_experts=64, num_experts_per_tok=4, num_hidden_layers=num_layers,
                               moe_layer_freq=(0,) + (1,) * (num_layers - 1),
                               sparse_attention_freq=(0,) + (1,) * (num_layers - 1))


def expert_parallel() -> MiniMaxM3Config:
    """128 experts, top-4, one rank of 8 (16 local experts), as rank-of-8 routes."""
    c = dataclasses.replace(many_experts(), num_local_experts=128)
    return dataclasses.replace(c.shard(1, 8), tp_size=1)


def spread(config: MiniMaxM3Config, balance: bool, routing: str = "model") -> RoutingSpread:
    runner = build_from_preset(config, max_tokens=512, max_seqs=32, max_seq_len=64, routing=routing,
                               balance_routing=balance)
    s = measure_routing_spread(runner, batch=32)
    assert s is not None and s.tokens == 32
    return s


@pytest.mark.parametrize("make", [many_experts, expert_parallel], ids=["64-experts", "ep8-of-128"])
def test_init_random_balances_routing_like_uniform(make):
    """A decode step of 32 requests touches >= 0.9x the distinct experts uniform routing would
    once the bias is calibrated; the raw random router does not (so the check can fail)."""
    config = make()
    raw, balanced = spread(config, balance=False), spread(config, balance=True)
    assert balanced.ratio >= 0.9, balanced.describe()
    assert raw.ratio < balanced.ratio
    assert balanced.mean_pairs == pytest.approx(balanced.uniform_pairs, rel=0.35)
    if make is many_experts:
        assert raw.ratio < 0.8, raw.describe()  # the collapse the calibration removes
        assert "WARNING" in raw.describe() and "WARNING" not in balanced.describe()


def test_spread_reports_pairs_per_touched_expert():
    """The spread line gives the pairs a touched local expert holds (mean pairs over mean distinct
    experts), what an MoE kernel's pair tiles see; no expert touched reads 0."""
    s = RoutingSpread("uniform", tokens=8, top_k=4, num_experts=128, local=16, distinct=(2, 4), pairs=(6, 10))
    assert s.pairs_per_expert == pytest.approx(8 / 3)
    assert "2.7 per touched expert" in s.describe() and s.as_dict()["pairs_per_expert"] == pytest.approx(8 / 3)
    assert RoutingSpread("uniform", 1, 4, 128, 16, (0,), (0,)).pairs_per_expert == 0.0


def test_calibrated_bias_is_deterministic_and_leaves_the_model_detached():
    config = many_experts()
    a = build_from_preset(config, max_tokens=64, max_seqs=4, max_seq_len=64)
    b = build_from_preset(config, max_tokens=64, max_seqs=4, max_seq_len=64)
    bias_a = [m.e_score_correction_bias for m in a.model.modules() if hasattr(m, "e_score_correction_bias")]
    bias_b = [m.e_score_correction_bias for m in b.model.modules() if hasattr(m, "e_score_correction_bias")]
    assert len(bias_a) == 3 and all(torch.equal(x, y) for x, y in zip(bias_a, bias_b))
    assert all(float(x.abs().max()) > 0 for x in bias_a)
    # the runner's model is attached to its own cache (calibration's private one is gone)
    assert a.model.cache is a.cache and a.model.backend is a.backend
    assert a.model.ops.name.startswith("torch")


def test_balanced_bias_evens_a_skewed_load():
    gen = torch.Generator().manual_seed(0)
    common = torch.randn(1, 32, generator=gen) * 3  # one shared direction dominates every row
    scores = torch.sigmoid(common + 0.3 * torch.randn(2048, 32, generator=gen))
    before = torch.bincount(torch.topk(scores, 4).indices.flatten(), minlength=32)
    after = torch.bincount(torch.topk(scores + balanced_bias(scores, 4), 4).indices.flatten(), minlength=32)
    target = 2048 * 4 / 32
    assert before.max() > 4 * target  # skewed
    assert (after.float() - target).abs().max() < 0.25 * target


@pytest.mark.parametrize("strategy", ["uniform", "balanced"])
def test_simulation_keeps_padding_and_dtype_and_is_deterministic(strategy):
    sim = RoutingSimulation(strategy)
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    ids = torch.full((10, 4), 3, dtype=torch.int32)
    ids[7:] = -1  # padded rows
    out = sim(x, ids, 128)
    assert out.dtype == torch.int32 and out.shape == ids.shape
    assert (out[7:] == -1).all() and (out[:7] >= 0).all() and (out[:7] < 128).all()
    assert all(len(set(row.tolist())) == 4 for row in out[:7])  # k distinct experts per token
    assert torch.equal(out, sim(x, ids, 128))


def test_uniform_simulation_spreads_like_uniform_picks():
    """Over many steps of 32 tokens the distinct experts per step match the uniform expectation
    (within 5%), and every expert is picked about equally often."""
    sim = RoutingSimulation("uniform")
    gen = torch.Generator().manual_seed(2)
    distinct, counts = [], torch.zeros(128)
    for _ in range(64):
        x = torch.randn(32, 64, generator=gen)
        out = sim(x, torch.zeros(32, 4, dtype=torch.int64), 128)
        distinct.append(torch.unique(out).numel())
        counts += torch.bincount(out.flatten(), minlength=128)
    expected = 128 * (1 - (1 - 4 / 128) ** 32)
    assert sum(distinct) / len(distinct) == pytest.approx(expected, rel=0.05)
    assert counts.max() < 2.0 * counts.mean() and counts.min() > 0.3 * counts.mean()


def test_balanced_simulation_loads_every_expert_evenly_and_spreads_ranks():
    out = RoutingSimulation("balanced")(torch.zeros(32, 64), torch.zeros(32, 4, dtype=torch.int64), 128)
    assert torch.equal(torch.bincount(out.flatten(), minlength=128), torch.ones(128, dtype=torch.int64))
    first8 = out.flatten()[:8] // 16  # the first picks land on different ranks of 8
    assert len(set(first8.tolist())) >= 6


def test_routing_names_are_checked():
    assert routing_simulation("model") is None
    with pytest.raises(ValueError, match=r"routing='hash': choose one of \('model', 'uniform', 'balanced'\)"):
        routing_simulation("hash")
    with pytest.raises(ValueError, match="routing='hash'"):
        make_ops("torch", "cpu", torch.float32, routing="hash")


@pytest.mark.parametrize("routing", ["uniform", "balanced"])
def test_simulated_routing_runs_through_the_op_table(routing):
    """The op table carries the simulation; the measured spread reports it, and a balanced step
    touches every expert a rank holds."""
    s = spread(expert_parallel(), balance=True, routing=routing)
    assert s.routing == routing
    if routing == "balanced":
        assert s.distinct == (16,) * len(s.distinct)
        assert s.pairs == (16,) * len(s.pairs)
    else:
        assert s.ratio > 0.85


def test_spread_measurement_leaves_requests_and_pages_alone():
    runner = build_from_preset(many_experts(), max_tokens=128, max_seqs=8, max_seq_len=64,
                               capture=CaptureConfig(enabled=True, debug_eager=True, max_tokens=128))
    runner.add_request("mine")
    before = runner.step([TokenChunk("mine", 0, [1, 2, 3])]).logits.clone()
    free = runner.num_free_pages
    s = measure_routing_spread(runner, batch=32)
    # capped by the step's request capacity (8) and the free request slots (one is taken)
    assert s.tokens == min(8, runner.max_live_requests - 1)
    assert runner.num_free_pages == free and runner.num_written("mine") == 3
    own = measure_routing_spread(runner, step=[TokenChunk("mine", 3, [4])])  # a step of the caller's own
    assert own.tokens == 1 and all(p == 4 for p in own.pairs)  # one token, its 4 picks (all local)
    assert runner.num_written("mine") == 3  # not committed
    runner.rewind_request("mine", 0)
    assert torch.equal(runner.step([TokenChunk("mine", 0, [1, 2, 3])]).logits, before)


def test_uniform_expectation_formula():
    s = RoutingSpread("model", tokens=1, top_k=4, num_experts=128, local=16, distinct=(1,), pairs=(1,))
    assert s.uniform_distinct == pytest.approx(16 * 4 / 128)
    assert s.uniform_pairs == pytest.approx(0.5)


DRAWS = 5  # decode batches whose expert spread the GPU test averages


def uniform_mean_distinct_floor(draws: int, tokens: int, top_k: int, experts: int, local: int,
                                quantile: float = 1e-3, samples: int = 20000) -> float:
    """The ``quantile`` of the mean, over ``draws`` batches of ``tokens`` tokens each picking
    ``top_k`` distinct experts of ``experts`` uniformly, of the distinct experts among
    ``local`` of them a batch touches (Monte Carlo, fixed seed)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    picks = torch.rand(samples * draws * tokens, experts, generator=g, device=DEV).argsort(1)[:, :top_k]
    picks = picks.reshape(samples * draws, tokens * top_k)
    touched = torch.stack([(picks == e).any(1) for e in range(local)], 1).sum(1).float()
    return float(torch.quantile(touched.view(samples, draws).mean(1), quantile))


def test_uniform_mean_distinct_floor():
    """The floor sits below the uniform expectation and tightens with more batches."""
    one, five = (uniform_mean_distinct_floor(n, 32, 4, 128, 16, samples=2000) for n in (1, 5))
    expected = 16 * (1 - (1 - 4 / 128) ** 32)  # 10.2
    assert one < five < expected and five > 0.7 * expected and one < 0.5 * expected


@pytest.mark.cuda
@pytest.mark.parametrize("routing", ["model", "uniform", "balanced"])
def test_simulated_routing_replays_bit_exact_to_padded_eager_on_gpu(routing):
    """rank-of-8 shapes (4 layers) with the fused kernels: the simulation runs inside the
    captured graphs, and every replay equals the padded debug-eager run of the same step bit for
    bit; the calibrated model and the uniform simulation spread like uniform routing (the mean
    of several decode batches), the balanced one over every local expert."""
    config = MiniMaxM3Config.rank_of_8().first_layers(4)
    buckets = (1, 2, 4, 8, 32)
    capture = CaptureConfig(enabled=True, max_tokens=64, buckets=buckets)
    graphed = build_from_preset(config, "cuda", torch.bfloat16, max_tokens=64, max_seqs=32, max_seq_len=96,
                                capture=capture, routing=routing)
    padded = graphed.with_capture(dataclasses.replace(capture, debug_eager=True))
    spreads = [measure_routing_spread(graphed, batch=32, seed=seed) for seed in range(DRAWS)]
    assert all(s.routing == routing for s in spreads)
    if routing == "balanced":
        assert all(s.distinct == (16,) * len(s.distinct) for s in spreads), spreads[0].describe()
    else:
        # One MoE layer: one batch of 32 uniform tokens touches 10.2 of 16 local experts with a
        # spread of 1.85, below 0.8x 18% of the time, so one batch cannot tell realistic from
        # concentrated. The mean of DRAWS batches must reach what uniform routing's mean reaches
        # 99.9% of the time (the concentrated random router read 3.7).
        mean = sum(s.distinct[0] for s in spreads) / DRAWS
        assert mean >= uniform_mean_distinct_floor(DRAWS, 32, 4, 128, 16), [s.describe() for s in spreads]
    graphed.capture()
    assert graphed.validate() == {}
    gen = torch.Generator().manual_seed(0)
    for i in range(8):
        graphed.add_request(i)
    # 7 x 8 prompt tokens (above the largest graph: eager), decodes of 8 and 3, a 5-token chunk
    for n, rows in ((8, 7), (1, 8), (1, 3), (5, 1)):
        chunks = [TokenChunk(i, graphed.num_written(i), torch.randint(0, 1000, (n,), generator=gen).tolist())
                  for i in range(rows)]
        ref = padded.run_chunks(chunks, commit=False, all_logits=True).clone()
        out = graphed.run_chunks(chunks, all_logits=True)
        assert torch.equal(out, ref)
    hits = sum(b.hits for b in graphed.manager.stats.buckets.values())
    assert hits == 3


def expert_parallel_moe(rank: int) -> BlockSparseMoE:
    """32 experts, top-4, this rank holds 8 of them (rank ``rank`` of 4)."""
    g = torch.Generator().manual_seed(5)
    m = BlockSparseMoE(64, 32, 8, 4, 16, 24, 2.0, 1.702, 7.0, torch.float32, expert_offset=8 * rank)
    for _name, p in m.requires_grad_(False).named_parameters():
        p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return m


@pytest.mark.parametrize("strategy", ["uniform", "balanced"])
@pytest.mark.parametrize("rank", [0, 3])
def test_fused_routing_simulation_picks_what_the_torch_one_picks(strategy, rank):
    """The fused MoE's simulation, inside the router's top-k kernel (``kernels.routing_sim``;
    the interpreter on CPU, the GPU when there is one) keeps exactly the torch simulation's
    picks that this rank holds, with the router's weights, and the fused MoE under it equals the torch MoE under it."""
    moe, sim = expert_parallel_moe(rank).to(DEV), RoutingSimulation(strategy)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(6)).to(DEV)
    n = torch.tensor([5], device=DEV)
    ids, w, aligned = FusedMoE._route(moe, x, n, sim, align=True)
    ref_ids, ref_w = select_experts(moe, x, n, sim)  # global ids, every pick's weight
    local = ref_ids - 8 * rank
    held = (ref_ids >= 0) & (local >= 0) & (local < 8)
    assert torch.equal(ids, torch.where(held, local, -1).to(torch.int32))
    torch.testing.assert_close(w, torch.where(held, ref_w, 0.0), rtol=1e-6, atol=1e-7)
    assert held.any() and (ids[5:] == -1).all()
    from models.minimax_m3.kernels.moe_align import moe_align

    want = moe_align(ids, 8)  # the alignment the router's last program made of the same ids
    assert torch.equal(aligned.off, want.off) and torch.equal(aligned.pair_pos, want.pair_pos)
    fused = FusedMoE(KernelTuner(time_candidates=False), sim)(moe, x, n)
    torch.testing.assert_close(fused, TorchMoE(True, sim)(moe, x, n), rtol=1e-4, atol=1e-5)
