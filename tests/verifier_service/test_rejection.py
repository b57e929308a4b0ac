"""Unit tests for verifier_service.core.rejection: greedy and sampled acceptance rules.

The statistical tests draw from fixed-seed generators, so they are
deterministic: they pass or fail the same way on every run. Each checks, with
Pearson's chi-square goodness-of-fit test, that emitted tokens follow the
target distribution p, which is what makes speculative sampling exact
(Leviathan et al. 2023, Thm. 1).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from verifier_service.core.rejection import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    accept_tree_greedy,
    accept_tree_sampled,
    greedy_choices,
    position_generator,
    rejection_sample,
    warp_probs,
)

# A correct sampler fails a fixed-seed test with this probability; kept small
# so that a failure means a bug, not bad luck with the seed.
CHI_SQUARE_MIN_P_VALUE = 0.001
# Pearson's chi-square approximation wants every expected count >= 5.
MIN_EXPECTED_PER_BIN = 5.0
# Acceptance rates must match their expectation within this many standard errors.
ACCEPTANCE_TOLERANCE_SE = 4.0

# (p, q) pairs over a 6-token vocabulary, for the general rule.
# q puts 0.9 on token 0, which the target almost never emits (p = 1e-4):
# the drafter is confidently wrong. sum min(p, q) = 1e-4 + 5 * 0.02 = 0.1001.
NEAR_ZERO = ([1e-4, 0.3, 0.25, 0.2, 0.15, 0.0999], [0.9, 0.02, 0.02, 0.02, 0.02, 0.02])
# q == p: every draft is accepted. sum min(p, q) = 1.
EQUAL = ([0.1, 0.25, 0.3, 0.05, 0.2, 0.1], [0.1, 0.25, 0.3, 0.05, 0.2, 0.1])
# q's mass sits on tokens 0-2, p's on 3-5. sum min(p, q) = 0.01+0.01+0.02+0.01+0.01+0.01 = 0.07.
DISJOINT = ([0.01, 0.01, 0.02, 0.3, 0.36, 0.3], [0.4, 0.35, 0.22, 0.01, 0.01, 0.01])
# q close to p, the common case: the residual max(0, p - q) has mass only
# 0.2. sum min(p, q) = 0.1+0.1+0.2+0.2+0.1+0.1 = 0.8.
CLOSE = ([0.2, 0.2, 0.2, 0.2, 0.1, 0.1], [0.1, 0.1, 0.2, 0.2, 0.2, 0.2])
# A target distribution for the bonus position.
BONUS_P = [0.05, 0.15, 0.2, 0.25, 0.3, 0.05]


# --- helpers -------------------------------------------------------------------


def chi_square_p_value(samples: np.ndarray, probs: list[float]) -> float:
    """Goodness of fit of integer ``samples`` to the distribution ``probs``."""
    probs64 = np.asarray(probs, dtype=np.float64)
    probs64 = probs64 / probs64.sum()
    observed = np.bincount(np.asarray(samples), minlength=len(probs64)).astype(np.float64)
    assert len(observed) == len(probs64), f"a sample lies outside the vocabulary of {len(probs64)}"
    expected = probs64 * len(samples)
    assert observed[expected == 0].sum() == 0, "a token with zero probability was drawn"
    # Pool the rare tokens into one bin so each bin meets the approximation's
    # minimum; if even the pool is too small, fold it into the smallest other bin.
    common = expected >= MIN_EXPECTED_PER_BIN
    observed_bins, expected_bins = list(observed[common]), list(expected[common])
    pooled_observed, pooled_expected = observed[~common].sum(), expected[~common].sum()
    if pooled_expected >= MIN_EXPECTED_PER_BIN:
        observed_bins.append(pooled_observed)
        expected_bins.append(pooled_expected)
    elif pooled_expected > 0:
        smallest = int(np.argmin(expected_bins))
        observed_bins[smallest] += pooled_observed
        expected_bins[smallest] += pooled_expected
    assert len(expected_bins) >= 2, "a one-bin test has no power"
    return float(scipy.stats.chisquare(observed_bins, expected_bins).pvalue)


def assert_rate_close(successes: int, trials: int, expected_rate: float) -> None:
    standard_error = math.sqrt(expected_rate * (1.0 - expected_rate) / trials)
    observed_rate = successes / trials
    assert (
        abs(observed_rate - expected_rate) <= ACCEPTANCE_TOLERANCE_SE * standard_error
    ), f"rate {observed_rate:.5f} vs expected {expected_rate:.5f} (standard error {standard_error:.5f})"


def overlap(p: list[float], q: list[float]) -> float:
    """sum_x min(p(x), q(x)): the acceptance probability of the general rule."""
    return float(np.minimum(np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)).sum())


def run_rejection_chains(target_rows: list[list[float]], draft_rows: list[list[float]], num_chains: int, seed: int) -> np.ndarray:
    """Draw d_i ~ q_i, run rejection_sample, return emitted tokens [num_chains, k+1], -1 past the end.

    Here p_i does not depend on d_<i: a valid target, and it lets each output
    position be compared with a fixed p_i.
    """
    target_probs = torch.tensor(target_rows, dtype=torch.float32)  # [k+1, vocab]
    draft_probs = torch.tensor(draft_rows, dtype=torch.float32)  # [k, vocab]
    k = len(draft_rows)
    draft_generator = torch.Generator().manual_seed(seed)
    drafts = torch.stack(
        [torch.multinomial(q, num_chains, replacement=True, generator=draft_generator) for q in draft_probs], dim=1
    )  # [num_chains, k]
    generator = torch.Generator().manual_seed(seed + 1)
    results = [rejection_sample(draft, draft_probs, target_probs, generator) for draft in drafts.tolist()]
    num_accepted, next_token = (np.asarray(column, dtype=np.int64)[:, None] for column in zip(*results))
    position = np.arange(k + 1)[None, :]  # [1, k+1]
    padded_drafts = np.concatenate([drafts.numpy(), np.full((num_chains, 1), -1)], axis=1)  # [num_chains, k+1]
    # Accepted drafts, then the recovered or bonus token, then -1.
    return np.where(position < num_accepted, padded_drafts, np.where(position == num_accepted, next_token, -1))


# --- accept_greedy ---------------------------------------------------------------


def test_accept_greedy_docstring_example():
    # 7 and 8 equal the argmax, 4 != 9 is rejected; the recovered token is 9.
    assert accept_greedy([7, 8, 9, 5], [7, 8, 4]) == (2, 9)


@pytest.mark.parametrize(
    "choices, draft, expected",
    [
        ([3], [], (0, 3)),  # no draft: the argmax at position 0 is emitted
        ([1, 2, 3, 4], [1, 2, 3], (3, 4)),  # every draft matches: the bonus is the argmax one past them
        ([2, 2, 2, 2], [0, 2, 2], (0, 2)),  # the first draft is rejected, so the matching ones after it count for nothing
        ([5, 6, 7], [5, 9], (1, 6)),  # recovered token: the argmax where the draft was rejected
    ],
)
def test_accept_greedy_keeps_the_longest_matching_prefix(choices, draft, expected):
    assert accept_greedy(choices, draft) == expected


def test_accept_greedy_needs_one_choice_past_the_draft():
    with pytest.raises(AssertionError, match="^3 choices for a draft of 3$"):
        accept_greedy([7, 8, 9], [7, 8, 9])


# --- warp_probs ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_choices_are_argmax_on_ties_and_nan(dtype):
    """The first of equal maxima, as argmax and transformers' greedy search take it; a NaN first."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(33, 4096, generator=generator) * 0.3).round().to(dtype)  # few values: many ties
    logits[5] = 1.0  # a row of nothing but ties
    logits[7, [900, 3000]] = float("nan")
    logits[9, [4095, 17]] = 100.0  # two equal maxima: the lower index is the choice
    choices = greedy_choices(logits)
    assert choices == logits.argmax(dim=-1).tolist()
    assert choices[5] == 0 and choices[7] == 900 and choices[9] == 17
    assert greedy_choices(logits[:1]) == [logits[0].argmax().item()]


