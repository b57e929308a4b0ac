"""The served form chosen at start-up (``core/forms.py``): which forms are candidates on which
hardware, the fastest exact one kept, inexact ones left out, and the choice stored."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.verifier_service.test_batch_invariance import build
from verifier_service.core import forms, model_loading
from verifier_service.core.engine_config import EngineConfig
from verifier_service.core.forms import Form, candidates, choose_form
from verifier_service.core.weights import weights_form

CPU = torch.device("cpu")
NATIVE_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2_ONLY = frozenset({"avx2", "fma"})
CONFIG = EngineConfig(max_batch_size=4, max_adaptive_k=8)  # chains of 8 drafts: the arithmetic below


@pytest.fixture
def cpu(monkeypatch):
    """Set the CPU's flags and torch's thread count the candidates see."""

    def set_cpu(flags: frozenset[str], threads: int = 2) -> None:
        monkeypatch.setattr(model_loading, "cpu_flags", lambda: flags)
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)

    return set_cpu


def pairs(found: list[Form]) -> list[tuple[str, str, int]]:
    return [(form.dtype, form.weights, form.threads) for form in found]


def test_left_to_itself_a_cpu_with_native_bfloat16_weighs_every_form_at_its_thread_counts(cpu):
    cpu(NATIVE_BF16, threads=2)
    assert pairs(candidates("auto", "auto", 0, CPU, "auto")) == [
        ("float32", "float", 2),
        ("float32", "float", 1),
        ("bfloat16", "float", 2),
        ("bfloat16", "float", 1),
        ("bfloat16", "int4", 2),
        ("bfloat16", "int4", 1),
    ]


def test_without_native_bfloat16_float_weights_stay_float32_and_int4_is_still_weighed(cpu):
    cpu(AVX2_ONLY, threads=1)
    assert pairs(candidates("auto", "auto", 0, CPU, "auto")) == [("float32", "float", 1), ("bfloat16", "int4", 1)]


def test_without_batch_invariant_passes_only_float32_can_be_exact(cpu):
    cpu(NATIVE_BF16)
    assert pairs(candidates("auto", "auto", 3, CPU, "off")) == [("float32", "float", 3)]


def test_named_forms_are_taken_as_named(cpu):
    cpu(AVX2_ONLY)
    assert pairs(candidates("bfloat16", "float", 2, CPU, "off")) == [("bfloat16", "float", 2)]
    assert pairs(candidates("auto", "int4", 2, CPU, "off")) == [("bfloat16", "int4", 2)]
    assert pairs(candidates("auto", "int8", 0, CPU, "auto")) == [("bfloat16", "int8", 2), ("bfloat16", "int8", 1)]
    assert pairs(candidates("float32", "auto", 2, CPU, "auto")) == [("float32", "float", 2)]


def test_int4_weights_where_the_kernel_does_not_run_are_refused_naming_the_flag(cpu):
    cpu(NATIVE_BF16)
    with pytest.raises(ValueError, match=r"--weights int4 runs on PyTorch's CPU kernel, which cuda lacks: use --weights float"):
        candidates("bfloat16", "int4", 1, torch.device("cuda"), "auto")
    with pytest.raises(ValueError, match=r"--weights int8 runs on PyTorch's CPU kernel, which cuda lacks: use --weights float"):
        candidates("auto", "int8", 1, torch.device("cuda"), "auto")


def test_one_candidate_is_taken_without_measuring(monkeypatch, tiny_tokenizer):
    monkeypatch.setattr(forms, "time_forms", unmeasured)
    choice = choose_form(build(torch.float32), tiny_tokenizer, [Form("bfloat16", "int4", 1)], CONFIG)
    assert choice.form == Form("bfloat16", "int4", 1) and choice.speeds == {}
    assert weights_form(choice.model) == "int4" and next(choice.model.parameters()).dtype == torch.bfloat16


def unmeasured(*args, **kwargs):
    raise AssertionError("measured")


def seconds_by_form(timings: dict[Form, float], calls: list | None = None):
    """A ``time_pass`` answering each form's seconds, told apart by its engine's model: a pass
    costs its tokens a row times the form's seconds (``timings[form]`` may also be a function
    of tokens and rows). Each call's (form, tokens, rows, cached) goes into ``calls``."""

    def time_pass(engine, tokens: int, rows: int, cached: int) -> float:
        model = engine.model
        threads = torch.get_num_threads()
        form = Form(str(next(model.parameters()).dtype).removeprefix("torch."), weights_form(model), threads)
        if calls is not None:
            calls.append((form, tokens, rows, cached))
        cost = timings[form]
        return cost(tokens, rows) if callable(cost) else cost * tokens / rows

    return time_pass


