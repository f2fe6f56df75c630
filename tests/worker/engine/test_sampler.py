"""Sampler: greedy rows, the counter-based noise, top-k / top-p masks, and that Gumbel-max sampling
draws from softmax(logits / T). All draws use fixed seeds, so the statistical checks cannot flake."""

from __future__ import annotations

import math

import pytest
import torch

from worker.engine.sampler import apply_top_k_top_p, sample, uniform_noise


def i32(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32)


def f32(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32)


def draw(logits, temperature=1.0, top_p=1.0, top_k=0, seed=7, positions=None) -> torch.Tensor:
    """Sample one row per position (same logits, same seed): the positions are independent draws."""
    if positions is None:
        positions = torch.arange(logits.shape[0], dtype=torch.int32)
    rows = logits.shape[0]
    return sample(
        logits,
        f32([temperature] * rows),
        f32([top_p] * rows),
        i32([top_k] * rows),
        i32([seed] * rows),
        positions,
        any_random=temperature > 0,
        any_top_k_top_p=top_k > 0 or top_p < 1,
    )


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_rows_equal_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temps = f32([0.0, 1.0, 0.0, 0.7, 0.0, 2.0])
    out = sample(logits, temps, f32([1.0] * 6), i32([0] * 6), i32(range(6)), i32(range(6)), True, False)
    assert out.dtype == torch.int32
    greedy = logits.argmax(-1)
    for row in (0, 2, 4):
        assert out[row] == greedy[row]
    out = sample(
        logits, f32([0.0] * 6), f32([1.0] * 6), i32([0] * 6), i32(range(6)), i32(range(6)), False, False
    )
    assert out.tolist() == greedy.tolist()
    # Greedy ignores top-k / top-p: the argmax always survives both cuts anyway.
    out = sample(
        logits, f32([0.0] * 6), f32([0.1] * 6), i32([1] * 6), i32(range(6)), i32(range(6)), True, True
    )
    assert out.tolist() == greedy.tolist()


def test_uniform_noise_is_a_pure_function_of_seed_position_and_vocab_id():
    seeds, positions = i32([3, 3, 4, 3]), i32([10, 11, 10, 10])
    noise = uniform_noise(seeds, positions, 100)
    assert noise.shape == (4, 100) and noise.dtype == torch.float32
    torch.testing.assert_close(noise, uniform_noise(seeds, positions, 100), rtol=0, atol=0)
    torch.testing.assert_close(noise[0], noise[3], rtol=0, atol=0)  # same (seed, position), other row
    # A row does not depend on the rest of the batch, nor on the vocab size (a prefix of a larger vocab).
    alone = uniform_noise(i32([4]), i32([10]), 300)
    torch.testing.assert_close(noise[2], alone[0, :100], rtol=0, atol=0)
    # Different seeds or positions give unrelated rows.
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert (noise[a] == noise[b]).float().mean() < 0.05, (a, b)
    assert (noise[0, :-1] == noise[0, 1:]).float().mean() < 0.05, "vocab ids must not repeat values"


def test_uniform_noise_is_in_the_open_unit_interval_and_uniform():
    # 12.8M draws: enough to hit the largest 23-bit value (a 24-bit version rounded it up to exactly 1.0,
    # whose Gumbel noise is +inf; seed 0 hit it at position 33593).
    lo, hi, total, total_sq = 1.0, 0.0, 0.0, 0.0
    n = 0
    for start in range(0, 40_000, 10_000):
        positions = torch.arange(start, start + 10_000, dtype=torch.int32)
        u = uniform_noise(torch.zeros_like(positions), positions, 320).double()
        lo, hi = min(lo, u.min().item()), max(hi, u.max().item())
        total += u.sum().item()
        total_sq += (u * u).sum().item()
        n += u.numel()
        gumbel = -torch.log(-torch.log(u.float()))
        assert torch.isfinite(gumbel).all()
    assert 0.0 < lo < 1e-5 and 1 - 1e-5 < hi < 1.0
    mean = total / n
    var = total_sq / n - mean * mean
    assert abs(mean - 0.5) < 1e-3 and abs(var - 1 / 12) < 1e-3