def test_warp_probs_temperature_is_softmax_of_scaled_logits():
    probs = warp_probs(torch.tensor([[1.0, 2.0, 3.0]]), SamplingParams(temperature=0.5))
    # softmax([2, 4, 6]) = [1, e^2, e^4] / (1 + e^2 + e^4).
    expected = torch.tensor([[0.0158762400, 0.1173104278, 0.8668133322]])
    torch.testing.assert_close(probs, expected, rtol=0.0, atol=1e-6)
    assert probs.dtype == torch.float32


def test_warp_probs_top_k_keeps_exactly_k_tokens():
    probs = warp_probs(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), SamplingParams(temperature=1.0, top_k=2))
    # Tokens 1 and 3 (logits 3 and 2) remain: softmax([3, 2]) = [e/(e+1), 1/(e+1)].
    expected = torch.tensor([[0.0, 0.7310585786, 0.0, 0.2689414214]])
    torch.testing.assert_close(probs, expected, rtol=0.0, atol=1e-6)


def test_warp_probs_top_k_at_least_vocab_filters_nothing():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    expected = logits.softmax(dim=-1)
    for top_k in (4, 9):
        torch.testing.assert_close(warp_probs(logits, SamplingParams(temperature=1.0, top_k=top_k)), expected)


# Probabilities 0.15, 0.5, 0.05, 0.3, deliberately not in sorted order so the
# result must be scattered back to the right tokens.
TOP_P_LOGITS = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()


