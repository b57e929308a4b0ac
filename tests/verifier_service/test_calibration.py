"""StepCostModel on literal points: interpolation, padding, and folding in real step times;
a calibration measured within a time budget, and kept in a folder across starts
(load_or_calibrate), where only load-robust evidence (minima of repeats, low quantiles of
real steps) ever changes it. No test here times anything: timings and clocks are faked."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from verifier_service.core import calibration
from verifier_service.core.calibration import StepCostModel
from verifier_service.core.engine import EngineConfig, SpeculativeEngine

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


# -- the robust rules ---------------------------------------------------------------------


def stored_calibration(points: dict[int, float], per_context_token: float = 1e-7) -> calibration.StoredCalibration:
    return calibration.StoredCalibration(points, per_context_token, 8, True)


def test_lowered_docstring_examples():
    stored = stored_calibration({1: 0.4, 4: 0.5, 8: 1.0})
    lowered = stored.lowered({1: 0.25, 4: 0.5})
    assert lowered is not None and lowered.points == pytest.approx({1: 0.1, 4: 0.25, 8: 0.5})
    assert lowered.per_context_token == pytest.approx(5e-8)  # scaled as every cost
    busy = stored.lowered({1: 0.25, 4: 1.2})  # 4 tokens slower: a busy machine; 1 token's own bound still holds
    assert busy is not None and busy.points == pytest.approx({1: 0.1, 4: 0.5, 8: 1.0}) and busy.per_context_token == 1e-7


def test_lowered_keeps_the_costs_without_a_real_saving():
    stored = stored_calibration({1: 1.0, 4: 2.0})
    assert stored.lowered({1: 0.9}) is None  # 10%: within LOWER_MARGIN (15%)
    assert stored.lowered({1: 5.0, 4: 300.0}) is None  # a busy machine
    assert stored.lowered({}) is None
    assert stored.lowered({1: 0.8}).points == pytest.approx({1: 0.8, 4: 1.6})
    assert stored.lowered({2: 0.5}).points == pytest.approx({1: 0.5, 4: 1.0})  # a count between points bounds them all


def test_low_quantile_docstring_examples():
    assert calibration.low_quantile([5, 1, 4, 2, 3], 0.25) == 2
    assert calibration.low_quantile([5, 1, 4, 2, 3], 0.0) == 1
    assert calibration.low_quantile([7.0], 0.1) == 7.0


def test_measuring_order_puts_the_coarse_counts_first():
    assert calibration.measuring_order((1, 2, 3, 4, 5, 6, 12)) == [1, 2, 4, 12, 3, 5, 6]
    assert calibration.measuring_order(calibration.CALIBRATION_TOKENS)[:10] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 384]


# -- a calibration kept across starts ------------------------------------------------------

STORED = {1: 0.002, 4: 0.003, 16: 0.004}


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    """An engine with a step cost of its own, so load_or_calibrate is what the test calls."""
    return SpeculativeEngine(tiny_model, tiny_tokenizer, None, EngineConfig(max_batch_size=2), StepCostModel({1: 1.0}))


@pytest.fixture
def counted(monkeypatch):
    """calibrate_step_cost, counted, returning a fixed model (no timing in tests)."""
    calls = []

    def fake(engine, tokens=calibration.CALIBRATION_TOKENS, budget_s=None, clock=None, choose_forms=True):
        calls.append(engine)
        if tokens is not calibration.CALIBRATION_TOKENS:  # completing one cut short: the counts asked for
            return StepCostModel({count: 0.0035 for count in tokens}, per_context_token=1e-7)
        engine.kernels.up_to = 8
        return StepCostModel(dict(STORED), per_context_token=1e-7)

    monkeypatch.setattr(calibration, "calibrate_step_cost", fake)
    monkeypatch.setattr(calibration, "_fitting_tokens", lambda engine, tokens: [count for count in tokens if count in STORED])  # complete
    return calls


def probe_times(monkeypatch, seconds_by_count: dict[int, float]) -> list[int]:
    """_best_time answering ``seconds_by_count`` for each count timed; the counts, in order."""
    timed = []

    def fake(engine, repeats, decode_rows, segments, keep):
        timed.append(len(keep))
        return seconds_by_count[len(keep)]

    monkeypatch.setattr(calibration, "_best_time", fake)
    return timed


def cut_short(monkeypatch) -> None:
    """Calibrations from now on leave out a count they should measure (8), as one cut short by its budget."""
    monkeypatch.setattr(calibration, "_fitting_tokens", lambda engine, tokens: [count for count in tokens if count in (*STORED, 8)])


def stored_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("step-cost-*.json"))


def test_a_stored_calibration_is_served_without_calibrating_again(engine, counted, tmp_path, monkeypatch):
    first = calibration.load_or_calibrate(engine, tmp_path)
    [path] = stored_files(tmp_path)
    record = json.loads(path.read_text())
    assert len(counted) == 1 and record["key"] == calibration.calibration_key(engine)
    timed = probe_times(monkeypatch, STORED)
    engine.kernels.up_to = 0
    again = calibration.load_or_calibrate(engine, tmp_path)
    assert len(counted) == 1 and timed == []  # no second calibration, and no pass timed at all: a busy start waits on nothing
    assert again.points() == first.points() and again.per_context_token == first.per_context_token
    assert engine.kernels.up_to == 8  # the stored choice of linear-layer form, restored


def test_a_probe_under_load_keeps_a_calibration_cut_short(engine, counted, tmp_path, monkeypatch, caplog):
    cut_short(monkeypatch)
    calibration.load_or_calibrate(engine, tmp_path)
    [path] = stored_files(tmp_path)
    before = path.read_bytes()
    probe_times(monkeypatch, {1: 0.427, 4: 0.5, 16: 0.9})  # a machine 200x busier
    with caplog.at_level(logging.INFO):
        model = calibration.load_or_calibrate(engine, tmp_path)
    assert len(counted) == 1  # not measured again under load...
    assert path.read_bytes() == before  # ...nor overwritten
    assert model.points() == STORED  # served from the stored costs; real steps adjust them
    assert "kept; the machine is busier" in caplog.text and "1 tokens: 427.0 ms now, 2.0 ms stored" in caplog.text


def test_a_faster_probe_lowers_the_costs_of_a_calibration_cut_short(engine, counted, tmp_path, monkeypatch):
    cut_short(monkeypatch)
    calibration.load_or_calibrate(engine, tmp_path)
    [path] = stored_files(tmp_path)
    probe_times(monkeypatch, {1: 0.001, 4: 0.0012, 16: 0.002})  # halved, 0.4x, halved: 0.5 bounds them all
    model = calibration.load_or_calibrate(engine, tmp_path)
    lowered = {1: 0.001, 4: 0.0012, 16: 0.002, 8: 0.0035}  # 4 tokens by its own 0.4; 8 measured now
    assert model.points() == pytest.approx(lowered) and model.per_context_token == pytest.approx(5e-8)
    record = json.loads(path.read_text())
    assert {int(count): seconds for count, seconds in record["points"].items()} == pytest.approx(lowered)
    assert record["per_context_token"] == pytest.approx(5e-8) and record["up_to"] == 8
    assert len(counted) == 2  # and, the machine quiet, the count left out is measured


def test_the_probe_stops_at_its_budget(engine, counted, tmp_path, monkeypatch):
    cut_short(monkeypatch)
    calibration.load_or_calibrate(engine, tmp_path)
    now = [0.0]
    timed = []

    def slow(engine, repeats, decode_rows, segments, keep):
        timed.append(len(keep))
        now[0] += calibration.PROBE_BUDGET_S  # one count spends it all
        return 1.0

    monkeypatch.setattr(calibration, "_best_time", slow)
    calibration.load_or_calibrate(engine, tmp_path, clock=lambda: now[0])
    assert timed == [1]


@pytest.mark.parametrize("content", ["{not json", '{"key": 1}', "", '{"key": null, "points": []}'])
def test_an_unreadable_stored_calibration_costs_a_calibration_not_the_start(engine, counted, tmp_path, content, monkeypatch):
    calibration.load_or_calibrate(engine, tmp_path)
    [path] = stored_files(tmp_path)
    path.write_text(content)
    calibration.load_or_calibrate(engine, tmp_path)
    assert len(counted) == 2 and json.loads(path.read_text())["key"] == calibration.calibration_key(engine)


def test_a_file_without_complete_is_a_complete_calibration(engine, counted, tmp_path, monkeypatch):
    calibration.load_or_calibrate(engine, tmp_path)
    [path] = stored_files(tmp_path)
    record = json.loads(path.read_text())
    del record["complete"]  # as written before calibrations had a budget
    path.write_text(json.dumps(record))
    probe_times(monkeypatch, STORED)
    assert calibration.CalibrationFile(tmp_path, calibration.calibration_key(engine)).read().complete is True
    calibration.load_or_calibrate(engine, tmp_path)
    assert len(counted) == 1


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


# -- a calibration within its time budget --------------------------------------------------


def fake_clock_per_count(monkeypatch, seconds_per_count: float):
    """_best_time costing ``seconds_per_count`` of a fake clock per count (both forms of the
    linear layers and every repeat included); the clock and the counts timed."""
    now, timed = [0.0], []

    def fake(engine, repeats, decode_rows, segments, keep):
        if not timed or timed[-1] != len(keep):
            now[0] += seconds_per_count
        timed.append(len(keep))
        return 0.001 * len(keep) + 1e-6 * sum(cached for cached, _ in decode_rows)  # 1 us per cached token read

    monkeypatch.setattr(calibration, "_best_time", fake)
    return (lambda: now[0]), timed


def test_a_calibration_stops_at_its_budget_with_the_coarse_counts(engine, monkeypatch):
    clock, timed = fake_clock_per_count(monkeypatch, 1.0)
    model = calibration.calibrate_step_cost(engine, budget_s=3.5, clock=clock)
    # 1, 2, 4, 8 start at 0, 1, 2, 3 s (under 3.5); 16 would start at 4 s.
    assert sorted(model.points()) == [1, 2, 4, 8]
    assert set(timed) == {1, 2, 4, 8}
    assert model.per_context_token == 0.0  # measured after the coarse counts: the budget was gone


def test_a_calibration_within_its_budget_measures_every_count_and_the_context_term(engine, monkeypatch):
    clock, timed = fake_clock_per_count(monkeypatch, 1.0)
    model = calibration.calibrate_step_cost(engine, budget_s=1000.0, clock=clock)
    assert sorted(model.points()) == sorted(calibration.CALIBRATION_TOKENS)
    # 1 us per cached token read, less the one cached column per row the token counts were timed over.
    columns = min(calibration.CALIBRATION_COLUMNS, engine.cache.capacity - 3)
    assert model.per_context_token == pytest.approx(1e-6 * (columns - 1) / columns)


def test_a_second_pass_keeps_each_counts_minimum(engine, monkeypatch):
    passes = {}

    def bursty(engine, repeats, decode_rows, segments, keep):
        count = len(keep)
        passes[count] = passes.get(count, 0) + 1
        burst = count == 3 and passes[count] <= 2  # both forms' timings in the first pass hit a burst of load
        return 1.0 if burst else 0.001 * count

    monkeypatch.setattr(calibration, "_best_time", bursty)
    model = calibration.calibrate_step_cost(engine, budget_s=None)
    assert model.points()[3] == pytest.approx(0.003) and model.points()[2] == pytest.approx(0.002)


def test_a_calibration_cut_short_is_served_while_busy_and_completed_when_quiet(engine, tmp_path, monkeypatch, caplog):
    clock, timed = fake_clock_per_count(monkeypatch, 1.0)
    engine.config = EngineConfig(max_batch_size=2, calibration_budget_s=3.5)
    model = calibration.load_or_calibrate(engine, tmp_path, clock=clock)
    [path] = stored_files(tmp_path)
    record = json.loads(path.read_text())
    assert sorted(model.points()) == [1, 2, 4, 8] and record["complete"] is False
    up_to = record["up_to"]

    busy = probe_times(monkeypatch, {1: 1.0, 4: 1.0})
    with caplog.at_level(logging.INFO):
        again = calibration.load_or_calibrate(engine, tmp_path, clock=clock)
    assert busy == [1, 4]  # the probe's counts alone (16 was not measured): nothing more on a busy machine
    assert again.points() == model.points() and json.loads(path.read_text()) == record
    assert "cut short by its time budget" in caplog.text

    engine.config = EngineConfig(max_batch_size=2, calibration_budget_s=1000.0)
    for _ in range(10):  # as quiet as at the first start: each start measures 5 s (COMPLETION_BUDGET_S) of counts
        clock, timed = fake_clock_per_count(monkeypatch, 1.0)
        completed = calibration.load_or_calibrate(engine, tmp_path, clock=clock)
        record = json.loads(path.read_text())
        assert len(set(timed) - {1, 4, 16}) <= 5  # besides the probe's
        if record["complete"]:
            break
    assert sorted(completed.points()) == sorted(calibration.CALIBRATION_TOKENS) and record["complete"] is True
    assert completed.points()[1] == model.points()[1]  # the counts measured before are kept
    assert record["up_to"] == up_to == engine.kernels.up_to  # the form chosen first stands


# -- real steps ------------------------------------------------------------------------------


def kept_model(tmp_path: Path) -> tuple[calibration.KeptStepCostModel, Path]:
    file = calibration.CalibrationFile(tmp_path, {"format": calibration.STORED_FORMAT, "test": True})
    stored = calibration.StoredCalibration(dict(STORED), 1e-7, 8, True)
    assert file.write(stored)
    return calibration.KeptStepCostModel(stored, file), file.path


def test_busy_real_steps_never_reach_the_file(tmp_path):
    model, path = kept_model(tmp_path)
    before = path.read_bytes()
    for _ in range(calibration.CHECK_EVERY * 2):
        model.observe(4, 0, 3 * STORED[4])  # 3x slower: a busy machine
    assert path.read_bytes() == before
    assert model.points()[4] > STORED[4]  # while this process prices steps as they run now
    assert model.write_back() is False


def test_real_steps_lower_the_file_by_their_low_quantile(tmp_path):
    model, path = kept_model(tmp_path)
    busy, quiet = calibration.CHECK_EVERY - 20, 20
    # The last 100 steps at 4 tokens over 1000 cached reads: 80 busy ones (3x their stored
    # price) and 20 quiet ones (0.5x); their tenth quantile is a quiet one, so the file's
    # costs, the context term's too, are halved.
    price = STORED[4] + 1000 * 1e-7
    for ratio in [3.0] * busy + [0.5] * quiet:
        model.observe(4, 1000, ratio * price)
    record = json.loads(path.read_text())
    assert {int(count): seconds for count, seconds in record["points"].items()} == pytest.approx({1: 0.001, 4: 0.0015, 16: 0.002})
    assert record["per_context_token"] == pytest.approx(5e-8)


def test_real_steps_at_two_counts_lower_the_file_by_the_least_improved_and_their_own(tmp_path):
    model, path = kept_model(tmp_path)
    for step in range(calibration.CHECK_EVERY):
        if step % 2:
            model.observe(1, 0, 0.5 * STORED[1])
        else:
            model.observe(16, 0, 0.8 * STORED[16])
    points = json.loads(path.read_text())["points"]
    # 16 tokens improved least (0.8): every cost by that; 1 token by its own 0.5.
    assert points == pytest.approx({"1": 0.5 * STORED[1], "4": 0.8 * STORED[4], "16": 0.8 * STORED[16]})


def test_too_few_real_steps_at_a_count_are_no_evidence(tmp_path):
    model, path = kept_model(tmp_path)
    for step in range(calibration.CHECK_EVERY):  # 1 token at a tenth of its cost, but fewer than STEP_SAMPLES times
        model.observe(1, 0, 0.1 * STORED[1]) if step < calibration.STEP_SAMPLES - 1 else model.observe(20, 0, 1.0)
    assert json.loads(path.read_text())["points"]["1"] == STORED[1]


def test_free_and_batch_invariant_passes_keep_separate_calibrations(tiny_model, tiny_tokenizer):
    """Fixed shapes change what a pass costs, so a calibration measured with free passes is
    not served to fixed ones, nor the other way round."""
    keys = {}
    for mode in ("off", "on"):
        engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, EngineConfig(batch_invariant=mode), step_cost=StepCostModel({1: 1.0}))
        keys[mode] = calibration.calibration_key(engine)
    assert keys["off"]["passes"] == "free shapes; computed by llama_pass" and keys["on"]["passes"].startswith("batch-invariant: ")
    differing = {name for name in keys["off"] if keys["off"][name] != keys["on"][name]}
    assert "passes" in differing and differing <= {"passes", "cache_reads"}  # per-token reads go with per-token attention


def test_passes_computed_by_transformers_keep_a_calibration_of_their_own(tiny_model, tiny_tokenizer):
    """The Llama pass costs less than transformers' modules do, in other proportions."""
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, EngineConfig(), step_cost=StepCostModel({1: 1.0}))
    lean = calibration.calibration_key(engine)
    engine.target.lean = None
    modules = calibration.calibration_key(engine)
    assert lean["passes"].endswith("computed by llama_pass") and modules["passes"].endswith("computed by transformers")
    assert {name for name in lean if lean[name] != modules[name]} == {"passes"}
