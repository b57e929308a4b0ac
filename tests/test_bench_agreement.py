"""bench.bench_agreement: how close a served form comes to float32, teacher-forced on text."""

from __future__ import annotations

import copy
import json

import torch

from bench.bench_agreement import MAX_TOKENS, compare, main, markdown_table, measure, texts_of, token_texts
from tests.verifier_service.test_batch_invariance import VOCAB, build
from verifier_service.core.forms import Form

FLOAT32 = Form("float32", "float", 1)
BFLOAT16 = Form("bfloat16", "float", 1)
INT4 = Form("bfloat16", "int4", 1)
INT8 = Form("bfloat16", "int8", 1)


def random_texts(count: int = 4, length: int = 48, seed: int = 0, lowest: int = 2) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(lowest, VOCAB, (length,), generator=generator).tolist() for _ in range(count)]


def perturbed(model, scale: float, seed: int = 1):
    """A copy of ``model`` with Gaussian noise of ``scale`` times each weight matrix's spread added."""
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.add_(torch.randn(weight.shape, generator=generator) * scale * weight.std())
    return model


def greedy_texts(model, starts: list[list[int]], length: int = 32) -> list[list[int]]:
    """Each start (all of one length) continued by ``model``'s most likely next token (EOS held off) to ``length`` tokens."""
    added = length - len(starts[0])
    with torch.inference_mode():
        out = model.generate(torch.tensor(starts), max_new_tokens=added, min_new_tokens=added, do_sample=False)
    return out.tolist()


def test_the_texts_are_every_turn_of_every_question_in_file_order(tmp_path):
    questions = tmp_path / "question.jsonl"
    lines = [{"question_id": 1, "turns": ["first", "second"]}, {"question_id": 2, "turns": ["third"]}]
    questions.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert texts_of(questions) == ["first", "second", "third"]
    assert texts_of(questions, 2) == ["first", "second"]


def test_texts_are_cut_to_max_tokens_and_short_ones_left_out(tiny_tokenizer):
    long = " ".join(f"t{20 + i % 40}" for i in range(MAX_TOKENS + 88))
    texts = token_texts(tiny_tokenizer, [long, "t3 t4 t5 t6 t7 t8 t9", "t3 t4 t5 t6 t7 t8 t9 t20"])
    # 7 tokens are under MIN_TOKENS (8); 8 are enough.
    assert [len(text) for text in texts] == [MAX_TOKENS, 8]
    assert texts[1] == [3, 4, 5, 6, 7, 8, 9, 20]


def test_float32_against_itself_agrees_everywhere_with_no_gap():
    texts = random_texts()
    report = measure(build(torch.float32), texts, forms=[FLOAT32])
    assert report == {"float32": {"positions": 4 * 47, "agreement": 1.0, "mean_gap_nats": 0.0, "mean_abs_gap_nats": 0.0}}


def test_the_bfloat16_forms_move_the_log_probabilities():
    report = measure(build(torch.float32), random_texts(), forms=[BFLOAT16, INT4, INT8])
    assert set(report) == {"bfloat16", "bfloat16, int4 weights", "bfloat16, int8 weights"}
    for row in report.values():
        assert row["positions"] == 4 * 47
        assert row["agreement"] < 1.0 or row["mean_abs_gap_nats"] > 0
        assert row["mean_abs_gap_nats"] > 0 and abs(row["mean_gap_nats"]) <= row["mean_abs_gap_nats"]
    # 4-bit weights move the model further than bfloat16's rounding alone.
    assert report["bfloat16, int4 weights"]["mean_abs_gap_nats"] > report["bfloat16"]["mean_abs_gap_nats"]
    # 8 bits a scale per output move a float model less than 4 bits in groups of 32.
    assert report["bfloat16, int8 weights"]["mean_abs_gap_nats"] < report["bfloat16, int4 weights"]["mean_abs_gap_nats"]
    assert "| bfloat16, int4 weights | " in markdown_table(report)


def test_a_more_perturbed_model_agrees_less():
    reference = build(torch.float32)
    others = {"same": copy.deepcopy(reference), "slightly": perturbed(reference, 0.05), "strongly": perturbed(reference, 0.5)}
    report = compare(reference, others, random_texts())
    assert report["same"]["agreement"] == 1.0 and report["same"]["mean_abs_gap_nats"] == 0.0
    assert 1.0 > report["slightly"]["agreement"] > report["strongly"]["agreement"]
    assert 0.0 < report["slightly"]["mean_abs_gap_nats"] < report["strongly"]["mean_abs_gap_nats"]


def test_the_gap_is_positive_where_the_other_model_finds_the_text_less_likely():
    """Text that float32 writes itself is its most likely: another model finds it less likely."""
    reference = build(torch.float32)
    texts = greedy_texts(reference, [text[:4] for text in random_texts()])
    report = compare(reference, {"strongly": perturbed(reference, 0.5)}, texts)
    assert report["strongly"]["agreement"] < 1.0 and report["strongly"]["mean_gap_nats"] > 0


def test_the_report_is_written_with_its_fields(tmp_path, tiny_tokenizer, capsys):
    model_folder = tmp_path / "model"
    build(torch.float32).save_pretrained(model_folder)
    tiny_tokenizer.save_pretrained(model_folder)
    questions = tmp_path / "question.jsonl"
    # Words from t20 up, one token each (the tiny tokenizer reads "t10".."t19" as its EOS "t1" and another).
    turns = [" ".join(f"t{token}" for token in text) for text in random_texts(3, 20, lowest=20)]
    lines = [{"question_id": 1, "turns": turns[:2]}, {"question_id": 2, "turns": [turns[2], "t3 t4"]}]
    questions.write_text("\n".join(json.dumps(line) for line in lines) + "\n")

    main([str(questions), "--model", str(model_folder), "--out", str(tmp_path / "results")])

    written = json.loads((tmp_path / "results" / "agreement.json").read_text())
    meta = written["meta"]
    assert (meta["model"], meta["texts"], meta["texts_too_short"], meta["positions"]) == (str(model_folder), 3, 1, 3 * 19)
    assert {"machine", "torch", "threads"} <= set(meta)
    assert list(written["forms"]) == ["bfloat16", "bfloat16, int4 weights", "bfloat16, int8 weights"]
    for row in written["forms"].values():
        assert set(row) == {"positions", "agreement", "mean_gap_nats", "mean_abs_gap_nats"} and row["positions"] == 3 * 19
    assert markdown_table(written["forms"]) in capsys.readouterr().out