@pytest.mark.parametrize(
    "top_p, expected",
    [
        # 0.5 < 0.7 <= 0.5 + 0.3: keep {0.5, 0.3}, renormalized to 0.625, 0.375.
        (0.7, [0.0, 0.625, 0.0, 0.375]),
        # 0.8 < 0.85 <= 0.95: keep {0.5, 0.3, 0.15}, each divided by 0.95.
        (0.85, [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95]),
        # The top token alone already has mass 0.5 >= 0.3.
        (0.3, [0.0, 1.0, 0.0, 0.0]),
        # However small top_p is, the top token stays.
        (1e-6, [0.0, 1.0, 0.0, 0.0]),
    ],
)
def test_warp_probs_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, expected):
    probs = warp_probs(TOP_P_LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor([expected]), rtol=0.0, atol=1e-6)


@pytest.mark.parametrize(
    "top_p, kept",
    [
        # Four tokens of exactly 0.25: two reach 0.5 exactly, and the smallest
        # prefix with mass >= top_p is wanted, so the boundary counts as reached.
        (0.5, 2),
        (0.75, 3),
        # Just above the boundary, one more token is needed.
        (0.5001, 3),
    ],
)
def test_warp_probs_top_p_boundary_mass_counts_as_reached(top_p, kept):
    probs = warp_probs(torch.zeros((1, 4)), SamplingParams(temperature=1.0, top_p=top_p))
    # The kept tokens tie, so which ones are kept is unspecified; their number is not.
    assert sorted(probs[0].tolist()) == pytest.approx([0.0] * (4 - kept) + [1.0 / kept] * kept, abs=1e-6)


