"""The benchmarks' own tools: bench_core's reference oracle (every draft accepted) and the draft replay."""

from __future__ import annotations

import json
import math

import pytest

from bench.acceptance_curve import curve, expected_tokens
from bench.bench_core import ReferenceOracle, decode_batch
from bench.draft_replay import accepted_path, ngram, prompt_lookup, replay, with_successors
from bench.spec_bench import GROUPS, geometric_mean, load_groups, other_prompts
from drafter_service.ngram import NGramConfig
from drafter_service.sessions import NGramDrafter
from verifier_service.drafting import DraftRequest, SessionProposer
from verifier_service.engine import SpeculativeEngine


def test_oracle_drafts_the_rest_of_each_reference():
    oracle = ReferenceOracle([[5, 6, 7, 8, 9], [5, 6, 2, 3]])
    drafts = oracle.propose([DraftRequest("a", [5, 6, 7], 4), DraftRequest("b", [5, 6, 2], 4), DraftRequest("c", [4], 2)])
    assert [draft.tokens for draft in drafts] == [[8, 9], [3], []]


def test_oracle_at_fixed_k_is_accepted_whole_and_changes_nothing(tiny_model, tiny_tokenizer):
    prompts = [[2, 3, 4, 5], [7, 8, 9, 10, 11, 12], [20, 21, 22]]
    k, new = 4, 17
    plain, _, _ = decode_batch(SpeculativeEngine(tiny_model, tiny_tokenizer, SessionProposer(NGramDrafter())), prompts, new, 0)
    oracle = ReferenceOracle([prompt + output for prompt, output in zip(prompts, plain)])
    tokens, _, stats = decode_batch(SpeculativeEngine(tiny_model, tiny_tokenizer, oracle), prompts, new, k)
    assert tokens == plain
    # Each row pass after the first token yields k + 1 tokens but for each sequence's last.
    assert stats["row_passes"] == sum(math.ceil((len(output) - 1) / (k + 1)) for output in plain)
    # Every pass kept its draft but each sequence's last (16 tokens in passes of 5: 1 left, no room for a draft).
    assert stats["accepting"] == stats["row_passes"] - len(prompts)


def test_replay_advances_by_the_accepted_prefix_plus_one():
    # Prefill gave 3; the context [1 2 3 4 1 2 3] drafts 4 1 2 3 (cut to the 4 tokens left),
    # the output goes on 4 1 2 7: three accepted, then the target's 7, in one pass.
    report = replay(ngram(NGramConfig()), [([1, 2, 3, 4, 1, 2], [3, 4, 1, 2, 7])], k=8)
    assert report["passes"] == 1
    assert report["tokens_per_pass"] == 4
    assert report["accepted_share_of_drafted"] == 0.75
    assert report["pass_kinds"] == {"partly": 1.0}


def test_replay_counts_passes_without_drafts():
    report = replay(prompt_lookup(most_recent=True), [([5, 6], [7, 8, 9])], k=4)
    assert report == {"passes": 2, "tokens_per_pass": 1.0, "accepted_share_of_drafted": 0.0, "pass_kinds": {"no draft": 1.0}}


def test_a_tree_pass_follows_the_reference_through_the_children():
    assert accepted_path([4, 7, 3, 9], [-1, 0, -1, 2], [3, 9, 5]) == 2  # the second child of the root, then its child
    assert accepted_path([4, 7, 3, 9], [-1, 0, -1, 2], [5]) == 0


def test_replay_of_a_tree_rule_accepts_a_branch_the_chain_misses():
    # (9, 1, 2) went to 4 and (1, 2) also to 3: the chain drafts 4, the tree 4 and 3.
    context, output = [1, 2, 3, 9, 1, 2, 4, 7, 9, 1], [2, 3, 9, 8]
    chain = replay(ngram(NGramConfig(n_max=3)), [(context, output)], k=2)
    tree = replay(ngram(NGramConfig(n_max=3), nodes=8), [(context, output)], k=2)
    assert chain["tokens_per_pass"] < tree["tokens_per_pass"]
    assert tree["passes"] == 1 and tree["pass_kinds"] == {"all accepted": 1.0}  # 3 then 9: the whole depth, plus one


def test_acceptance_curve_bins_requests_by_their_acceptance():
    # K=2. First request: 2 + 2 + 0 accepted, one rejection (the 0): a = 0.8. Second: 1 accepted, one rejection: a = 0.5.
    rows = curve([[2, 2, 0], [1]], k=2)
    assert [(row["bin"], row["alpha"], row["passes"]) for row in rows] == [([0.4, 0.6], 0.5, 1), ([0.8, 0.9], 0.8, 3)]
    assert rows[0]["measured_tokens_per_pass"] == 2.0 and rows[0]["expected_tokens_per_pass"] == 1.75  # (1 - 0.5^3) / 0.5
    assert rows[1]["measured_tokens_per_pass"] == 2.333 and rows[1]["expected_tokens_per_pass"] == 2.44  # (1 - 0.8^3) / 0.2
    assert expected_tokens(1.0, 4) == 5.0


