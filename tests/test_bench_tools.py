"""The benchmarks' own tools: bench_core's reference oracle (every draft accepted), the draft replay, the hostile
run's abusers and tables, and bench_drafter's scoped calls."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math

import grpc
import numpy as np
import pytest

from bench.acceptance_curve import curve, expected_tokens
from bench.bench_core import ReferenceOracle, decode_batch
from bench.bench_drafter import BATCH, SHARED_SCOPE, TENANT_SCOPES, propose_requests, session_scopes, time_steps, warm_requests
from bench.bench_load import (
    GENERATED,
    PASSES,
    Credentials,
    Phase,
    answer_ngrams,
    hostile_tables,
    parse_args,
    settings,
    spread,
    tokens_per_pass,
)
from bench.draft_replay import accepted_path, ngram, prompt_lookup, replay, with_successors
from bench.hostile import DrafterLimits, Mix, made_up_predictions, parse_mix, poison_sequences, predicting_request, prediction_shapes
from bench.spec_bench import GROUPS, geometric_mean, load_groups, other_prompts
from drafter_service.config import DrafterConfig
from drafter_service.ngram import NGramConfig
from drafter_service.server import create_server
from drafter_service.sessions import NGramDrafter
from specdec.v1 import drafter_pb2_grpc
from verifier_service.core.drafting import DraftRequest, SessionProposer
from verifier_service.core.engine import SpeculativeEngine


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


# -- bench.hostile's tenant abusers, bench_load's hostile run, bench_drafter's scoped calls


def test_prediction_shapes_carry_exactly_the_tokens_asked_within_the_positions_cap():
    assert prediction_shapes(65_536, 1024, 16) == [(1024, 16)] * 4
    assert prediction_shapes(65_537, 1024, 16) == [(1024, 16)] * 4 + [(1, 1)]  # one token over: a position at k 1
    assert prediction_shapes(40, 2, 16) == [(2, 16), (2, 1), (2, 1), (2, 1), (2, 1)]  # 32 at k 16, 8 left at k 1, 2 a sequence
    assert prediction_shapes(3072, 1024, 1) == [(1024, 1)] * 3


def test_the_prediction_flood_fills_the_drafters_budget_and_one_token_more_is_refused(tmp_path):
    vocabulary = "0123456789abcdef"
    drafter = create_server(DrafterConfig(port=0, db=str(tmp_path / "db"), metrics_port=None, client_token="verifier-token"))
    try:
        limits, rng = DrafterLimits.of(drafter.servicer.config), np.random.default_rng(0)

        def predictions(total: int, k: int):
            return made_up_predictions(prediction_shapes(total, limits.predicted_positions, k), rng)

        with grpc.insecure_channel(f"127.0.0.1:{drafter.port}") as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            at_limit = predictions(limits.predictions_per_call, 16)
            assert sum(len(p.tokens) for p in at_limit) == 65_536
            stub.Propose(predicting_request(vocabulary, [f"a{i}" for i in range(len(at_limit))], at_limit, set(), ""), timeout=60)
            over = predictions(limits.predictions_per_call + 1, 16)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Propose(predicting_request(vocabulary, [f"b{i}" for i in range(len(over))], over, set(), ""), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "65537 predicted tokens in one call; the limit is 65536" in refused.value.details()
            # The successor fill's scope of its own making: a client without the token may not declare one.
            few = predictions(8, 1)
            with pytest.raises(grpc.RpcError) as declared:
                stub.Propose(predicting_request(vocabulary, ["c0"], few, set(), "ab" * 16), timeout=60)
            assert declared.value.code() == grpc.StatusCode.PERMISSION_DENIED
            stub.Propose(predicting_request(vocabulary, ["c0"], few, set(), ""), timeout=60)  # its own scope: taken
    finally:
        drafter.stop(grace=0)


def test_a_poisoning_call_is_copies_of_one_ngram_and_one_junk():
    assert poison_sequences((5, 6), [9], 2) == [[5, 6, 9], [5, 6, 9]]


def test_mixes_name_their_kinds_and_optionally_how_many_abusers():
    assert parse_mix("idle_streams, huge_bodies") == Mix(("idle_streams", "huge_bodies"))
    assert parse_mix("4:observe_flood") == Mix(("observe_flood",), 4)
    assert str(parse_mix("4:observe_flood,poisoning")) == "4:observe_flood,poisoning"
    for wrong in ("", "0:poisoning", "x:poisoning", "4:", "flood"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mix(wrong)


def test_the_poisoner_copies_every_distinct_ngram_of_the_honest_answers():
    assert answer_ngrams([[1, 2, 3, 1, 2], [2, 3]], 2) == ((1, 2), (2, 3), (3, 1))
    assert answer_ngrams([[1, 2]], 4) == ()  # an answer shorter than n gives none


def test_the_hostile_run_asks_a_few_prompts_spread_over_all():
    assert spread("abcdef", 3) == ["a", "c", "e"]
    assert spread("abc", 0) == spread("abc", 5) == ["a", "b", "c"]


def test_tokens_per_pass_is_every_generated_token_over_every_pass():
    assert tokens_per_pass({GENERATED: 30, PASSES: 12})["tokens_per_pass"] == 2.5
    assert tokens_per_pass({}) == {}
    # A phase sums its calls' counts per door: 2 of 3 tokens per pass on one door, 5 of 2 on the other.
    phase = Phase("p", 2, 0.05, lambda client, n: {GENERATED: 3, PASSES: 2} if client == 0 else {GENERATED: 5, PASSES: 2}, str)
    phase.run()
    summary = phase.summary()
    assert summary["by_door"]["0"]["tokens_per_pass"] == 1.5 and summary["by_door"]["1"]["tokens_per_pass"] == 2.5
    assert summary[GENERATED] == 3 * summary["by_door"]["0"]["completed"] + 5 * summary["by_door"]["1"]["completed"]


def test_made_keys_go_to_the_verifier_and_the_drafter_token_to_both_services(monkeypatch):
    for variable in ("SPECDEC_VERIFIER_API_KEY", "SPECDEC_VERIFIER_DRAFTER_TOKEN", "SPECDEC_DRAFTER_CLIENT_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    args = parse_args(["--honest-keys", "2"])
    credentials = Credentials(args)
    assert len(set(credentials.api_keys)) == 2
    verifier, drafter = credentials.verifier_env(), credentials.drafter_env()
    assert verifier["SPECDEC_VERIFIER_API_KEY"] == ",".join(credentials.api_keys)
    assert verifier["SPECDEC_VERIFIER_DRAFTER_TOKEN"] == drafter["SPECDEC_DRAFTER_CLIENT_TOKEN"]
    assert not any(key in json.dumps(settings(args)) for key in credentials.api_keys)
    given = Credentials(parse_args(["--api-key", "mine", "--open-drafter"]))
    assert given.api_keys == ("mine",)  # the user's key, which the user gives the verifier
    assert "SPECDEC_VERIFIER_API_KEY" not in given.verifier_env()
    assert "SPECDEC_DRAFTER_CLIENT_TOKEN" not in given.drafter_env() and "SPECDEC_VERIFIER_DRAFTER_TOKEN" not in given.verifier_env()
    assert Credentials(parse_args(["--honest-keys", "0"])).metadata() == ()


def test_the_honest_table_puts_each_run_beside_the_baseline():
    def honest(tokens_per_pass: float, p50: float) -> dict:
        cpu = {"verifier": 1.0, "drafter": 0.5, "bench": 0.1}
        return {
            "completed": 9,
            "failures": [],
            "tokens_per_pass": tokens_per_pass,
            "p50_ms": p50,
            "p95_ms": 2 * p50,
            "p99_ms": 3 * p50,
            "cpu_s": cpu,
        }

    tally = {"outcomes": {"poisoning": {"Observe OK": 3}}, "longest_held_s": {}, "tokens_taken": {"poisoning": 36}}
    run = {"mix": "4:poisoning", "abusers": 4, "honest": honest(1.5, 900), "abuser_outcomes": tally, "abusers_still_running": []}
    result = {
        "honest_clients": {"grpc": 1, "http": 1},
        "honest_keys": 2,
        "prompts": 8,
        "learning_s": 3.0,
        "seconds": 10,
        "baseline": honest(2.0, 800),
        "runs": [run | {"drafter_stats_change": {"entries": 12, "scopes": 1, "bytes": 0}}],
        "again": honest(1.9, 810),
        "memory_mb": {"peak": {"verifier": None, "drafter": None}},
        "after": {"grpc_request": "OK"},
    }
    lines = hostile_tables(result).splitlines()
    assert any(line.startswith("| 4:poisoning | 4 | 9 | 0 | 1.50 (2.00) | 900 (800) | 1,800 (1,600) | 2,700 |") for line in lines)
    assert any(line.startswith("| again | 0 | 9 | 0 | 1.90 (2.00) |") for line in lines)
    assert "| 4:poisoning | poisoning | Observe OK: 3 | 36 | entries +12, scopes +1 |" in lines


def test_the_drafter_bench_opens_sessions_in_tenant_scopes_and_reads_the_shared_one():
    tokens = list(range(10_000))
    assert session_scopes("default", 1) is None
    assert session_scopes("scoped", 1)[:4] == [TENANT_SCOPES[1], TENANT_SCOPES[2], TENANT_SCOPES[0], TENANT_SCOPES[1]]
    opening, step = list(propose_requests(tokens, 1, "v", verifier=1, layout="scoped"))
    assert [update.scope for update in opening.sequences] == session_scopes("scoped", 1)
    assert opening.shared_scope == step.shared_scope == SHARED_SCOPE and len(step.sequences) == BATCH
    assert all(update.scope == "" for update in step.sequences)  # a session keeps the scope it was opened in
    default = list(propose_requests(tokens, 1, "v", verifier=1, layout="default"))
    assert all(not request.shared_scope and not any(update.scope for update in request.sequences) for request in default)
    # "scoped": each tenant learns the first half of the warm text, the shared scope the second.
    learned = {(request.scope, len(request.sequences[0].tokens)) for request in warm_requests(list(range(200_000)), "scoped")}
    assert learned == {(scope, 100_000) for scope in TENANT_SCOPES} | {(SHARED_SCOPE, 100_000)}


def test_the_drafter_bench_times_the_verifiers_steps_in_turn_after_their_openings():
    calls = []
    streams = [iter(["open-a", "a1", "a2"]), iter(["open-b", "b1"])]
    times = time_steps(lambda request: calls.append(request) or request, streams)
    assert calls == ["open-a", "open-b", "a1", "b1", "a2"]
    assert len(times.wall_s) == len(times.cpu_s) == 3 and times.last_response == "a2"


def test_every_option_a_benchmark_reads_is_one_it_declares():
    """A renamed flag whose ``args.name`` was not renamed with it fails only when the
    benchmark runs, minutes in: read each program's source for both."""
    import re
    from pathlib import Path

    def declared_in(source: str) -> set[str]:
        declared = set()
        for match in re.finditer(r'add_argument\(\s*"([^"]+)"(?:\s*,\s*"([^"]+)")?([^)]*)', source, re.DOTALL):
            dest = re.search(r'dest="(\w+)"', match.group(3) or "")
            names = [name for name in match.group(1, 2) if name]
            long = [name for name in names if name.startswith("--")]
            declared.add(dest.group(1) if dest else (long or names)[0].lstrip("-").replace("-", "_"))
        return declared

    folder = Path(__file__).resolve().parent.parent / "bench"
    form_flags = declared_in((folder / "served.py").read_text())  # what add_form_flags declares
    assert form_flags == {"dtype", "weights", "threads"}
    for program in sorted(folder.glob("*.py")):
        source = program.read_text()
        declared = declared_in(source) | (form_flags if "add_form_flags(parser)" in source else set())
        read = set(re.findall(r"\bargs\.(\w+)", source))
        assert read <= declared, f"{program.name} reads args.{sorted(read - declared)} but declares no such flag"


