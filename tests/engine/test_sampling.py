"""Token sampling: SamplingParams validation and Sampler's torch and flashinfer paths.

CPU: greedy rows are argmax bit for bit, top-k and top-p never let a filtered token through,
empirical frequencies match the filtered softmax (fixed generator seeds, so no flakes), seeded
rows are reproducible wherever they sit in a batch. GPU: flashinfer and torch against the same
filtered softmax, top_k=1 == argmax, large-vocab filters, and no host sync in either backend.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import Sampler, SamplingParams, row_seed

P = SamplingParams


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference: the distribution a row should be drawn from (fp64, ``[vocab]``).

    softmax(logits / T) restricted to the top_k largest, renormalized, then restricted to the
    smallest prefix (by descending probability) whose mass reaches top_p, renormalized.
    """
    x = logits.double() / p.temperature
    probs = torch.softmax(x, -1)
    order = probs.argsort(descending=True, stable=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = p.top_k or probs.numel()
    keep[order[:k]] = True
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    mass = 0.0
    for j, idx in enumerate(order[:k].tolist()):
        if j > 0 and mass >= p.top_p and p.top_p < 1:
            keep[idx] = False
        mass += probs[idx].item()
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def draw(sampler: Sampler, row: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    """``n`` draws of one row in one call (the row repeated ``n`` times)."""
    return sampler.sample(row[None, :].expand(n, -1).contiguous(), [p] * n)


def check_frequencies(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Zero-probability tokens never appear; the rest pass a chi-square test (df <= 7, p ~ 1e-4)."""
    counts = torch.bincount(tokens.cpu(), minlength=expected.numel()).double()
    n = tokens.numel()
    zero = expected == 0
    assert counts[zero].sum() == 0, f"filtered tokens drawn: {counts.tolist()} vs {expected.tolist()}"
    exp = expected[~zero] * n
    chi2 = ((counts[~zero] - exp) ** 2 / exp).sum().item()
    assert chi2 < 30.0, f"chi2={chi2:.1f}: {(counts / n).tolist()} vs {expected.tolist()}"
    assert (counts / n - expected).abs().max() < 0.015


@pytest.fixture
def sampler() -> Sampler:
    s = Sampler("cpu")
    s.generator.manual_seed(1234)  # deterministic draws: the statistical tests cannot flake
    return s


LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, -0.3, -1.0, -2.0])
# Probabilities 0.5, 0.3, 0.1, 0.05, 0.05: the nucleus of each top_p is known in advance.
NUCLEUS = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]).log()


# ---- SamplingParams -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, r"top_k must be an int >= 0"),
        ({"top_k": True}, r"top_k must be an int >= 0"),
        ({"top_k": 2.0}, r"top_k must be an int >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_p": math.nan}, r"top_p must be in \(0, 1\]"),
        ({"seed": -1}, r"seed must be None or an int in \[0, 2\*\*64\)"),
        ({"seed": 1.0}, "seed"),
    ],
)
def test_params_validation_names_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_defaults_and_greedy():
    assert P().greedy and P(temperature=1.0, top_k=1).greedy
    assert not P(temperature=0.5).greedy and not P(temperature=1.0, top_k=2, top_p=0.9, seed=3).greedy
    with pytest.raises(AttributeError):
        P().temperature = 1.0  # frozen


# ---- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_bit_exact(sampler, dtype):
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[3, [10, 20]] = 100.0  # a tie: argmax's own choice must win
    ref = logits.argmax(-1)
    everyone_greedy = sampler.sample(logits, [P()] * 64)  # fast path
    assert torch.equal(everyone_greedy, ref) and everyone_greedy.dtype == torch.int64
    mixed = [P() if i % 3 == 0 else P(temperature=2.0, top_k=1) if i % 3 == 1 else P(temperature=5.0)
             for i in range(64)]
    out = sampler.sample(logits, mixed)
    greedy_rows = torch.tensor([p.greedy for p in mixed])
    assert torch.equal(out[greedy_rows], ref[greedy_rows])
    # flat-ish logits at T=5: the sampled rows do not all collapse to argmax
    assert (out[~greedy_rows] != ref[~greedy_rows]).any()


def test_output_dtype_device_shape(sampler):
    logits = torch.randn(5, 33, dtype=torch.bfloat16)
    for params in ([P()] * 5, [P(temperature=1.0)] * 5, [P(temperature=1.0, top_k=3, top_p=0.5, seed=1)] * 5):
        out = sampler.sample(logits, params)
        assert out.dtype == torch.int64 and out.shape == (5,) and out.device == logits.device
        assert ((out >= 0) & (out < 33)).all()
    assert sampler.sample(torch.randn(0, 33), []).shape == (0,)


def test_sample_rejects_bad_inputs(sampler):
    with pytest.raises(ValueError, match="2 logits rows but 1 params"):
        sampler.sample(torch.randn(2, 8), [P()])
    with pytest.raises(ValueError, match=r"float \[n, vocab\]"):
        sampler.sample(torch.randn(8), [P()])
    with pytest.raises(ValueError, match=r"float \[n, vocab\]"):
        sampler.sample(torch.zeros(1, 8, dtype=torch.int64), [P()])
    with pytest.raises(ValueError, match="offsets"):
        sampler.sample(torch.randn(2, 8), [P(temperature=1.0)] * 2, offsets=[0])


# ---- filters and frequencies ------------------------------------------------------------------


def test_top_k_never_outside_the_k_largest(sampler):
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(1))
    for k in (1, 2, 7):
        params = [P(temperature=3.0, top_k=k)] * 4  # hot temperature: the tail would be drawn often
        tokens = sampler.sample(logits.repeat(500, 1), params * 500).view(500, 4)
        allowed = logits.topk(k, dim=-1).indices
        for r in range(4):
            assert torch.isin(tokens[:, r], allowed[r]).all()
            assert set(tokens[:, r].tolist()) == set(allowed[r].tolist())  # all k reachable


@pytest.mark.parametrize(
    "top_p, nucleus", [(0.3, {0}), (0.5, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3, 4})]
)
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(sampler, top_p, nucleus):
    # 0.5 reaches 0.5 alone: the second token is dropped. At least one token always stays (0.3).
    p = P(temperature=1.0, top_p=top_p)
    tokens = draw(sampler, NUCLEUS, p, 20000)
    assert set(tokens.tolist()) == nucleus
    check_frequencies(tokens, filtered_probs(NUCLEUS, p))


def test_top_p_applies_to_the_top_k_renormalized_distribution(sampler):
    # top_k=2 leaves 0.4/0.7 and 0.3/0.7; 0.571 >= 0.5 so top_p keeps token 0 alone (top-p on the
    # raw probabilities would have kept both: 0.4 < 0.5).
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert set(draw(sampler, logits, P(temperature=1.0, top_k=2, top_p=0.5), 2000).tolist()) == {0}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_frequencies_match_softmax(sampler, temperature):
    p = P(temperature=temperature)
    tokens = draw(sampler, LOGITS8, p, 20000)
    check_frequencies(tokens, torch.softmax(LOGITS8.double() / temperature, -1))


def test_combined_filters_frequencies(sampler):
    for p in (P(temperature=0.8, top_k=5), P(temperature=1.3, top_k=6, top_p=0.8), P(temperature=1.0, top_p=0.9)):
        check_frequencies(draw(sampler, LOGITS8, p, 20000), filtered_probs(LOGITS8, p))


def test_bf16_logits_are_scaled_in_fp32(sampler):
    logits = LOGITS8.to(torch.bfloat16)
    p = P(temperature=0.7, top_k=4)
    check_frequencies(draw(sampler, logits, p, 20000), filtered_probs(logits.float(), p))


# ---- seeding ------------------------------------------------------------------------------------


def test_seeded_rows_reproducible_and_independent_of_the_batch():
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    seeded = [P(temperature=1.5, top_k=20, top_p=0.9, seed=40 + i) for i in range(8)]
    fillers = [P(temperature=1.0), P(), P(temperature=0.5, top_k=3)]
    # Batch A: seeded rows interleaved with unseeded ones, offsets 0..7.
    a_logits = torch.cat([torch.stack([logits[i], torch.randn(64)]) for i in range(8)])
    a_params = [q for i in range(8) for q in (seeded[i], fillers[i % 3])]
    a_offsets = [o for i in range(8) for o in (i, 0)]
    a = Sampler("cpu").sample(a_logits, a_params, offsets=a_offsets)[0::2]
    # Batch B: another sampler (other generator state), the seeded rows reversed behind fillers.
    b_sampler = Sampler("cpu")
    b_sampler.generator.manual_seed(999)
    b_logits = torch.cat([torch.randn(3, 64), logits.flip(0)])
    b = b_sampler.sample(b_logits, fillers + seeded[::-1], offsets=[0, 0, 0] + list(range(7, -1, -1)))[3:]
    assert torch.equal(a, b.flip(0))
    # a different offset redraws: not every row keeps its token
    c = Sampler("cpu").sample(logits, seeded, offsets=[100] * 8)
    assert not torch.equal(a, c)


def test_seeded_rows_vary_with_seed_and_offset_and_follow_the_distribution():
    n = 4000
    logits = LOGITS8[None, :].expand(n, -1).contiguous()
    s = Sampler("cpu")
    by_seed = s.sample(logits, [P(temperature=1.0, seed=i) for i in range(n)])
    by_offset = s.sample(logits, [P(temperature=1.0, seed=7)] * n, offsets=range(n))
    expected = torch.softmax(LOGITS8.double(), -1)
    for tokens in (by_seed, by_offset):
        counts = torch.bincount(tokens, minlength=8).double() / n
        assert (counts - expected).abs().max() < 0.03  # rows are decorrelated, not one stream
    again = s.sample(logits[:50], [P(temperature=1.0, seed=7)] * 50, offsets=range(50))
    assert torch.equal(again, by_offset[:50])


def test_row_seed_mixes_both_inputs_into_the_low_bits():
    low = {row_seed(s, o) & 0xFFFFFFFF for s in (0, 1, 1 << 32) for o in range(100)}
    assert len(low) == 300


# ---- backend choice ------------------------------------------------------------------------


def test_cpu_uses_torch_and_says_why():
    s = Sampler("cpu")
    assert s.backend == "torch" and "cpu" in s.why
    assert Sampler("cpu", use_flashinfer=False).why == "use_flashinfer=False"
    with pytest.raises(RuntimeError, match="use_flashinfer=True but device is cpu"):
        Sampler("cpu", use_flashinfer=True)


# ---- GPU: flashinfer against torch --------------------------------------------------------------

GPU_CASES = [
    P(temperature=1.0),
    P(temperature=0.8, top_k=3),
    P(temperature=1.0, top_p=0.75),
    P(temperature=1.3, top_k=5, top_p=0.8),
    P(temperature=2.0, top_k=6, top_p=0.95),
]


@pytest.mark.cuda
def test_flashinfer_matches_torch_statistically_on_gpu():
    pytest.importorskip("flashinfer")
    fi, th = Sampler("cuda", use_flashinfer=True), Sampler("cuda", use_flashinfer=False)
    assert (fi.backend, th.backend) == ("flashinfer", "torch")
    fi.generator.manual_seed(0)
    th.generator.manual_seed(0)
    gen = torch.Generator().manual_seed(3)

    # top_k=1 is argmax: through sample() (greedy route) and through flashinfer's own top-k kernel.
    logits = torch.randn(256, 1000, generator=gen).cuda()
    ref = logits.argmax(-1)
    for s in (fi, th):
        assert torch.equal(s.sample(logits, [P(temperature=1.0, top_k=1)] * 256), ref)
    k1 = torch.ones(256, dtype=torch.int32, device="cuda")
    one = torch.ones(256, device="cuda")
    assert torch.equal(fi._flashinfer_draw(logits, k1, one, True, False, []), ref)

    # Small vocab: every filter against the reference distribution, both backends.
    for row in (LOGITS8, torch.cat([NUCLEUS, torch.full((3,), -30.0)])):
        for p in GPU_CASES:
            expected = filtered_probs(row, p)
            for s in (fi, th):
                tokens = draw(s, row.cuda(), p, 20000)
                assert tokens.dtype == torch.int64 and tokens.is_cuda
                check_frequencies(tokens, expected)

    # Real vocab: no token outside the top-k set or the top-p nucleus, over many draws.
    vocab, n = 151_552, 2048
    big = (torch.randn(4, vocab, generator=gen) * 3).cuda()
    for s in (fi, th):
        tokens = s.sample(big.repeat(n // 4, 1), [P(temperature=1.5, top_k=20)] * n).view(-1, 4)
        allowed = big.topk(20, dim=-1).indices
        for r in range(4):
            assert torch.isin(tokens[:, r], allowed[r]).all()
        tokens = s.sample(big.repeat(n // 4, 1), [P(temperature=1.0, top_p=0.6)] * n).view(-1, 4)
        probs = torch.softmax(big.double(), -1)
        sorted_p, order = probs.sort(-1, descending=True)
        size = ((sorted_p.cumsum(-1) - sorted_p) < 0.6).sum(-1)  # nucleus size per row
        for r in range(4):
            nucleus = order[r, : size[r] + 1]  # one token of slack for fp32 vs fp64 rounding at the edge
            assert torch.isin(tokens[:, r], nucleus).all()


@pytest.mark.cuda
@pytest.mark.parametrize("use_flashinfer", [False, True])
def test_gpu_no_host_sync_greedy_exact_and_seeded(use_flashinfer):
    if use_flashinfer:
        pytest.importorskip("flashinfer")
    s = Sampler("cuda", use_flashinfer=use_flashinfer)
    logits = torch.randn(64, 32_000, device="cuda", dtype=torch.bfloat16)
    params = [P() if i % 2 else P(temperature=0.9, top_k=50, top_p=0.9, seed=i if i % 4 == 0 else None)
              for i in range(64)]
    s.sample(logits, params)  # warm-up: JIT and workspace allocation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = s.sample(logits, params, offsets=[5] * 64)
        fast = s.sample(logits, [P()] * 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = logits.argmax(-1)
    assert torch.equal(out[1::2], ref[1::2]) and torch.equal(fast, ref)
    # the seeded rows (every 4th), reversed into a batch of their own, same offset: same tokens
    rows = list(range(0, 64, 4))[::-1]
    moved = s.sample(logits[rows], [params[i] for i in rows], offsets=[5] * len(rows))
    assert torch.equal(moved, out[rows])