def test_spec_bench_groups_spread_over_each_group_in_id_order(tmp_path):
    lines = [{"question_id": i, "category": "writing" if i < 4 else "roleplay", "turns": [f"q{i}", "second turn"]} for i in range(8)]
    lines += [{"question_id": 100 + i, "category": group, "turns": [f"{group}{i}"]} for group in GROUPS[1:] for i in range(2)]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in reversed(lines)) + "\n")
    groups = load_groups(path, 2)
    assert list(groups) == list(GROUPS)
    assert groups["mt_bench"] == ["q0", "q4"]  # both of MT-Bench's categories, first turns only
    assert groups["rag"] == ["rag0", "rag1"]
    with pytest.raises(ValueError, match=r"group translation has 2 questions, fewer than --per-group 3"):
        load_groups(path, 3)
    assert geometric_mean([1.0, 4.0]) == pytest.approx(2.0)


def test_spec_bench_teaching_prompts_are_never_measured_ones(tmp_path):
    lines = [{"question_id": i, "category": group, "turns": [f"{group}{i}"]} for group in GROUPS for i in range(6)]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    measured, taught = load_groups(path, 2), other_prompts(path, 2, 2)
    assert measured["qa"] == ["qa0", "qa3"]
    assert taught["qa"] == ["qa1", "qa4"]  # spread over the four left: 1, 2, 4, 5
    assert all(not set(taught[group]) & set(measured[group]) for group in GROUPS)
    with pytest.raises(ValueError, match=r"group mt_bench has 4 questions besides the 2 measured, fewer than 5"):
        other_prompts(path, 2, 5)


def test_replay_with_the_successor_table_drafts_what_the_target_predicted_earlier():
    # Output 3 4 9 3 4 7: at "... 9 3" no n-gram of 2+ tokens recurs, but the target
    # predicted 4 after 3 two tokens in: the successor table drafts 4, then n-grams 9 (wrong, 7).
    prompt, output = [1, 2], [3, 4, 9, 3, 4, 7]
    tokens = prompt + output
    predictions = [(tokens[i + 1],) if i + 1 < len(tokens) else (0,) for i in range(len(tokens))]
    references = [(prompt, output)]
    plain = replay(ngram(NGramConfig()), references, k=8)
    successors = replay(with_successors(references, [predictions], NGramConfig()), references, k=8)
    assert plain["tokens_per_pass"] == 1.0
    assert successors["passes"] == plain["passes"] - 1 and successors["tokens_per_pass"] > 1.0


def test_replay_with_the_prompts_predictions_learns_them_from_prefill():
    # The target predicted 9 after the prompt's 7; only the prompt's predictions know it
    # when the output reaches 7 again.
    prompt, output = [7, 1, 2], [3, 7, 9]
    predictions = [(9,), (2,), (3,), (7,), (9,), (0,)]
    references = [(prompt, output)]
    decoded_only = replay(with_successors(references, [predictions], NGramConfig()), references, k=8)
    with_prompt = replay(with_successors(references, [predictions], NGramConfig(), prompt_predictions=True), references, k=8)
    assert decoded_only["tokens_per_pass"] == 1.0
    assert with_prompt["tokens_per_pass"] == 1.5 and with_prompt["pass_kinds"] == {"all accepted": 0.5, "no draft": 0.5}


def test_the_service_bench_counts_a_drafters_records_from_its_files(tmp_path):
    from bench.bench_spec_service import table_records
    from drafter_service.store import LMDBNGramStore, StoreConfig

    with LMDBNGramStore(StoreConfig(path=str(tmp_path / "db" / "table"), namespace=b"testvoc0")) as store:
        store.observe([1, 2, 3, 4, 5, 1, 2, 3])
        store.record_successors([((5,), (1, 2)), ((4, 5), (1,)), ((7,), (8,))])
        entries = store.stats()["entries"]
    assert entries > 0
    assert table_records(tmp_path / "db") == {"ngrams": entries, "successors": 3}


def test_the_methods_table_shows_each_method_against_plain_and_its_accepted_pass_share():
    from bench.bench_spec import methods_table

    rows = {
        "plain": {"tokens_per_s": 10.0, "speedup_vs_plain": 1.0, "tokens_per_pass": 1.0, "passes_with_accepted_draft": 0.0},
        "default": {"tokens_per_s": 12.0, "speedup_vs_plain": 1.2, "tokens_per_pass": 1.4, "passes_with_accepted_draft": 0.25},
        "head": {"tokens_per_s": 18.0, "speedup_vs_plain": 1.8, "tokens_per_pass": 2.1, "passes_with_accepted_draft": 0.6},
    }
    other = {name: {**row, "speedup_vs_plain": row["speedup_vs_plain"] * 2} for name, row in rows.items()}
    table = methods_table({"qa": rows, "rag": other}, ["plain", "default", "head"]).splitlines()
    share = "tokens/pass, passes with an accepted draft"
    assert table[0] == f"| group | plain tok/s | default ×plain | head ×plain | default {share} | head {share} |"
    assert table[2] == "| qa | 10.0 | 1.20 | 1.80 | 1.40, 25% | 2.10, 60% |"
    assert table[-1].startswith(f"| **geometric mean** | | **{math.sqrt(1.2 * 2.4):.2f}** | **{math.sqrt(1.8 * 3.6):.2f}** |")