def test_warp_probs_applies_top_k_before_top_p():
    logits = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log()
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    # top-k=2 leaves 0.4, 0.3, renormalized to 4/7, 3/7; 4/7 >= 0.5 alone, so
    # top-p keeps only token 1. (top-p first would keep 0.4 and 0.3.)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]), rtol=0.0, atol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_k=64),  # top_k == vocab
        SamplingParams(temperature=1.0, top_k=100),  # top_k > vocab
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.5, top_p=0.3),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.75),
        SamplingParams(temperature=2.0, top_k=3, top_p=0.95),
    ],
)
def test_warp_probs_matches_transformers_warpers(params):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    generator = torch.Generator().manual_seed(1234)
    logits = 3.0 * torch.randn((16, 64), generator=generator)  # [n, vocab]
    input_ids = torch.zeros((16, 1), dtype=torch.long)  # unused by these warpers
    # transformers' generate() adds each warper only when it filters something,
    # in the order temperature, top-k, top-p.
    scores = TemperatureLogitsWarper(params.temperature)(input_ids, logits)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(input_ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(input_ids, scores)
    expected = scores.softmax(dim=-1)
    torch.testing.assert_close(warp_probs(logits, params), expected, rtol=0.0, atol=1e-6)


def test_warp_probs_refuses_greedy_params():
    with pytest.raises(AssertionError, match="greedy decoding has no sampling distribution"):
        warp_probs(torch.zeros((1, 4)), SamplingParams(temperature=0.0))


# --- SamplingParams ------------------------------------------------------------


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(temperature=float("nan")), r"temperature must be a finite number >= 0 \(below 1e-05 = greedy\), got nan"),
        (SamplingParams(temperature=float("inf")), r"temperature must be a finite number >= 0 \(below 1e-05 = greedy\), got inf"),
        (SamplingParams(temperature=float("-inf")), r"temperature must be a finite number >= 0 \(below 1e-05 = greedy\), got -inf"),
        (SamplingParams(temperature=-0.5), r"temperature must be a finite number >= 0 \(below 1e-05 = greedy\), got -0.5"),
        (SamplingParams(temperature=1.0, top_p=float("nan")), r"top_p must be in \[0, 1\] \(0 or 1 = off\), got nan"),
        (SamplingParams(temperature=1.0, top_p=-0.1), r"top_p must be in \[0, 1\] \(0 or 1 = off\), got -0.1"),
        (SamplingParams(temperature=1.0, top_p=1.5), r"top_p must be in \[0, 1\] \(0 or 1 = off\), got 1.5"),
        (SamplingParams(temperature=1.0, top_k=-1), "top_k must be >= 0, got -1"),
    ],
)
def test_sampling_params_validate_rejects(params, message):
    with pytest.raises(ValueError, match=message):
        params.validate()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),  # greedy defaults
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=3),
        SamplingParams(temperature=1e-3, top_p=1e-9),  # tiny but legal values
        SamplingParams(temperature=1.0, top_p=0.0),  # 0 = off (proto3's unset value)
    ],
)
def test_sampling_params_validate_accepts_boundary_values(params):
    params.validate()


def test_top_p_zero_means_no_nucleus_filter():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    unfiltered = warp_probs(logits, SamplingParams(temperature=1.0, top_p=1.0))
    torch.testing.assert_close(warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.0)), unfiltered)
    assert (unfiltered > 0).all()


def test_sampling_params_greedy_means_temperature_below_the_sampling_floor():
    assert (SamplingParams().greedy, SamplingParams(temperature=0.1).greedy) == (True, False)
    # 3.3e-38 is a valid float32 temperature; sampled, logits / T overflowed and softmax gave NaN.
    assert SamplingParams(temperature=3.3e-38).greedy and SamplingParams(temperature=9.9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-5),  # the smallest sampled temperature
        SamplingParams(temperature=1e30),  # everything equally likely
        SamplingParams(temperature=1.0, top_p=1e-30),  # the top token alone
        SamplingParams(temperature=1.0, top_k=4_000_000_000),  # more than the vocabulary: no filter
    ],
)
def test_warp_probs_stays_a_distribution_at_extreme_but_valid_values(params):
    logits = torch.tensor([[30.0, 29.0, -40.0, 0.0], [88.0, 88.0, -88.0, 1e4]])
    probs = warp_probs(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(2))