FOUR = [Form("float32", "float", 2), Form("float32", "float", 1), Form("bfloat16", "float", 2), Form("bfloat16", "float", 1)]


def test_the_fastest_form_is_chosen_then_its_thread_count_and_the_choice_is_kept(monkeypatch, tiny_tokenizer, tmp_path):
    seconds = {FOUR[0]: 0.05, FOUR[1]: 0.01, FOUR[2]: 0.03, FOUR[3]: 0.02}
    monkeypatch.setattr(forms, "time_pass", seconds_by_form(seconds))
    choice = choose_form(build(torch.float32), tiny_tokenizer, FOUR, CONFIG, tmp_path)
    # float32 at one thread would be fastest of all, but the thread counts are weighed for the
    # fastest form at torch's count only: bfloat16, then at one thread.
    assert choice.form == Form("bfloat16", "float", 1)
    assert set(choice.speeds) == {FOUR[0], FOUR[2], FOUR[3]}
    assert choice.speeds[FOUR[3]].score("balanced") > choice.speeds[FOUR[2]].score("balanced") > choice.speeds[FOUR[0]].score("balanced")
    assert next(choice.model.parameters()).dtype == torch.bfloat16
    [stored] = tmp_path.glob("form-*.json")
    content = json.loads(stored.read_text())
    assert content["form"] == {"dtype": "bfloat16", "weights": "float", "threads": 1}
    # What each form promised is kept beside it: a pass of one token in 0.02 s is 50 tokens/s.
    assert content["tokens_per_second"][str(FOUR[3])] == {"one_stream": pytest.approx(50.0), "batch": pytest.approx(200.0), "rows": 4}

    monkeypatch.setattr(forms, "time_forms", unmeasured)  # a later start takes it at once
    again = choose_form(build(torch.float32), tiny_tokenizer, FOUR, CONFIG, tmp_path)
    assert again.form == choice.form and again.stored and next(again.model.parameters()).dtype == torch.bfloat16


def test_a_stored_choice_under_another_key_or_unreadable_is_measured_again(monkeypatch, tiny_tokenizer, tmp_path):
    seconds = {FOUR[0]: 0.01, FOUR[1]: 0.02, FOUR[2]: 0.03, FOUR[3]: 0.04}
    monkeypatch.setattr(forms, "time_pass", seconds_by_form(seconds))
    first = choose_form(build(torch.float32), tiny_tokenizer, FOUR, CONFIG, tmp_path)
    assert first.form == FOUR[0] and not first.stored
    [stored] = tmp_path.glob("form-*.json")
    stored.write_text("{not json")
    assert not choose_form(build(torch.float32), tiny_tokenizer, FOUR, CONFIG, tmp_path).stored
    content = json.loads(stored.read_text())
    content["form"] = {"dtype": "bfloat16", "weights": "int4", "threads": 2}  # no candidate
    stored.write_text(json.dumps(content))
    assert not choose_form(build(torch.float32), tiny_tokenizer, FOUR, CONFIG, tmp_path).stored
    other = EngineConfig(max_batch_size=2)  # other passes timed: another key, another file
    choose_form(build(torch.float32), tiny_tokenizer, FOUR, other, tmp_path)
    assert len(list(tmp_path.glob("form-*.json"))) == 2
    monkeypatch.setattr(forms, "forward_name", lambda model: "transformers")  # passes computed otherwise: another key
    assert not choose_form(build(torch.float32), tiny_tokenizer, FOUR, CONFIG, tmp_path).stored
    assert len(list(tmp_path.glob("form-*.json"))) == 3
    # The same CPU with oneDNN held to fewer instruction sets computes otherwise: another key.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not choose_form(build(torch.float32), tiny_tokenizer, FOUR, CONFIG, tmp_path).stored
    assert len(list(tmp_path.glob("form-*.json"))) == 4


