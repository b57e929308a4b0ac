"""StepCostModel on literal points: interpolation, padding, and folding in real step times."""

from __future__ import annotations

import pytest

from verifier_service.calibration import StepCostModel

# -- StepCostModel --------------------------------------------------------------------

POINTS = {1: 1.0, 3: 2.0, 5: 6.0}


@pytest.mark.parametrize("tokens, seconds", [(1, 1.0), (3, 2.0), (5, 6.0), (2, 1.5), (4, 4.0)])
def test_cost_is_exact_at_points_and_linear_between(tokens, seconds):
    assert StepCostModel(POINTS).cost(tokens) == pytest.approx(seconds)


def test_cost_extrapolates_with_the_nearest_segment_and_never_reaches_zero():
    assert StepCostModel(POINTS).cost(8) == pytest.approx(12.0)  # slope 2 past (5, 6.0)
    assert StepCostModel({2: 1.0, 3: 5.0}).cost(1) == 1e-6  # the first segment's line crosses zero


def test_single_point_scales_with_tokens_above_it_and_is_flat_below():
    model = StepCostModel({4: 2.0})
    assert (model.cost(2), model.cost(4), model.cost(8)) == (2.0, 2.0, pytest.approx(4.0))


def test_cost_adds_the_context_term():
    model = StepCostModel(POINTS, per_context_token=0.01)
    assert model.cost(3, context=100) == pytest.approx(3.0)


def test_padding_docstring_example():
    model = StepCostModel({1: 1.0, 2: 1.6, 3: 1.7, 4: 1.3})
    assert model.padding(2) == 2 and model.padding(3) == 1
    assert model.padding(1) == 0  # nothing cheaper above
    assert model.cheapest(2) == 1.3


def test_padding_needs_a_real_saving_and_stays_close():
    # 4 is only 2% cheaper than 3: not worth it. 20 is far cheaper than 5, but 15 tokens away.
    model = StepCostModel({3: 1.0, 4: 0.98, 5: 2.0, 20: 0.5})
    assert model.padding(3) == 0
    assert model.padding(5) == 0


def test_observe_moves_the_points_around_a_step_by_their_share_of_a_tenth_of_the_gap():
    model = StepCostModel(POINTS)
    model.observe(3, 0, 3.0)
    assert model.points() == pytest.approx({1: 1.0, 3: 2.1, 5: 6.0})  # 2 + 0.1 * (3 - 2)
    model.observe(4, 0, 5.05)  # between 3 and 5: predicted 4.05, 1.0 too low, half each
    assert model.points() == pytest.approx({1: 1.0, 3: 2.15, 5: 6.05})


def test_observe_outside_the_measured_range_keeps_the_points():
    model = StepCostModel(POINTS)
    model.observe(10, 0, 100.0)
    assert model.points() == POINTS


def test_observe_takes_the_context_term_out_before_moving_points():
    model = StepCostModel(POINTS, per_context_token=0.002)
    model.observe(3, 1000, 2.0 + 1000 * 0.002 + 1.0)  # the tokens took 3.0 s, the context 2.0 s
    assert model.points() == pytest.approx({1: 1.0, 3: 2.1, 5: 6.0})


@pytest.mark.parametrize("points", [{}, {0: 1.0}, {-2: 1.0}, {1: 0.0}, {1: 1.0, 8: -0.5}])
def test_bad_points_raise_value_error(points):
    with pytest.raises(ValueError, match="need at least one"):
        StepCostModel(points)