# --- rejection_sample (general rule, draft distribution q) ------------------------

# 100k chains per case: enough for expected counts of 10 on the 1e-4 token, and
# each case runs in about 3 s on one CPU core (about 30 us per call). To keep
# the file near 20 s, EQUAL is run only in a k=2 chain, at position 0, which
# goes through the same code as k=1.
NUM_CHAINS = 100_000


@pytest.mark.slow  # seconds of sampling: left out of make test-fast
@pytest.mark.parametrize("case", [NEAR_ZERO, DISJOINT], ids=["near_zero", "disjoint"])
def test_rejection_sample_k1_emits_the_target_distribution(case):
    p, q = case
    emitted = run_rejection_chains([p, BONUS_P], [q], NUM_CHAINS, seed=11)
    # Output position 0 holds d_1 if accepted, else the recovered token:
    # either way it must be distributed as p_1.
    assert chi_square_p_value(emitted[:, 0], p) > CHI_SQUARE_MIN_P_VALUE
    accepted = emitted[:, 1] >= 0
    assert_rate_close(int(accepted.sum()), NUM_CHAINS, overlap(p, q))
    # The bonus token after an accepted draft is drawn from p_2.
    assert chi_square_p_value(emitted[accepted, 1], BONUS_P) > CHI_SQUARE_MIN_P_VALUE


@pytest.mark.slow  # seconds of sampling: left out of make test-fast
@pytest.mark.parametrize("first, second", [(EQUAL, NEAR_ZERO), (CLOSE, DISJOINT)], ids=["equal_then_near_zero", "close_then_disjoint"])
def test_rejection_sample_k2_chain_emits_the_target_distribution_at_each_position(first, second):
    (p1, q1), (p2, q2) = first, second
    emitted = run_rejection_chains([p1, p2, BONUS_P], [q1, q2], NUM_CHAINS, seed=23)
    assert chi_square_p_value(emitted[:, 0], p1) > CHI_SQUARE_MIN_P_VALUE
    first_accepted = emitted[:, 1] >= 0
    assert_rate_close(int(first_accepted.sum()), NUM_CHAINS, overlap(p1, q1))
    # Given d_1 was accepted, position 1 (d_2 or its recovered token) follows p_2,
    # and d_2 is accepted with probability sum min(p_2, q_2).
    assert chi_square_p_value(emitted[first_accepted, 1], p2) > CHI_SQUARE_MIN_P_VALUE
    both_accepted = emitted[:, 2] >= 0
    assert_rate_close(int(both_accepted.sum()), int(first_accepted.sum()), overlap(p2, q2))
    assert chi_square_p_value(emitted[both_accepted, 2], BONUS_P) > CHI_SQUARE_MIN_P_VALUE


def test_rejection_sample_never_accepts_a_draft_the_target_cannot_emit():
    # p(0) = 0 and q is a point mass on 0: reject every time and draw the
    # recovered token from norm(max(0, p - q)) = p, i.e. token 1 or 2.
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft_probs = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(5)
    results = {rejection_sample([0], draft_probs, target, generator) for _ in range(200)}
    assert results == {(0, 1), (0, 2)}


def test_rejection_sample_always_accepts_when_p_exceeds_q():
    # p(0) = 0.7 >= q(0) = 0.5, so min(1, p/q) = 1; the bonus row is a point
    # mass on token 1.
    target = torch.tensor([[0.7, 0.3], [0.0, 1.0]])
    draft_probs = torch.tensor([[0.5, 0.5]])
    generator = torch.Generator().manual_seed(5)
    results = {rejection_sample([0], draft_probs, target, generator) for _ in range(200)}
    assert results == {(1, 1)}