def test_a_bfloat16_form_whose_passes_would_not_be_invariant_is_left_out(monkeypatch, tiny_tokenizer):
    seconds = {FOUR[0]: 0.05, FOUR[2]: 0.01}
    monkeypatch.setattr(forms, "time_pass", seconds_by_form(seconds))
    monkeypatch.setattr("verifier_service.core.engine.choose_invariance", tiled)
    choice = choose_form(build(torch.float32), tiny_tokenizer, [FOUR[0], FOUR[2]], CONFIG)
    assert choice.form == FOUR[0] and set(choice.speeds) == {FOUR[0]}
    # Named by the flags with --batch-invariant off, it is weighed all the same.
    free = EngineConfig(max_batch_size=4, batch_invariant="off")
    assert choose_form(build(torch.float32), tiny_tokenizer, [FOUR[0], FOUR[2]], free).form == FOUR[2]


def tiled(model, most_rows):
    """A library whose GEMM rows depend on the call's row count: auto runs free shapes."""
    from verifier_service.core.invariance import DECODE_LINEAR_TILE, Invariance

    return Invariance(linear_tile=DECODE_LINEAR_TILE, token_attention=False)


def test_the_measured_passes_are_the_engine_s_own_shapes_and_every_form_computes(tiny_tokenizer):
    """Unfaked: each candidate's engine runs its timed passes, and a choice is made among them."""
    timed = forms.time_forms(
        {form: forms.probe_engine(forms.in_form(build(torch.float32), form), tiny_tokenizer, CONFIG) for form in FOUR[::2]},
        forms.pass_shapes(CONFIG),
    )
    assert forms.pass_shapes(CONFIG) == [(1, 1), (4, 4), (9, 1), (16, 4)]
    assert set(timed) == set(FOUR[::2])
    assert all(set(times) == set(forms.pass_shapes(CONFIG)) and min(times.values()) > 0 for times in timed.values())
    speeds = [forms.decode_speed(times, CONFIG) for times in timed.values()]
    assert all(speed.one_stream > 0 and speed.batch > 0 and speed.rows == 4 for speed in speeds)


# One stream, a pass of t tokens: flat (extra tokens free, as on a GPU) or t times one token's.
FLAT = {(1, 1): 0.01, (9, 1): 0.01, (4, 4): 0.02, (16, 4): 0.02}
LINEAR = {(1, 1): 0.01, (9, 1): 0.09, (4, 4): 0.02, (16, 4): 0.08}


def test_a_form_whose_extra_tokens_are_cheap_is_credited_with_what_speculation_yields_there():
    flat, linear = forms.decode_speed(FLAT, CONFIG), forms.decode_speed(LINEAR, CONFIG)
    # Linear cost: drafts never pay, so plain decoding's 100 tokens/s (and 4 rows / 0.02 s).
    assert linear.one_stream == pytest.approx(100.0) and linear.batch == pytest.approx(200.0)
    # Flat cost: a chain of 8 drafts, kept with odds 1/2 each, yields 2 - 1/256 tokens a pass;
    # the batch's 4 rows of 3 drafts each 4 * 1.875 a pass.
    assert flat.one_stream == pytest.approx(100.0 * (2 - 0.5**8)) and flat.batch == pytest.approx(4 * 1.875 / 0.02)
    # Counts between the timed ones cost by interpolation: with 9 tokens at 0.03 s, a pass of
    # one draft costs 0.0125 s and yields 1.5 tokens, the best depth (two: 1.75 in 0.015 s).
    halfway = forms.decode_speed({**LINEAR, (9, 1): 0.03}, CONFIG)
    assert halfway.one_stream == pytest.approx(1.5 / 0.0125)


