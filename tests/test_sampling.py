"""Logits processing and seeded draws (swiftk.sample.logits)."""
import math

import pytest
import torch

from swiftk.errors import SwiftkError
from swiftk.sample.logits import (
    process_logits,
    sample,
    sample_without_replacement,
    validate_sampling_params,
)


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; a count in a zero-probability cell gives p = 0."""
    counts = counts.double().flatten()
    probs = expected_probs.double().flatten()
    n = counts.sum()
    if (counts[probs == 0] > 0).any():
        return 0.0
    keep = probs > 0
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---- process_logits -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_only_is_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([1.0, -2.0, 0.5, 3.0])
    got = process_logits(logits, temperature)
    scaled = [x / temperature for x in logits.tolist()]
    z = sum(math.exp(s) for s in scaled)
    want = torch.tensor([math.exp(s) / z for s in scaled])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


def test_top_k_keeps_k_largest_and_renormalises():
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0])
    got = process_logits(logits, 1.0, top_k=2)
    e4, e3 = math.exp(4.0), math.exp(3.0)
    torch.testing.assert_close(got, torch.tensor([0.0, e4 / (e4 + e3), 0.0, e3 / (e4 + e3)]))


def test_top_k_keeps_ties_at_the_boundary():
    got = process_logits(torch.tensor([1.0, 3.0, 3.0, 0.0]), 1.0, top_k=1)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.5, 0.5, 0.0]))


@pytest.mark.parametrize("top_k", [0, 4, 10])
def test_top_k_zero_or_at_least_vocab_is_a_no_op(top_k):
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0])
    torch.testing.assert_close(process_logits(logits, 1.0, top_k=top_k), torch.softmax(logits, -1))


@pytest.mark.parametrize(
    "top_p, keep",
    [(1e-6, [0]), (0.4, [0]), (0.75, [0, 1]), (0.81, [0, 1, 2]), (0.99, [0, 1, 2, 3])],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, keep):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    got = process_logits(probs.log(), 1.0, top_p=top_p)
    want = torch.zeros(4)
    want[keep] = probs[keep] / probs[keep].sum()
    torch.testing.assert_close(got, want)


def test_top_p_applies_after_top_k_and_temperature():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top-k=2 leaves [4/7, 3/7]; 4/7 >= 0.5 so top-p keeps one token (without top-k it would keep two).
    torch.testing.assert_close(process_logits(probs.log(), 1.0, top_k=2, top_p=0.5), torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(process_logits(probs.log(), 1.0, top_p=0.5), torch.tensor([4 / 7, 3 / 7, 0, 0]))
    # Temperature 0.5 squares the probabilities: [16, 9, 4, 1]/30; 16/30 >= 0.5.
    torch.testing.assert_close(process_logits(probs.log(), 0.5, top_p=0.5), torch.tensor([1.0, 0, 0, 0]))


def test_rows_are_processed_independently_and_masked_logits_stay_masked():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]], dtype=torch.float16)
    got = process_logits(logits, 1.0, top_k=2)
    assert got.dtype == torch.float32 and got.shape == (2, 4)
    torch.testing.assert_close(got[0], torch.softmax(torch.tensor([float("-inf"), float("-inf"), 1.0, 2.0]), -1))
    # Row 1 ties three ways for second place: all ties kept.
    torch.testing.assert_close(got[1], torch.softmax(torch.tensor([5.0, 0.0, 0.0, 0.0]), -1))


def test_temperature_zero_has_no_distribution():
    with pytest.raises(SwiftkError, match="argmax"):
        process_logits(torch.zeros(3), 0.0)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_p=-0.2), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(temperature=1.0, top_k=True), "top_k"),
    ],
)
def test_validation_errors_name_the_parameter(kwargs, word):
    with pytest.raises(SwiftkError, match=word):
        validate_sampling_params(**kwargs)
    with pytest.raises(SwiftkError, match=word):
        process_logits(torch.zeros(3), **kwargs)


def test_valid_parameters_pass_validation():
    validate_sampling_params(0.0, 0, 1.0)
    validate_sampling_params(0.7, 50, 0.9)


# ---- sample ---------------------------------------------------------------------------------------------------


def test_sample_is_reproducible_with_a_seeded_generator():
    probs = torch.softmax(torch.randn(8, 50, generator=gen(1)), -1)
    a = [sample(probs, gen(7)) for _ in range(3)]
    assert all(torch.equal(a[0], x) for x in a)
    g = gen(7)
    first, second = sample(probs, g), sample(probs, g)
    assert not torch.equal(first, second)  # the generator advances


def test_sample_shapes_and_support():
    probs = torch.tensor([0.0, 0.7, 0.0, 0.3])
    one = sample(probs, gen())
    assert one.shape == () and one.dtype == torch.long
    many = sample(probs.expand(20000, 4), gen())
    assert many.shape == (20000,)
    counts = torch.bincount(many, minlength=4)
    assert counts[0] == 0 and counts[2] == 0
    assert chi2_pvalue(counts, probs) > 1e-3


# ---- sample_without_replacement -------------------------------------------------------------------------------


def sequential_pair_probs(q: torch.Tensor) -> torch.Tensor:
    """Exact P(first = i, second = j) for two sequential draws, the second renormalised without i."""
    q = q.double()
    pair = q[:, None] * q[None, :] / (1 - q[:, None])
    pair.fill_diagonal_(0)
    return pair


def ordered_pair_counts(draws: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(draws[:, 0] * v + draws[:, 1], minlength=v * v).reshape(v, v)


def test_without_replacement_matches_sequential_draws():
    q = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 200_000
    draws = sample_without_replacement(q.expand(n, 5), 2, gen(3))
    assert draws.shape == (n, 2)
    assert (draws[:, 0] != draws[:, 1]).all()
    counts = ordered_pair_counts(draws, 5)
    exact = sequential_pair_probs(q)
    assert chi2_pvalue(counts, exact) > 1e-3
    tv = 0.5 * (counts.double() / n - exact).abs().sum()
    assert tv < 3 * math.sqrt(25 / n)


def test_pair_statistic_rejects_a_wrong_without_replacement_scheme():
    # Power check: the same statistic must reject a scheme with a different law (second token drawn from q**2,
    # renormalised without the first).
    q = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 200_000
    g = gen(4)
    first = torch.multinomial(q.expand(n, 5), 1, generator=g).squeeze(1)
    w = (q**2).expand(n, 5).clone()
    w[torch.arange(n), first] = 0
    second = torch.multinomial(w, 1, generator=g).squeeze(1)
    counts = ordered_pair_counts(torch.stack([first, second], 1), 5)
    assert chi2_pvalue(counts, sequential_pair_probs(q)) < 1e-6


def test_without_replacement_skips_zero_probability_until_support_is_exhausted():
    q = torch.tensor([0.0, 0.6, 0.0, 0.4])
    draws = sample_without_replacement(q.expand(1000, 4), 2, gen(5))
    assert set(draws.flatten().tolist()) == {1, 3}
    full = sample_without_replacement(q, 4, gen(5))
    assert sorted(full.tolist()) == [0, 1, 2, 3] and set(full[:2].tolist()) == {1, 3}


def test_without_replacement_is_reproducible():
    q = torch.softmax(torch.randn(100, generator=gen(2)), -1)
    assert torch.equal(sample_without_replacement(q, 10, gen(9)), sample_without_replacement(q, 10, gen(9)))


@pytest.mark.parametrize("k", [0, 5, -1, 1.0])
def test_without_replacement_rejects_bad_k(k):
    with pytest.raises(SwiftkError, match="k must be"):
        sample_without_replacement(torch.full((4,), 0.25), k, gen())