def test_top_k_keeps_exactly_the_k_largest():
    torch.manual_seed(1)
    logits = torch.randn(4, 40)
    masked = apply_top_k_top_p(logits, i32([1, 5, 0, 40]), f32([1.0] * 4))
    for row, k in enumerate([1, 5, 40, 40]):
        kept = torch.isfinite(masked[row]).nonzero().flatten()
        assert len(kept) == k, row
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())
        torch.testing.assert_close(masked[row, kept], logits[row, kept])  # kept logits unchanged, in place


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.2, 0.1])  # sorted: 0.5, 0.2, 0.15, 0.1, 0.05
    logits = probs.log().repeat(7, 1)
    top_p = f32([0.01, 0.45, 0.55, 0.84, 0.86, 0.99, 1.0])
    masked = apply_top_k_top_p(logits, i32([0] * 7), top_p)
    kept = [sorted(torch.isfinite(row).nonzero().flatten().tolist()) for row in masked]
    assert kept == [
        [1],  # the first token always stays
        [1],
        [1, 3],  # 0.5 < 0.55 <= 0.7
        [0, 1, 3],  # 0.7 < 0.84 <= 0.85
        [0, 1, 3, 4],
        [0, 1, 2, 3, 4],
        [0, 1, 2, 3, 4],
    ]


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).log()[None]
    # top-2 renormalises to (0.714, 0.286): p = 0.6 is reached by the first token alone.
    masked = apply_top_k_top_p(logits, i32([2]), f32([0.6]))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0]
    masked = apply_top_k_top_p(logits, i32([2]), f32([0.75]))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0, 1]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_matches_softmax_probabilities(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0])
    num_draws = 40_000
    tokens = draw(logits.repeat(num_draws, 1), temperature=temperature, seed=1234)
    counts = torch.bincount(tokens.long(), minlength=8).double()
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4 for a correct sampler; a wrong temperature gives thousands.
    assert chi_square(counts, probs) < 30, (counts / num_draws, probs)
    wrong = torch.softmax(logits.double() / (temperature * 1.2), dim=-1)
    assert chi_square(counts, wrong) > 100, "the test must tell a 20% temperature error apart"


def test_sampling_with_top_k_and_top_p_matches_the_truncated_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    num_draws = 30_000
    tokens = draw(logits.repeat(num_draws, 1), top_k=4, top_p=0.8, seed=99)
    probs = torch.softmax(logits.double(), dim=-1)
    top4 = probs[:4] / probs[:4].sum()  # (0.40, 0.24, 0.15, 0.09)/.. -> cumulative 0.45, 0.72, 0.89: keep 3
    assert top4[:2].sum() < 0.8 <= top4[:3].sum()
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:3] = top4[:3] / top4[:3].sum()
    counts = torch.bincount(tokens.long(), minlength=6).double()
    assert counts[3:].sum() == 0, "a masked token was sampled"
    assert chi_square(counts, expected) < 25, (counts / num_draws, expected)


def test_masked_tokens_are_never_sampled():
    """top_k = 1 at temperature 1 must always give the argmax, whatever the noise (12.8M noise values)."""
    torch.manual_seed(2)
    logits = torch.randn(320)
    logits[17] = logits.max() + 0.1
    for start in range(0, 40_000, 10_000):
        positions = torch.arange(start, start + 10_000, dtype=torch.int32)
        tokens = draw(logits.repeat(len(positions), 1), top_k=1, seed=0, positions=positions)
        bad = (tokens != 17).nonzero().flatten()
        assert len(bad) == 0, f"positions {(bad[:5] + start).tolist()} sampled {tokens[bad[:5]].tolist()}"


def test_sampled_tokens_depend_only_on_seed_and_position():
    torch.manual_seed(3)
    logits = torch.randn(1, 64)
    rows = logits.repeat(5, 1)
    seeds, positions = i32([11, 11, 12, 11, 11]), i32([40, 41, 40, 40, 42])
    temps = f32([1.0, 1.0, 1.0, 1.0, 0.0])
    out = sample(rows, temps, f32([1.0] * 5), i32([0] * 5), seeds, positions, True, False)
    alone = sample(logits, f32([1.0]), f32([1.0]), i32([0]), i32([11]), i32([40]), True, False)
    assert out[0] == out[3] == alone[0]
    # Different positions and seeds of a flat-ish distribution give different tokens across many draws.
    many = draw(rows[:1].repeat(200, 1), seed=11)
    assert len(set(many.tolist())) > 30
    other = draw(rows[:1].repeat(200, 1), seed=12)
    assert (many != other).float().mean() > 0.8
    assert math.isclose(float(out[4]), float(logits.argmax()))