def test_chi_square_harness_rejects_a_sampler_that_skips_the_residual():
    # A classic bug: on rejection, resample from p instead of norm(max(0, p - q)).
    # Its output is min(p, q) + (1 - sum min(p, q)) * p, which over-weights the
    # tokens q favours. The harness must catch it at the sample size used above.
    p, q = (np.asarray(row, dtype=np.float64) for row in NEAR_ZERO)
    rng = np.random.default_rng(7)
    drafts = rng.choice(6, size=NUM_CHAINS, p=q)
    accept = rng.random(NUM_CHAINS) < np.minimum(1.0, p[drafts] / q[drafts])
    resampled = rng.choice(6, size=NUM_CHAINS, p=p)
    biased = np.where(accept, drafts, resampled)
    assert chi_square_p_value(biased, list(p)) < 1e-6
    # The same harness accepts exact draws from p with the same generator.
    assert chi_square_p_value(rng.choice(6, size=NUM_CHAINS, p=p), list(p)) > CHI_SQUARE_MIN_P_VALUE


# --- accept_sampled (point-mass draft, one seeded sample per position) -------------

# Each accept_sampled call seeds a fresh torch.Generator per position (about
# 20 us); three drafts per seed at 40k seeds cost about 3 s. 40k still gives
# the 1e-4 token an expected count of 4 (pooled by the harness) and pins the
# acceptance rate of a p = 0.4 draft to +-0.01 at 4 standard errors.
NUM_SEEDS = 40_000
FIRST_POSITION = 7
POINT_P = [0.4, 0.25, 0.2, 0.1, 0.0499, 1e-4]
LIKELY_DRAFT = 0  # p = 0.4
UNLIKELY_DRAFT = 5  # p = 1e-4


@pytest.fixture(scope="module")
def seeded_outputs() -> dict[str, np.ndarray]:
    """Position-0 tokens and acceptance per seed, for no draft and two drafts."""
    p_first = torch.tensor([POINT_P])  # [1, vocab]
    p_with_bonus = torch.tensor([POINT_P, BONUS_P])  # [2, vocab]
    outputs = {name: np.empty(NUM_SEEDS, dtype=np.int64) for name in ("none", "likely", "unlikely")}
    accepted = {name: np.zeros(NUM_SEEDS, dtype=bool) for name in ("likely", "unlikely")}
    bonus_matches_plain = []
    for seed in range(NUM_SEEDS):
        _, outputs["none"][seed] = accept_sampled(p_first, [], seed, FIRST_POSITION)
        for name, draft_token in (("likely", LIKELY_DRAFT), ("unlikely", UNLIKELY_DRAFT)):
            num_accepted, next_token = accept_sampled(p_with_bonus, [draft_token], seed, FIRST_POSITION)
            accepted[name][seed] = num_accepted == 1
            outputs[name][seed] = draft_token if num_accepted == 1 else next_token
            if num_accepted == 1 and name == "likely":
                # The bonus at position 8 must be plain sampling at position 8.
                _, plain = accept_sampled(torch.tensor([BONUS_P]), [], seed, FIRST_POSITION + 1)
                bonus_matches_plain.append((next_token, plain))
    return {
        **outputs,
        "accepted_likely": accepted["likely"],
        "accepted_unlikely": accepted["unlikely"],
        "bonus_matches_plain": np.asarray(bonus_matches_plain),
    }


@pytest.mark.slow  # seconds of sampling: left out of make test-fast
@pytest.mark.parametrize("draft", ["none", "likely", "unlikely"])
def test_accept_sampled_position_0_follows_p_whatever_was_drafted(seeded_outputs, draft):
    assert chi_square_p_value(seeded_outputs[draft], POINT_P) > CHI_SQUARE_MIN_P_VALUE


