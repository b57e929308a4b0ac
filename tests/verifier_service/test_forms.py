"""The served form chosen at start-up (``core/forms.py``): which forms are candidates on which
hardware, the fastest exact one kept, inexact ones left out, and the choice stored."""

from __future__ import annotations

import json

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
CONFIG = EngineConfig(max_batch_size=4)


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
    assert choice.form == Form("bfloat16", "int4", 1) and choice.timings == {}
    assert weights_form(choice.model) == "int4" and next(choice.model.parameters()).dtype == torch.bfloat16


def unmeasured(*args, **kwargs):
    raise AssertionError("measured")


def seconds_by_form(timings: dict[Form, float]):
    """A ``time_pass`` answering each form's seconds, told apart by its engine's model."""

    def time_pass(engine, tokens: int, rows: int) -> float:
        model = engine.model
        threads = torch.get_num_threads()
        form = Form(str(next(model.parameters()).dtype).removeprefix("torch."), weights_form(model), threads)
        return timings[form] * tokens / rows

    return time_pass


FOUR = [Form("float32", "float", 2), Form("float32", "float", 1), Form("bfloat16", "float", 2), Form("bfloat16", "float", 1)]


def test_the_fastest_form_is_chosen_then_its_thread_count_and_the_choice_is_kept(monkeypatch, tiny_tokenizer, tmp_path):
    seconds = {FOUR[0]: 0.05, FOUR[1]: 0.01, FOUR[2]: 0.03, FOUR[3]: 0.02}
    monkeypatch.setattr(forms, "time_pass", seconds_by_form(seconds))
    choice = choose_form(build(torch.float32), tiny_tokenizer, FOUR, CONFIG, tmp_path)
    # float32 at one thread would be fastest of all, but the thread counts are weighed for the
    # fastest form at torch's count only: bfloat16, then at one thread.
    assert choice.form == Form("bfloat16", "float", 1)
    assert set(choice.timings) == {FOUR[0], FOUR[2], FOUR[3]}
    assert choice.timings[FOUR[3]] < choice.timings[FOUR[2]] < choice.timings[FOUR[0]]
    assert next(choice.model.parameters()).dtype == torch.bfloat16
    [stored] = tmp_path.glob("form-*.json")
    assert json.loads(stored.read_text())["form"] == {"dtype": "bfloat16", "weights": "float", "threads": 1}

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


def test_a_bfloat16_form_whose_passes_would_not_be_invariant_is_left_out(monkeypatch, tiny_tokenizer):
    seconds = {FOUR[0]: 0.05, FOUR[2]: 0.01}
    monkeypatch.setattr(forms, "time_pass", seconds_by_form(seconds))
    monkeypatch.setattr("verifier_service.core.engine.choose_invariance", tiled)
    choice = choose_form(build(torch.float32), tiny_tokenizer, [FOUR[0], FOUR[2]], CONFIG)
    assert choice.form == FOUR[0] and set(choice.timings) == {FOUR[0]}
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
    assert set(timed) == set(FOUR[::2]) and all(seconds > 0 for seconds in timed.values())
    assert forms.pass_shapes(CONFIG) == [(1, 1), (4, 4), (9, 1), (16, 4)]
