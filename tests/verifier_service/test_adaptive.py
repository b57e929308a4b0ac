"""Adaptive K by hand: the acceptance estimate, the step-cost model and the width choice."""

from __future__ import annotations

import pytest

from verifier_service.adaptive import AcceptanceEstimate, StepCostModel, choose_width, expected_tokens


def no_padding(batch, width):
    return width


def cost_1_plus_rows_over_8(rows):
    """The docstring's cost model: 1 s a step plus 1/8 s a row."""
    return 1 + rows / 8


# -- AcceptanceEstimate ---------------------------------------------------------------


def test_prior_is_even_odds():
    assert AcceptanceEstimate().alpha == 0.5  # (0 + 1) / (0 + 0 + 1 + 1)


def test_update_adds_accepted_and_one_rejection_for_a_cut_draft():
    estimate = AcceptanceEstimate()
    estimate.update(verified=4, accepted=1)
    assert (estimate.accepted, estimate.rejected) == (1.0, 1.0)
    assert estimate.alpha == pytest.approx(2 / 4)  # (1 + 1) / (1 + 1 + 2)


def test_fully_accepted_draft_adds_no_rejection():
    estimate = AcceptanceEstimate()
    estimate.update(verified=3, accepted=3)
    assert (estimate.accepted, estimate.rejected) == (3.0, 0.0)
    assert estimate.alpha == pytest.approx(4 / 5)  # (3 + 1) / (3 + 0 + 2)


def test_earlier_evidence_decays_by_0_95_a_step():
    estimate = AcceptanceEstimate()
    estimate.update(3, 3)  # accepted 3, rejected 0
    estimate.update(4, 1)  # accepted 3 * 0.95 + 1 = 3.85, rejected 0 * 0.95 + 1 = 1
    assert estimate.accepted == pytest.approx(3.85)
    assert estimate.rejected == pytest.approx(1.0)
    assert estimate.alpha == pytest.approx(4.85 / 6.85)  # 0.70803
    estimate.update(2, 0)  # accepted 3.6575, rejected 1.95
    assert estimate.alpha == pytest.approx(4.6575 / 7.6075)  # 0.61222


def test_an_empty_update_only_decays_towards_the_prior():
    estimate = AcceptanceEstimate(accepted=0.0, rejected=3.0)
    assert estimate.alpha == pytest.approx(1 / 5)
    estimate.update(0, 0)  # nothing verified: rejected 3 * 0.95 = 2.85, no new evidence
    assert estimate.rejected == pytest.approx(2.85)
    assert estimate.alpha == pytest.approx(1 / 4.85)  # 0.2062: closer to 0.5 than 0.2 was


def test_rejections_lower_alpha_step_by_step():
    estimate = AcceptanceEstimate()
    alphas = []
    for _ in range(3):
        estimate.update(3, 0)
        alphas.append(estimate.alpha)
    # rejected: 1, 1.95, 2.8525 -> alpha 1/3, 1/3.95, 1/4.8525
    assert alphas == pytest.approx([1 / 3, 1 / 3.95, 1 / 4.8525])


# -- expected_tokens -----------------------------------------------------------------


@pytest.mark.parametrize(
    "alpha, drafts, expected",
    [
        (0.5, 2, 1.75),  # 1 + 0.5 + 0.25
        (0.9, 0, 1.0),  # no drafts: the recovered/bonus token only
        (0.0, 5, 1.0),  # 0 ** 0 == 1, every later term 0
        (1.0, 4, 5.0),  # every draft accepted, plus the bonus
        (0.9, 4, 4.0951),  # 1 + 0.9 + 0.81 + 0.729 + 0.6561
    ],
)
def test_expected_tokens(alpha, drafts, expected):
    assert expected_tokens(alpha, drafts) == pytest.approx(expected)


# -- StepCostModel -------------------------------------------------------------------

POINTS = {1: 1.0, 3: 2.0, 5: 6.0}


@pytest.mark.parametrize("rows, seconds", [(1, 1.0), (3, 2.0), (5, 6.0)])
def test_cost_at_measured_points_is_exact(rows, seconds):
    assert StepCostModel(POINTS).cost(rows) == seconds


@pytest.mark.parametrize(
    "rows, seconds",
    [
        (2, 1.5),  # halfway between (1, 1.0) and (3, 2.0)
        (4, 4.0),  # halfway between (3, 2.0) and (5, 6.0)
    ],
)
def test_cost_interpolates_linearly_between_points(rows, seconds):
    assert StepCostModel(POINTS).cost(rows) == pytest.approx(seconds)