@pytest.mark.parametrize(
    "name, draft_probability", [("accepted_likely", POINT_P[LIKELY_DRAFT]), ("accepted_unlikely", POINT_P[UNLIKELY_DRAFT])]
)
@pytest.mark.slow  # the seeded_outputs fixture samples for seconds: left out of make test-fast
def test_accept_sampled_accepts_a_draft_with_probability_p_of_it(seeded_outputs, name, draft_probability):
    # A point-mass q makes min(1, p(d) / q(d)) = p(d).
    assert_rate_close(int(seeded_outputs[name].sum()), NUM_SEEDS, draft_probability)


@pytest.mark.slow  # the seeded_outputs fixture samples for seconds: left out of make test-fast
def test_accept_sampled_emits_the_same_token_whatever_was_drafted(seeded_outputs):
    # One sample x per (seed, position), independent of the draft: the token
    # at position 0 is x whether d was accepted (d == x) or not (x emitted).
    np.testing.assert_array_equal(seeded_outputs["likely"], seeded_outputs["none"])
    np.testing.assert_array_equal(seeded_outputs["unlikely"], seeded_outputs["none"])


@pytest.mark.slow  # the seeded_outputs fixture samples for seconds: left out of make test-fast
def test_accept_sampled_bonus_equals_plain_sampling_at_its_position(seeded_outputs):
    pairs = seeded_outputs["bonus_matches_plain"]  # [num_accepted_likely, 2]
    # About 0.4 * NUM_SEEDS seeds accepted the likely draft; each bonus token is
    # the plain seeded sample for position FIRST_POSITION + 1.
    assert len(pairs) > 0.35 * NUM_SEEDS
    np.testing.assert_array_equal(pairs[:, 0], pairs[:, 1])
    assert chi_square_p_value(pairs[:, 0], BONUS_P) > CHI_SQUARE_MIN_P_VALUE


def test_accept_sampled_with_point_mass_targets_is_literal():
    target = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])  # [k+1=2, vocab=4]
    for seed in (0, 1, 2**40):
        # p_1 is a point mass on 2: draft 2 is accepted and the bonus is 1 ...
        assert accept_sampled(target, [2], seed, FIRST_POSITION) == (1, 1)
        # ... and draft 3 is rejected, with 2 emitted in its place.
        assert accept_sampled(target, [3], seed, FIRST_POSITION) == (0, 2)


def test_position_generator_depends_on_seed_and_position():
    def first_draw(seed: int, position: int) -> float:
        return float(torch.rand((), generator=position_generator(seed, position)))

    assert first_draw(3, 7) == first_draw(3, 7)
    # Neighbouring seeds and positions give different streams.
    assert len({first_draw(3, 7), first_draw(4, 7), first_draw(3, 8), first_draw(4, 8)}) == 4


# --- trees ---------------------------------------------------------------------------


def test_accept_tree_greedy_docstring_example():
    assert accept_tree_greedy([7, 8, 2, 9], [7, 4, 8], [-1, -1, 0]) == ([0, 2], 9)


@pytest.mark.parametrize(
    "choices, tokens, parents, expected",
    [
        ([3, 0, 0, 0], [1, 2, 3], [-1, -1, -1], ([2], 0)),  # the third of the root's children
        ([5, 0, 0, 0], [1, 2, 3], [-1, -1, -1], ([], 5)),  # none of them
        ([1, 2, 0, 9], [1, 2, 2], [-1, 0, 0], ([0, 1], 0)),  # a repeated sibling: the first node wins
        ([1, 4, 2, 5, 6], [1, 2, 4, 5], [-1, 0, 0, 2], ([0, 2, 3], 6)),  # down a second child's subtree
    ],
)
def test_accept_tree_greedy_follows_the_argmax_through_the_children(choices, tokens, parents, expected):
    assert accept_tree_greedy(choices, tokens, parents) == expected


TREE_VOCAB = 5
TREE_DEPTH = 3  # tokens generated per simulated request