def test_the_replication_bench_reports_each_phase_and_its_replicas_end_in_agreement(tmp_path):
    from bench.bench_replication import main as bench_replication

    out = tmp_path / "results"
    flags = ["--seconds", "1", "--rounds", "1", "--propose-steps", "8", "--lag-seconds", "1", "--sim-seconds", "3"]
    report = bench_replication([*flags, "--out", str(out)])
    assert json.loads((out / "replication.json").read_text()) == report
    phases = {"propose", "observe", "observe_saturated", "apply", "lag", "lag_saturated", "simulation"}
    assert set(report) >= {"machine", "settings", "table"} | phases
    for phase in ("propose", "observe", "observe_saturated"):
        assert set(report[phase]) >= {"without_log", "with_log", "p50_ratio"}
    # The paced load is half what the drafter without a log took at most.
    assert report["observe"]["rate_per_s"] == pytest.approx(report["observe_saturated"]["without_log"]["tokens_per_s"] / 2 / 384, rel=0.01)
    # The same text taught directly and through the log: the same tables, the same drafts.
    assert report["propose"]["drafts_equal"] is True
    assert report["apply"]["log_messages"] > 0 and report["lag"]["samples"] > 0
    simulation = report["simulation"]
    assert simulation["verifiers_per_replica"] == [3, 3, 2] and simulation["observe_ms"]["calls"] > 0
    # Once the traffic stopped, every replica applied the whole log and holds the same tables.
    assert simulation["positions_after"] == [simulation["log_messages"]] * 3
    assert len({json.dumps(tables, sort_keys=True) for tables in simulation["tables_after"]}) == 1
    assert simulation["converged"] is True
    assert report["table"].startswith("| measure | without log | with log | ratio | target |")


def test_spec_bench_verifies_suffix_decodings_drafts_whole_and_ours_adaptively():
    from bench.bench_spec import DEFAULT_METHODS, OURS, SUFFIX, new_proposer
    from bench.suffix_proposer import SuffixProposer
    from verifier_service.core.drafting import SessionProposer

    config, k = OURS["suffix"]
    assert k == SUFFIX.max_spec_tokens <= config.max_speculative_tokens  # every token it drafts is verified
    assert OURS["default"][1] is None  # adaptive
    assert "suffix" not in DEFAULT_METHODS  # it needs the bench extra
    assert isinstance(new_proposer("default"), SessionProposer)
    if importlib.util.find_spec("arctic_inference") is not None:
        assert isinstance(new_proposer("suffix"), SuffixProposer)