def test_cost_extrapolates_past_the_last_point_with_the_last_segment():
    # Slope of (3, 2.0)-(5, 6.0) is 2 s a row: 6 + 2 * (8 - 5).
    assert StepCostModel(POINTS).cost(8) == pytest.approx(12.0)


def test_cost_extrapolates_below_the_first_point_with_the_first_segment():
    # Slope of (1, 1.0)-(3, 2.0) is 0.5 s a row: 1 - 0.5.
    assert StepCostModel(POINTS).cost(0) == pytest.approx(0.5)


def test_cost_below_the_first_point_never_goes_to_zero_or_below():
    model = StepCostModel({2: 1.0, 3: 5.0})  # slope 4: the line crosses zero at 1.75 rows
    assert model.cost(1) == 1e-6


def test_single_point_scales_with_rows_above_it_and_is_flat_below():
    model = StepCostModel({4: 2.0})
    assert model.cost(4) == 2.0
    assert model.cost(8) == pytest.approx(4.0)  # twice the rows, twice the time
    assert model.cost(2) == 2.0  # never cheaper than the measured point


def test_linear_goes_through_1_and_1024_rows():
    model = StepCostModel.linear(0.048, 0.008)
    assert model.rows == [1, 1024]
    assert model.seconds == pytest.approx([0.056, 8.24])  # 0.048 + 0.008 and 0.048 + 1024 * 0.008
    assert model.cost(10) == pytest.approx(0.128)  # 0.048 + 10 * 0.008


def test_points_given_out_of_order_are_sorted():
    model = StepCostModel({5: 6.0, 1: 1.0, 3: 2.0})
    assert model.rows == [1, 3, 5]
    assert model.seconds == [1.0, 2.0, 6.0]


def test_observe_moves_the_nearest_point_by_a_tenth_of_the_gap():
    model = StepCostModel(POINTS)
    model.observe(3, 3.0)
    assert model.seconds == pytest.approx([1.0, 2.1, 6.0])  # 2 + 0.1 * (3 - 2)
    assert model.cost(3) == pytest.approx(2.1)


def test_observe_near_a_point_but_not_on_it_moves_that_point():
    model = StepCostModel(POINTS)
    model.observe(6, 1.0)  # nearest is 5, 1 row away <= 0.25 * 6
    assert model.seconds == pytest.approx([1.0, 2.0, 5.5])  # 6 + 0.1 * (1 - 6)


def test_observe_at_equal_distance_moves_the_lower_point():
    model = StepCostModel(POINTS)
    model.observe(4, 3.0)  # 3 and 5 are both 1 row away (<= 0.25 * 4): min() keeps the first
    assert model.seconds == pytest.approx([1.0, 2.1, 6.0])


def test_observe_far_from_every_point_is_ignored():
    model = StepCostModel(POINTS)
    model.observe(10, 100.0)  # nearest is 5, 5 rows away > 0.25 * 10
    model.observe(12, 0.001)
    assert model.seconds == [1.0, 2.0, 6.0]


def test_observe_repeatedly_converges_on_the_measured_time():
    model = StepCostModel({1: 1.0})
    for _ in range(100):
        model.observe(1, 0.5)
    assert model.cost(1) == pytest.approx(0.5, abs=1e-4)  # gap shrinks by 0.9 each time: 0.5 * 0.9 ** 100


@pytest.mark.parametrize(
    "points",
    [
        {},  # nothing measured
        {0: 1.0},  # zero rows
        {-2: 1.0},
        {1: 0.0},  # a free step
        {1: 1.0, 8: -0.5},
    ],
)
def test_bad_points_raise_value_error(points):
    with pytest.raises(ValueError, match="need at least one"):
        StepCostModel(points)


# -- choose_width -------------------------------------------------------------------


def test_docstring_example_high_acceptance_verifies_every_draft():
    # W=1: 2 / 1.25 = 1.6/s; W=5: 2 x 4.0951 / 2.25 = 3.64/s (W=4: 6.878 / 2 = 3.44/s).
    assert choose_width([4, 4], [0.9, 0.9], cost_1_plus_rows_over_8, no_padding) == 5


def test_docstring_example_low_acceptance_is_plain_decoding():
    # W=1: 1.6/s beats W=2: 2.2 / 1.5 = 1.47/s and W=3: 2.22 / 1.75 = 1.27/s.
    assert choose_width([4, 4], [0.1, 0.1], cost_1_plus_rows_over_8, no_padding) == 1