def target(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed target distribution over TREE_VOCAB tokens after ``prefix``, different per
    prefix and uneven (squared uniforms), with every token possible."""
    generator = torch.Generator().manual_seed(1 + sum(t * 7**i for i, t in enumerate(prefix)) + 1000 * len(prefix))
    weights = torch.rand(TREE_VOCAB, generator=generator) ** 2 + 0.02
    return weights / weights.sum()


def draft_tree(context: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Three children at the root, two under each, chosen from the context: a tree with
    several children per node, whose tokens cover most but not all of the vocabulary."""
    tokens, parents = [], []
    offset = sum(context)
    for child in range(3):
        tokens.append((offset + child) % TREE_VOCAB)
        parents.append(-1)
        parent = len(tokens) - 1
        for grandchild in range(2):
            tokens.append((offset + 2 * child + grandchild + 1) % TREE_VOCAB)
            parents.append(parent)
    return tokens, parents


def sample_with_trees(seed: int) -> tuple[int, ...]:
    """TREE_DEPTH tokens, drafted as trees and kept by ``accept_tree_sampled``."""
    out: tuple[int, ...] = ()
    while len(out) < TREE_DEPTH:
        tokens, parents = draft_tree(out)
        paths = []  # each node's path from the root
        for token, parent in zip(tokens, parents):
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        probs = torch.stack([target(out)] + [target(out + path) for path in paths])
        path, token = accept_tree_sampled(probs, tokens, parents, seed, first_position=len(out))
        out = (out + tuple(tokens[node] for node in path) + (token,))[:TREE_DEPTH]
    return out


def sample_plainly(seed: int) -> tuple[int, ...]:
    out: tuple[int, ...] = ()
    while len(out) < TREE_DEPTH:
        generator = position_generator(seed, len(out))
        out += (int(torch.multinomial(target(out), 1, generator=generator)),)
    return out


def test_accept_tree_sampled_emits_what_plain_sampling_emits_with_the_same_seed():
    for seed in range(300):
        assert sample_with_trees(seed) == sample_plainly(seed), seed


def test_accept_tree_sampled_follows_the_target_joint_distribution():
    """Chi-square over all TREE_VOCAB ** 3 three-token outputs against the product of the
    target's conditionals; several children per node, so draws descend into every branch."""
    outputs = [sample_with_trees(seed) for seed in range(6000)]
    index = np.array([a * TREE_VOCAB**2 + b * TREE_VOCAB + c for a, b, c in outputs])
    joint = []
    for a in range(TREE_VOCAB):
        for b in range(TREE_VOCAB):
            for c in range(TREE_VOCAB):
                joint.append(float(target(())[a] * target((a,))[b] * target((a, b))[c]))
    assert chi_square_p_value(index, joint) > CHI_SQUARE_MIN_P_VALUE


def test_the_tree_chi_square_test_rejects_a_rule_that_prefers_drafted_tokens():
    """The harness has power: a rule that accepts the root's first child whenever the
    target gives it at least 0.2 (a draft-biased sampler) fails the same test."""
    rng = np.random.default_rng(0)

    def biased(seed: int) -> tuple[int, ...]:
        out: tuple[int, ...] = ()
        while len(out) < TREE_DEPTH:
            tokens, _ = draft_tree(out)
            p = target(out)
            if float(p[tokens[0]]) >= 0.2:
                out += (tokens[0],)
            else:
                out += (int(rng.choice(TREE_VOCAB, p=p.double().numpy() / float(p.double().sum()))),)
        return out

    outputs = [biased(seed) for seed in range(6000)]
    index = np.array([a * TREE_VOCAB**2 + b * TREE_VOCAB + c for a, b, c in outputs])
    joint = [
        float(target(())[a] * target((a,))[b] * target((a, b))[c])
        for a in range(TREE_VOCAB)
        for b in range(TREE_VOCAB)
        for c in range(TREE_VOCAB)
    ]
    assert chi_square_p_value(index, joint) < 1e-6