ONE_STREAM_FAST = lambda tokens, rows: 0.01 * tokens if rows == 1 else 0.05 * tokens / rows  # noqa: E731
BATCH_FAST = lambda tokens, rows: 0.02 * tokens if rows == 1 else 0.01 * tokens / rows  # noqa: E731


@pytest.mark.parametrize(("mix", "expected"), [("latency", FOUR[0]), ("throughput", FOUR[2]), ("balanced", FOUR[2])])
def test_optimize_for_names_the_mix_the_forms_are_ranked_by_and_keys_the_stored_choice(
    monkeypatch, tiny_tokenizer, tmp_path, mix, expected
):
    # float32 decodes one stream at 100 tokens/s and 4 rows at 80; bfloat16 50 and 400.
    seconds = {FOUR[0]: ONE_STREAM_FAST, FOUR[2]: BATCH_FAST}
    monkeypatch.setattr(forms, "time_pass", seconds_by_form(seconds))
    config = EngineConfig(max_batch_size=4, optimize_for=mix)
    choice = choose_form(build(torch.float32), tiny_tokenizer, [FOUR[0], FOUR[2]], config, tmp_path)
    assert choice.form == expected and not choice.stored
    assert choice.speeds[FOUR[0]] == forms.Speed(pytest.approx(100.0), pytest.approx(80.0), 4)
    assert choice.speeds[FOUR[2]] == forms.Speed(pytest.approx(50.0), pytest.approx(400.0), 4)
    # Another mix is another key: measured again, never the choice stored for this one.
    other = "throughput" if mix == "latency" else "latency"
    again = choose_form(build(torch.float32), tiny_tokenizer, [FOUR[0], FOUR[2]], replace(config, optimize_for=other), tmp_path)
    assert not again.stored and again.form == {"latency": FOUR[0], "throughput": FOUR[2]}[other]
    assert choose_form(build(torch.float32), tiny_tokenizer, [FOUR[0], FOUR[2]], config, tmp_path).stored


def test_past_two_rounds_and_to_weigh_thread_counts_the_forms_are_timed_only_while_the_budget_lasts(monkeypatch, tiny_tokenizer):
    shapes = len(forms.pass_shapes(CONFIG))
    for budget, rounds in ((0.0, forms.MIN_ROUNDS), (600.0, forms.ROUNDS)):
        calls: list = []
        monkeypatch.setattr(forms, "time_pass", seconds_by_form(dict.fromkeys(FOUR, 0.01), calls))
        choice = choose_form(build(torch.float32), tiny_tokenizer, FOUR, replace(CONFIG, form_budget_s=budget))
        # A warm-up pass of each shape, then a pass of each a round, per form; every row reads the probe's context.
        by_form = {form: sum(call[0] == form for call in calls) for form in FOUR}
        assert by_form[FOUR[2]] == shapes * (1 + rounds)
        assert {cached for *_, cached in calls} == {forms.PROBE_CONTEXT}
        # The budget spent, float32's other thread count is not weighed (else both are, float32
        # at torch's count once more beside it).
        assert by_form[FOUR[1]] == (0 if budget == 0 else shapes * (1 + rounds))
        assert by_form[FOUR[0]] == shapes * (1 + rounds) * (1 if budget == 0 else 2)
        assert choice.form == FOUR[0] and set(choice.speeds) == ({FOUR[0], FOUR[2]} if budget == 0 else {FOUR[0], FOUR[1], FOUR[2]})