def test_min_width_is_respected_even_when_narrower_pays_more():
    # From W=3: W=3 2.22 / 1.75 = 1.27/s beats W=4 2.222 / 2 = 1.11/s and W=5 0.99/s.
    assert choose_width([4, 4], [0.1, 0.1], cost_1_plus_rows_over_8, no_padding, min_width=3) == 3


def test_min_width_above_every_draft_is_returned():
    assert choose_width([2, 1], [0.9, 0.9], cost_1_plus_rows_over_8, no_padding, min_width=6) == 6


def test_padding_makes_the_widest_of_a_padded_group_the_choice():
    """Single row, 4 drafts at alpha 0.9, cost 1 + rows/8.

    Unpadded: W=4 3.439 / 1.5 = 2.29/s, W=5 4.0951 / 1.625 = 2.52/s -> 5.
    Padded to 1, 4 or 8 rows: W=2..4 all cost 1.5 s, W=5 costs 2 s (2.05/s) -> 4.
    """

    def pad_to_4_or_8(batch, width):
        return 1 if width == 1 else 4 if width <= 4 else 8

    assert choose_width([4], [0.9], cost_1_plus_rows_over_8, no_padding) == 5
    assert choose_width([4], [0.9], cost_1_plus_rows_over_8, pad_to_4_or_8) == 4


def test_equal_cost_widths_pick_the_widest_when_acceptance_is_high():
    # Widths 2..4 cost the same (rows padded to 4), so more drafts are free: 3.439 / 1.5 vs 1.9 / 1.5.
    def pad_2_to_4(batch, width):
        return 4 if 2 <= width <= 4 else width

    assert choose_width([3], [0.9], cost_1_plus_rows_over_8, pad_2_to_4) == 4


def test_free_padding_makes_even_poor_drafts_worth_verifying():
    # With W=1 padded to 4 rows too, W=4 costs what W=1 costs and adds 0.111 expected tokens.
    assert choose_width([3], [0.1], cost_1_plus_rows_over_8, lambda batch, width: 4 if width <= 4 else 8) == 4


def test_rows_without_drafts_give_plain_decoding():
    assert choose_width([0, 0, 0], [0.9, 0.9, 0.9], cost_1_plus_rows_over_8, no_padding) == 1


def test_empty_batch_gives_min_width():
    assert choose_width([], [], cost_1_plus_rows_over_8, no_padding) == 1
    assert choose_width([], [], cost_1_plus_rows_over_8, no_padding, min_width=3) == 3


def test_flat_cost_verifies_the_longest_draft():
    # Every width costs the same, and expected tokens grow with W while alpha > 0.
    assert choose_width([2, 7], [0.3, 0.05], lambda rows: 1.0, no_padding) == 8


def test_linear_cost_through_zero_never_speculates_for_an_imperfect_drafter():
    # Cost = rows: W rows of cost buy 1 + a + ... + a^(W-1) < W tokens per row.
    assert choose_width([8], [0.95], lambda rows: float(rows), no_padding) == 1


def test_one_good_row_does_not_widen_a_batch_of_poor_rows():
    """Cost 0.048 + 0.008 s a row (the engine's CPU default), 8 drafts per row.

    Alone, the alpha-0.95 row verifies everything: W=9 7.39 tokens / 0.12 s = 61.6/s
    against W=1 1 / 0.056 = 17.9/s. With 15 alpha-0.05 rows beside it, W=1 gives
    16 / 0.176 = 90.9/s while W=2 gives (1.95 + 15 x 1.05) / 0.304 = 58.2/s.
    """

    def cpu_cost(rows):
        return 0.048 + 0.008 * rows

    assert choose_width([8], [0.95], cpu_cost, no_padding) == 9
    assert choose_width([8] * 16, [0.95] + [0.05] * 15, cpu_cost, no_padding) == 1


def test_many_good_rows_at_large_batch_pick_a_middle_width():
    """16 rows at alpha 0.95, cost 0.048 + 0.008 s a row: the cost of rows caps the width.

    W=1 16 / 0.176 = 90.9/s; W=3 45.64 / 0.432 = 105.6/s; W=4 59.36 / 0.56 = 106.0/s;
    W=5 72.39 / 0.688 = 105.2/s; W=9 118.3 / 1.2 = 98.6/s -> 4, though each row has 8 drafts.
    """

    def cpu_cost(rows):
        return 0.048 + 0.008 * rows

    assert choose_width([8] * 16, [0.95] * 16, cpu_cost, no_padding) == 4
