"""StepCostModel on literal points: interpolation, padding, and folding in real step times;
and a calibration kept in a folder across starts (load_or_calibrate)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from verifier_service import calibration
from verifier_service.calibration import StepCostModel
from verifier_service.engine import EngineConfig, SpeculativeEngine

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


# -- a calibration kept across starts ------------------------------------------------------


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    """An engine with a step cost of its own, so load_or_calibrate is what the test calls."""
    return SpeculativeEngine(tiny_model, tiny_tokenizer, None, EngineConfig(max_batch_size=2), StepCostModel({1: 1.0}))


@pytest.fixture
def counted(monkeypatch):
    """calibrate_step_cost, counted, returning a fixed model (no timing in tests)."""
    calls = []

    def fake(engine, tokens=calibration.CALIBRATION_TOKENS):
        calls.append(engine)
        engine.kernels.up_to = 8
        return StepCostModel({1: 0.002, 4: 0.003, 16: 0.004}, per_context_token=1e-7)

    monkeypatch.setattr(calibration, "calibrate_step_cost", fake)
    return calls


def stored_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("step-cost-*.json"))


def test_a_stored_calibration_is_reused_when_the_probe_agrees(engine, counted, tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "PROBE_TOLERANCE", 1e12)  # any time agrees: this test is not about timing
    first = calibration.load_or_calibrate(engine, tmp_path)
    [path] = stored_files(tmp_path)
    assert len(counted) == 1 and json.loads(path.read_text())["key"] == calibration.calibration_key(engine)
    engine.kernels.up_to = 0
    again = calibration.load_or_calibrate(engine, tmp_path)
    assert len(counted) == 1  # no second calibration
    assert again.points() == first.points() and again.per_context_token == first.per_context_token
    assert engine.kernels.up_to == 8  # the stored choice of linear-layer form, restored


def test_a_probe_far_from_the_stored_costs_calibrates_again(engine, counted, tmp_path, caplog):
    calibration.load_or_calibrate(engine, tmp_path)
    [path] = stored_files(tmp_path)
    record = json.loads(path.read_text())
    record["points"] = {count: 1e3 for count in record["points"]}  # a machine a million times slower
    path.write_text(json.dumps(record))
    with caplog.at_level(logging.INFO):
        calibration.load_or_calibrate(engine, tmp_path)
    assert len(counted) == 2
    assert "is off (1 tokens:" in caplog.text and "calibrating again" in caplog.text
    assert json.loads(path.read_text())["points"]["1"] == 0.002  # the new calibration replaced it


@pytest.mark.parametrize("content", ["{not json", '{"key": 1}', "", '{"key": null, "points": []}'])
def test_an_unreadable_stored_calibration_costs_a_calibration_not_the_start(engine, counted, tmp_path, content, monkeypatch):
    calibration.load_or_calibrate(engine, tmp_path)
    [path] = stored_files(tmp_path)
    path.write_text(content)
    calibration.load_or_calibrate(engine, tmp_path)
    assert len(counted) == 2 and json.loads(path.read_text())["key"] == calibration.calibration_key(engine)


def test_another_thread_count_is_another_calibration(engine, counted, tmp_path, monkeypatch):
    calibration.load_or_calibrate(engine, tmp_path)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    calibration.load_or_calibrate(engine, tmp_path)
    assert len(counted) == 2 and len(stored_files(tmp_path)) == 2


def test_an_unwritable_folder_still_starts(engine, counted, tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):
        model = calibration.load_or_calibrate(engine, blocked / "calibration")
    assert model.points()[1] == 0.002 and "could not store the step cost" in caplog.text
