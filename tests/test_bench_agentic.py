"""The agentic benchmark's parts: its workloads (deterministic, real text, each turn resending
the earlier ones), the SuffixDecoding adapter's bookkeeping (on a fake cache, so no compiled
extension is needed; one test uses the real cache where arctic_inference is installed), and
the driver: its turn loop, agents at once (loops grouped, each batch's passes counted once,
a small real run on the tiny model), its summary, its flags, llama.cpp's pass count (on a
fake) and the service mode's requests and metrics (no processes started)."""

from __future__ import annotations

import calendar
import importlib.util
import inspect
import json
import pydoc_data.topics
from types import SimpleNamespace

import pytest

from bench.agentic_service import Answer, Together, generate_request, metric_labels, metric_value
from bench.agentic_workloads import (
    KINDS,
    LOOPS_PER_KIND,
    MAX_DOCUMENT_CHARS,
    TURNS,
    agentic_loops,
    code_edits,
    conversation,
    document,
    function_source,
    tool_schema,
    tools,
)
from bench.bench_agentic import (
    MAX_AGENTS,
    BatchRecord,
    BatchRun,
    Run,
    TurnRecord,
    agent_groups,
    alone,
    batch_methods,
    batch_table,
    build_methods,
    engine_runner,
    llama_runner,
    markdown_tables,
    parse_args,
    run_phase,
    run_phases,
    service_runner,
    summarise,
)
from bench.suffix_proposer import SuffixProposer, SuffixSettings, chain_of
from specdec.v1 import verifier_pb2 as pb
from verifier_service.core.drafting import DraftRequest
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine

# --- workloads -----------------------------------------------------------------------


def test_loops_are_the_same_every_time():
    assert agentic_loops() == agentic_loops()


def test_every_kind_has_several_distinct_loops_of_four_turns():
    loops = agentic_loops()
    assert [loop.kind for loop in loops] == [kind for kind in KINDS for _ in range(LOOPS_PER_KIND)]
    assert len({loop.name for loop in loops}) == len(loops)
    assert len({loop.turns[0] for loop in loops}) == len(loops)  # no two loops open alike
    assert all(len(loop.turns) == TURNS == 4 for loop in loops)


def test_loops_and_turns_can_be_cut():
    loops = agentic_loops(2, 3)
    assert [loop.kind for loop in loops] == [kind for kind in KINDS for _ in range(2)]
    assert all(len(loop.turns) == 3 for loop in loops)
    with pytest.raises(ValueError):
        agentic_loops(LOOPS_PER_KIND + 1)


def test_each_turn_resends_the_earlier_turns_with_the_models_answers():
    answers = [f"answer {turn}" for turn in range(TURNS)]
    for loop in agentic_loops():
        first = conversation(loop, 0, [])
        assert first == [{"role": "system", "content": loop.system}] + [m.as_chat() for m in loop.turns[0]]
        for turn in range(1, TURNS):
            earlier, now = conversation(loop, turn - 1, answers), conversation(loop, turn, answers)
            added = [{"role": "assistant", "content": answers[turn - 1]}] + [m.as_chat() for m in loop.turns[turn]]
            assert now == earlier + added, loop.name


def test_a_turn_needs_the_answers_to_every_earlier_turn():
    loop = agentic_loops()[0]
    with pytest.raises(ValueError):
        conversation(loop, 2, ["only one answer"])
    with pytest.raises(ValueError):
        conversation(loop, TURNS, ["answer"] * TURNS)


def test_code_edits_are_read_off_the_function():
    source = "def f(data):\n    total = sum(data)\n    return total\n"
    assert code_edits(source) == [
        "Rename the local variable `total` to `total_value` everywhere in the function.",
        "Add a keyword-only parameter `verbose: bool = False` at the end of the signature. Do not use it yet.",
        "Rename the parameter `data` to `data_arg` everywhere in the function.",
        "Rename the function from `f` to `f_v2`.",
    ]
    # No local of its own: the first change removes the docstring instead.
    assert code_edits('def g(x):\n    """Doc."""\n    return x\n')[0] == "Remove the function's docstring."


def test_code_edit_loops_start_from_real_source_and_rename_what_it_holds():
    from bench.agentic_workloads import CODE_EDIT_FUNCTIONS

    loops = [loop for loop in agentic_loops() if loop.kind == "code_edit"]
    for loop, function in zip(loops, CODE_EDIT_FUNCTIONS):
        source = function_source(function)
        assert source in loop.turns[0][0].content
        for turn in loop.turns:
            request = turn[0].content
            if request.startswith("Rename"):
                old = request.split("`")[1]
                assert old in source, (loop.name, old)


def test_tool_schemas_are_json_built_from_real_signatures():
    loops = [loop for loop in agentic_loops() if loop.kind == "tool_calls"]
    for tool, loop in zip(tools(), loops):
        schema = tool_schema(tool)
        assert json.loads(json.dumps(schema)) == schema
        parameters = inspect.signature(tool.function).parameters
        properties = schema["function"]["parameters"]["properties"]
        assert list(properties) == [name for name, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        required = [name for name in properties if parameters[name].default is parameters[name].empty]
        assert schema["function"]["parameters"]["required"] == required
        # The system prompt carries the schema as JSON, after its instructions.
        assert json.loads(loop.system.split("Tools:\n", 1)[1]) == [schema]
    calendar_month = tool_schema(tools()[0])["function"]["parameters"]["properties"]
    assert calendar_month == {
        "theyear": {"type": "integer"},  # typed by the first call's argument (2024)
        "themonth": {"type": "integer"},
        "w": {"type": "integer", "description": "default: 0"},
        "l": {"type": "integer", "description": "default: 0"},
    }


def test_tool_results_are_what_the_real_function_returns():
    loops = [loop for loop in agentic_loops() if loop.kind == "tool_calls"]
    for tool, loop in zip(tools(), loops):
        asked = [json.loads(turn[0].content.split("arguments ", 1)[1].rstrip(".")) for turn in loop.turns if turn[0].role == "user"]
        results = [json.loads(turn[0].content)["result"] for turn in loop.turns if turn[0].role == "tool"]
        assert asked == list(tool.calls)
        assert results == [json.loads(json.dumps(tool.result(tool.function(**arguments)))) for arguments in tool.calls]
    assert json.loads(loops[0].turns[1][0].content)["result"] == calendar.month(2024, 2)


def test_os_stat_results_keep_no_times():
    [stat_tool] = [tool for tool in tools() if tool.name == "os_stat"]
    assert set(stat_tool.result(stat_tool.function(**stat_tool.calls[0]))) == {"st_mode", "st_size", "st_nlink"}


def test_documents_are_pydoc_topics_cut_at_a_paragraph():
    for loop in [loop for loop in agentic_loops() if loop.kind == "document_qa"]:
        topic = loop.name.split("/")[1]
        text = document(topic)
        assert pydoc_data.topics.topics[topic].startswith(text)
        assert len(text) <= MAX_DOCUMENT_CHARS
        assert text in loop.turns[0][0].content
        opening = loop.turns[1][0].content.split('begins "', 1)[1].rsplit('"', 1)[0]
        assert opening in " ".join(text.split())  # the quoted words are the document's own


def test_template_loops_fill_one_template_with_a_new_value_each_turn():
    for loop in [loop for loop in agentic_loops() if loop.kind == "template"]:
        requests = [turn[0].content for turn in loop.turns]
        assert len(set(requests)) == TURNS, loop.name
        assert len({request.split()[0] for request in requests}) == 1, loop.name  # one template
        assert all(len(turn) == 1 and turn[0].role == "user" for turn in loop.turns)


# --- the SuffixDecoding adapter ------------------------------------------------------


class FakeSuffixCache:
    """Records every call and holds each request's prompt and response as the real cache's trees
    would; ``speculate`` returns ``drafts[key]`` (tokens, parents) or, with a ``reference``,
    the reference's continuation of everything the request has seen."""

    def __init__(self, reference: list[int] | None = None, draft=([], [])) -> None:
        self.calls: list[tuple] = []
        self.sequences: dict[int, tuple[list[int], list[int]]] = {}
        self.reference, self.draft = reference, draft
        self.stopped: list[int] = []

    def start_request(self, key, prompt_token_ids):
        self.calls.append(("start", key, list(prompt_token_ids)))
        self.sequences[key] = (list(prompt_token_ids), [])

    def add_active_response(self, key, token_ids):
        self.calls.append(("add", key, list(token_ids)))
        self.sequences[key][1].extend(token_ids)

    def speculate(self, key, context, max_spec_tokens=None, max_spec_factor=1.0, min_token_prob=0.1):
        self.calls.append(("speculate", key, list(context), max_spec_tokens, max_spec_factor, min_token_prob))
        if self.reference is not None:
            seen = len(self.sequences[key][0]) + len(self.sequences[key][1])
            tokens = self.reference[seen : seen + max_spec_tokens]
            return SimpleNamespace(token_ids=tokens, parents=list(range(-1, len(tokens) - 1)))
        return SimpleNamespace(token_ids=list(self.draft[0]), parents=list(self.draft[1]))

    def stop_request(self, key):
        self.calls.append(("stop", key))
        self.stopped.append(key)


def test_suffix_first_call_starts_the_request_with_its_prompt():
    cache = FakeSuffixCache(draft=([9, 4], [-1, 0]))
    [draft] = SuffixProposer(cache=cache).propose([DraftRequest("seq-0", [5, 6, 7, 8], 3)])
    # The engine's first call holds the prompt and the token its prefill sampled (8).
    assert cache.calls == [("start", 0, [5, 6, 7]), ("add", 0, [8]), ("speculate", 0, [5, 6, 7, 8], 3, 1.0, 0.1)]
    assert draft.tokens == [9, 4]
    assert draft.parents == []  # a chain


def test_suffix_later_calls_add_only_new_tokens_and_match_the_last_tree_depth_tokens():
    cache = FakeSuffixCache()
    proposer = SuffixProposer(SuffixSettings(max_tree_depth=3, max_spec_tokens=5), cache)
    proposer.propose([DraftRequest("seq-0", [5, 6, 7, 8], 3)])
    cache.calls.clear()
    proposer.propose([DraftRequest("seq-0", [5, 6, 7, 8, 9, 10], 8)])
    # K 8 is capped at max_spec_tokens 5; the context is the last max_tree_depth (3) tokens.
    assert cache.calls == [("add", 0, [9, 10]), ("speculate", 0, [8, 9, 10], 5, 1.0, 0.1)]
    proposer.propose([DraftRequest("seq-0", [5, 6, 7, 8, 9, 10], 2)])  # nothing new: nothing added
    assert cache.calls[-1] == ("speculate", 0, [8, 9, 10], 2, 1.0, 0.1) and len(cache.calls) == 3


def test_suffix_asked_for_no_tokens_learns_them_but_does_not_speculate():
    # The cache reads max_spec_tokens 0 as "up to the tree depth": it must not be asked.
    cache = FakeSuffixCache(draft=([3], [-1]))
    [draft] = SuffixProposer(cache=cache).propose([DraftRequest("seq-0", [5, 6, 7], 0)])
    assert draft.tokens == []
    assert [call[0] for call in cache.calls] == ["start", "add"]


def test_suffix_close_adds_the_last_tokens_then_stops_the_request():
    cache = FakeSuffixCache()
    proposer = SuffixProposer(cache=cache)
    proposer.propose([DraftRequest("seq-0", [5, 6, 7, 8], 3)])
    proposer.close([("seq-0", [5, 6, 7, 8, 9, 1]), ("never-asked", [1, 2])])
    assert cache.calls[-2:] == [("add", 0, [9, 1]), ("stop", 0)]
    assert cache.sequences[0] == ([5, 6, 7], [8, 9, 1])
    calls = len(cache.calls)
    proposer.close([("seq-0", [5, 6, 7, 8, 9, 1])])  # closed already: nothing
    assert len(cache.calls) == calls


def test_suffix_session_ids_used_again_get_a_new_request():
    # Every engine counts its sessions from seq-0: a second engine's seq-0 must not be the first's.
    cache = FakeSuffixCache()
    proposer = SuffixProposer(cache=cache)
    proposer.propose([DraftRequest("seq-0", [5, 6], 2)])
    proposer.close([("seq-0", [5, 6])])
    proposer.propose([DraftRequest("seq-0", [7, 8], 2)])
    assert [call[:2] for call in cache.calls if call[0] == "start"] == [("start", 0), ("start", 1)]


def test_suffix_tree_drafts_are_cut_at_their_first_branch():
    assert chain_of([7, 8, 9], [-1, 0, 0]) == [7, 8]
    assert chain_of([7, 8, 9], [-1, 0, 1]) == [7, 8, 9]
    assert chain_of([7, 8], []) == [7, 8]


def _plain_output(model, tokenizer, prompt, new):
    [result] = SpeculativeEngine(model, tokenizer).generate([GenerationRequest(prompt, new, num_speculative_tokens=0)])
    return result.token_ids


@pytest.mark.parametrize("oracle", [True, False])
def test_suffix_in_the_engine_sees_exactly_the_sequence_and_changes_nothing(tiny_model, tiny_tokenizer, oracle):
    prompt, new, k = [2, 3, 4, 5, 6, 7], 20, 4
    plain = _plain_output(tiny_model, tiny_tokenizer, prompt, new)
    # Drafts that are always right (plain's own output), or always wrong (a token plain never emits).
    wrong = next(token for token in range(2, 64) if token not in plain)
    cache = FakeSuffixCache(reference=prompt + plain) if oracle else FakeSuffixCache(draft=([wrong] * k, list(range(-1, k - 1))))
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, SuffixProposer(cache=cache))
    [result] = engine.generate([GenerationRequest(prompt, new, num_speculative_tokens=k)])
    assert result.token_ids == plain
    # The cache held exactly the prompt, then exactly the output, and the request was stopped.
    assert cache.sequences == {0: (prompt, plain)} and cache.stopped == [0]
    if oracle:  # every draft accepted: k + 1 tokens a pass after the prefill's one
        assert result.stats.target_forward_passes == 1 + -(-(len(plain) - 1) // (k + 1))
    else:
        assert result.stats.accepted_tokens == 0 and result.stats.draft_tokens > 0


@pytest.mark.skipif(importlib.util.find_spec("arctic_inference") is None, reason="arctic-inference is not installed (the bench extra)")
def test_the_real_suffix_cache_drafts_a_repeated_request_from_its_first_answer(tiny_model, tiny_tokenizer):
    prompt, new = [2, 3, 4, 5, 6, 7], 40
    plain = _plain_output(tiny_model, tiny_tokenizer, prompt, new)
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, SuffixProposer())
    first, second = (engine.generate([GenerationRequest(prompt, new, num_speculative_tokens=8)])[0] for _ in range(2))
    assert first.token_ids == second.token_ids == plain
    # The global tree holds the first answer: the second is drafted from it, in fewer passes.
    assert second.stats.accepted_tokens > 0
    assert second.stats.target_forward_passes < first.stats.target_forward_passes


# --- the driver ----------------------------------------------------------------------


class StubTokenizer:
    """A prompt's ids: [its number of messages]; an answer's text names its tokens."""

    chat_template = "any"

    def __init__(self) -> None:
        self.sent: list[list[dict]] = []

    def apply_chat_template(self, messages, **_):
        self.sent.append(messages)
        return [len(messages)]

    def decode(self, tokens, skip_special_tokens=False):
        return f"answer {tokens}"


def test_run_phase_resends_plains_answers_and_compares_each_method_to_its_reference():
    loop = agentic_loops(1, 2)[0]
    prompts: list[list[int]] = []

    def plain(batch):
        prompts.extend(batch)
        return alone(Run([batch[0][0], 9], 1.0, 2))

    runners = {
        "plain": plain,
        "adaptive": lambda batch: alone(Run([batch[0][0], 9], 0.5, 1)),
        "suffix": lambda batch: alone(Run([batch[0][0], 8], 0.5, 1)),  # differs from plain
        "hf-greedy": lambda batch: alone(Run([5], 1.0, 1)),
        "hf-pld": lambda batch: alone(Run([5], 0.5, 1)),
    }
    tokenizer = StubTokenizer()
    records, batches = run_phase("cold", [loop], runners, tokenizer)
    assert batches == []  # one agent: no batch records
    # Turn 0: system + user; turn 1 adds plain's answer and the next user message.
    assert prompts == [[2], [4]]
    assert tokenizer.sent[1][2] == {"role": "assistant", "content": "answer [2, 9]"}
    assert [r.runs["adaptive"]["identical"] for r in records] == [True, True]
    assert [r.runs["suffix"]["identical"] for r in records] == [False, False]
    assert records[0].runs["hf-pld"]["identical"] is True  # against transformers' greedy, not plain


def test_summary_rates_speedups_and_identical_turns():
    def cell(tokens, seconds, passes, identical=None, drafted=0, accepted=0):
        counts = {"tokens": tokens, "seconds": seconds, "passes": passes, "drafted": drafted, "accepted": accepted}
        return counts | ({} if identical is None else {"identical": identical})

    records = [
        TurnRecord("cold", "code_edit", "code_edit/a", 0, 10, 0.5, {"plain": cell(10, 1.0, 10), "adaptive": cell(10, 0.5, 4, True, 10, 6)}),
        TurnRecord(
            "cold", "code_edit", "code_edit/a", 1, 20, 0.5, {"plain": cell(30, 3.0, 30), "adaptive": cell(30, 1.5, 12, False, 20, 18)}
        ),
        TurnRecord("cold", "template", "template/b", 0, 10, 0.5, {"plain": cell(20, 1.0, 20), "adaptive": cell(20, 1.0, 20, True)}),
    ]
    summary = summarise(records)
    code_edit = summary["cold"]["code_edit"]["adaptive"]
    assert code_edit["tokens_per_s"] == 20.0  # 40 tokens in 2 s
    assert code_edit["speedup_vs_plain"] == 2.0  # plain: 40 tokens in 4 s
    assert code_edit["tokens_per_pass"] == 2.5  # 40 tokens in 16 passes
    assert (code_edit["identical_turns"], code_edit["turns"]) == (1, 2)
    assert code_edit["acceptance_rate"] == 0.8  # 24 of 30 draft tokens
    assert summary["cold"]["code_edit"]["plain"]["acceptance_rate"] is None  # drafted none
    everything = summary["cold"]["all"]["adaptive"]
    assert everything["speedup_vs_plain"] == round((60 / 3.0) / (60 / 5.0), 3)
    assert "warm" not in summary or summary["warm"] == {}
    table = markdown_tables({"cold": summary["cold"]})
    assert "| cold | code_edit | 10.0 (×1.00) | 20.0 (×2.00) |" in table
    assert "adaptive 1/2" in table


# --- agents at once ------------------------------------------------------------------


def test_loops_run_agents_at_a_time_in_order():
    loops = agentic_loops()  # 16: four kinds of four
    groups = agent_groups(loops, 8)
    assert [len(group) for group in groups] == [8, 8]
    assert [loop.name for group in groups for loop in group] == [loop.name for loop in loops]
    assert {loop.kind for loop in groups[0]} == {"code_edit", "tool_calls"}  # kind by kind: the first eight are two kinds
    assert [len(group) for group in agent_groups(agentic_loops(3), 8)] == [8, 4]  # the last group is what is left
    assert agent_groups(loops[:3], 1) == [[loop] for loop in loops[:3]]
    with pytest.raises(ValueError):
        agent_groups(loops, 0)


def test_methods_without_batching_are_left_out_with_several_agents():
    names = ["adaptive", "suffix", "hf-pld", "llama-lookup"]
    assert batch_methods(names, 1) == (names, {})
    kept, skipped = batch_methods(names, 8)
    assert kept == ["adaptive", "suffix"]
    assert set(skipped) == {"hf-pld", "llama-lookup"}


class ChatStub:
    """Chat ids from the messages' text (a few ids per message, within the tiny model's vocabulary);
    an answer decodes to the names of its tokens, so a later turn's prompt holds it."""

    chat_template = "any"

    def apply_chat_template(self, messages, **_):
        return [2 + ord(char) % 60 for message in messages for char in message["content"][:6]]

    def decode(self, tokens, skip_special_tokens=False):
        return " ".join(f"t{token}" for token in tokens)


def test_run_phase_sends_each_turn_of_a_group_together_and_keeps_each_loops_history():
    loops = agentic_loops(1, 2)  # four loops, two turns
    sent: list[list[list[int]]] = []

    def plain(batch):
        sent.append(batch)
        return BatchRun([Run([len(ids), 9], 1.0, 2) for ids in batch], 1.5, 2, 3)

    def adaptive(batch):  # the second request differs from plain's
        return BatchRun([Run([len(ids), 9 if index == 0 else 8], 0.5, 1, 4, 2) for index, ids in enumerate(batch)], 0.5, 1, 2)

    records, batches = run_phase("cold", loops, {"plain": plain, "adaptive": adaptive}, ChatStub(), agents=2)
    # Two groups of two loops, two turns each: four batches of two prompts, eight requests.
    assert [len(batch) for batch in sent] == [2, 2, 2, 2]
    assert [b.loops for b in batches] == [(loops[0].name, loops[1].name)] * 2 + [(loops[2].name, loops[3].name)] * 2
    assert [(r.loop, r.turn) for r in records] == [(loop.name, turn) for pair in (loops[:2], loops[2:]) for turn in (0, 1) for loop in pair]
    # A loop's second turn holds its own first answer (plain's), not its batch-mate's.
    stub = ChatStub()
    for index, loop in enumerate(loops[:2]):
        first = len(sent[0][index])
        assert sent[1][index] == stub.apply_chat_template(conversation(loop, 1, [stub.decode([first, 9])]))
    assert batches[0].prompt_tokens == len(sent[0][0]) + len(sent[0][1])
    # The batch's own seconds and passes; the requests' counts summed.
    assert batches[0].runs["plain"] == {
        "tokens": 4,
        "seconds": 1.5,
        "passes": 2,
        "forward_passes": 3,
        "sequence_passes": 4,
        "drafted": 0,
        "accepted": 0,
        "requests": 2,
    }
    assert batches[0].runs["adaptive"]["identical"] == 1 and batches[0].runs["adaptive"]["drafted"] == 8
    assert [r.runs["adaptive"]["identical"] for r in records[:2]] == [True, False]


def _batch(phase, plain, adaptive):
    return BatchRecord(phase, ("a", "b"), 0, 100, 0.5, {"plain": plain, "adaptive": adaptive})


def _cell(tokens, seconds, passes, forward, sequence, identical=None, drafted=0, accepted=0, requests=8):
    counts = {"tokens": tokens, "seconds": seconds, "passes": passes, "forward_passes": forward, "sequence_passes": sequence}
    counts |= {"drafted": drafted, "accepted": accepted, "requests": requests}
    return counts | ({} if identical is None else {"identical": identical})


def test_a_batch_summary_counts_each_shared_pass_once():
    records = [
        _batch("cold", _cell(800, 4.0, 100, 110, 800), _cell(800, 2.0, 40, 48, 320, 7, 600, 480)),
        _batch("cold", _cell(400, 2.0, 50, 60, 400), _cell(400, 1.0, 20, 30, 160, 8, 300, 240)),
    ]
    summary = summarise(records, kinds=("all",))
    plain, adaptive = summary["cold"]["all"]["plain"], summary["cold"]["all"]["adaptive"]
    # Plain with 8 agents: 1,200 tokens in 150 shared passes, 8 a pass; a sequence gets 1 a pass.
    assert plain["tokens_per_pass"] == 8.0
    assert plain["tokens_per_pass_per_sequence"] == 1.0
    assert plain["tokens_per_forward_pass"] == round(1200 / 170, 3)  # prefill chunks included
    assert plain["tokens_per_s"] == 200.0  # the batches' wall times, 6 s, not their requests' summed
    assert adaptive["tokens_per_pass"] == 20.0  # 1,200 tokens in 60 passes
    assert adaptive["tokens_per_pass_per_sequence"] == 2.5  # in 480 passes of its sequences
    assert adaptive["speedup_vs_plain"] == 2.0
    assert adaptive["acceptance_rate"] == 0.8
    assert (adaptive["identical_turns"], adaptive["turns"]) == (15, 16)  # per request, not per batch
    assert list(summary["cold"]) == ["all"] and summary["warm"] == {}
    table = batch_table(summary, 8)
    assert "| cold | adaptive | 400.0 (×2.00) | 20.00 | 15.38 | 2.50 | 0.80 | 15/16 |" in table


def test_a_batch_summary_without_shared_passes_says_so():
    # Through the services a client sees each request's passes, never which they shared.
    records = [_batch("warm", _cell(800, 4.0, None, 110, 800), _cell(800, 2.0, None, 48, 320, 8))]
    adaptive = summarise(records, kinds=("all",))["warm"]["all"]["adaptive"]
    assert adaptive["tokens_per_pass"] is None
    assert adaptive["tokens_per_pass_per_sequence"] == 2.5
    assert "| warm | adaptive | 400.0 (×2.00) | – | 16.67 | 2.50 | – | 8/8 |" in batch_table(
        {"warm": {"all": summarise(records, kinds=("all",))["warm"]["all"]}}, 8
    )


def test_the_engine_runner_counts_a_batchs_passes_once(tiny_model, tiny_tokenizer):
    chunked = SpeculativeEngine(tiny_model, tiny_tokenizer, None, EngineConfig(prefill_chunk_tokens=4))
    prompts = [[2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]
    [first] = [engine_runner(chunked, 12, 0)([prompts[0]])]
    # Alone, the batch's passes are the request's own (its prefill once), and every pass adds
    # the two that only carried the prompt's first chunks (10 tokens in chunks of 4).
    assert first.passes == first.runs[0].passes
    assert first.forward_passes == first.passes + 2
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, step_cost=chunked.step_cost)
    each = [engine_runner(engine, 12, 0)([ids]).runs[0] for ids in prompts]
    together = engine_runner(engine, 12, 0)(prompts)
    assert [run.tokens for run in together.runs] == [run.tokens for run in each]
    # Plain, the prompts prefilled in one pass: a pass gives each unfinished sequence one token,
    # so the batch took as many passes as its longest output, and each sequence one a token.
    assert together.passes == together.forward_passes == max(len(run.tokens) for run in together.runs)
    assert [run.passes for run in together.runs] == [len(run.tokens) for run in together.runs]
    with pytest.raises(ValueError):
        engine_runner(engine, 4, 0)([[2, 3]] * (engine.slot_count + 1))


def test_two_agents_at_once_on_the_tiny_model_match_plain(tiny_model, tiny_tokenizer):
    runners = build_methods(tiny_model, tiny_tokenizer, 12, ["adaptive"], SuffixSettings(), 10)
    records, batches = run_phases(agentic_loops(1, 2), runners, ChatStub(), agents=2)
    assert len(records) == 2 * 4 * 2 and len(batches) == 2 * 2 * 2  # phases x loops x turns; phases x groups x turns
    assert all(record.runs["adaptive"]["identical"] for record in records)
    for batch in batches:
        plain = batch.runs["plain"]
        assert plain["requests"] == 2
        assert plain["passes"] == plain["forward_passes"] <= plain["sequence_passes"] == plain["tokens"]
        assert batch.runs["adaptive"]["passes"] <= plain["passes"]
    summary = summarise(batches, kinds=("all",))
    assert summary["warm"]["all"]["adaptive"]["identical_turns"] == summary["warm"]["all"]["adaptive"]["turns"] == 8
    assert summary["cold"]["all"]["plain"]["tokens_per_pass"] > 1  # two sequences a pass


# --- flags ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--agents", "0"], f"--agents must be in [1, {MAX_AGENTS}]"),
        (["--agents", "17"], f"--agents must be in [1, {MAX_AGENTS}]"),
        (["--agents", "8", "--loops", "1"], "--agents 8 needs at least 8 loops: --loops 1 gives 4"),
        (["--through-services", "--methods", "suffix"], "--through-services runs plain and adaptive only"),
        (["--through-services", "--methods", "adaptive", "hf-pld"], "hf-pld run(s) in this process"),
        (["--through-services", "--methods", "llama-lookup"], "llama-lookup run(s) in this process"),
        (["--methods", "llama-greedy", "--model", "some/other-model"], "llama"),
    ],
)
def test_flags_that_cannot_run_are_refused_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_resolve_each_modes_methods():
    services, skipped = parse_args(["--through-services", "--agents", "8"])
    assert (services.methods, skipped, services.agents) == (["adaptive"], {}, 8)
    batched, skipped = parse_args(["--agents", "16", "--methods", "adaptive", "hf-pld", "llama-lookup"])
    assert batched.methods == ["adaptive"] and set(skipped) == {"hf-pld", "llama-lookup"}
    assert parse_args(["--methods", "adaptive"])[0].agents == 1


# --- llama.cpp and the services ------------------------------------------------------


class FakeLlama:
    """llama-cpp-python's generate as far as run_llama uses it: the prompt evaluated in one call,
    then each step's token; tokens 5, 6, 7, ... never its end."""

    def __init__(self) -> None:
        self.evaluated: list[list[int]] = []

    def reset(self) -> None:
        pass

    def token_eos(self) -> int:
        return 1

    def eval(self, tokens) -> None:
        self.evaluated.append(list(tokens))

    def generate(self, tokens, **_):
        self.eval(tokens)
        token = 5
        while True:
            yield token
            self.eval([token])
            token += 1


def test_llama_passes_are_its_eval_calls_and_eval_is_left_as_it_was():
    llm = FakeLlama()
    [run] = llama_runner(llm, 3)([[9, 9, 9]]).runs
    assert run.tokens == [5, 6, 7]
    assert run.passes == 3  # the prompt's call, then one a step: as our prefill counts once
    assert llm.evaluated == [[9, 9, 9], [5], [6]]
    assert "eval" not in vars(llm)  # the class's method again
    with pytest.raises(ValueError):
        llama_runner(llm, 3)([[9], [9]])  # one prompt at a time


def test_service_requests_send_the_ids_greedy_with_k_only_when_fixed():
    adaptive = generate_request([5, 6, 7], 16, None)
    assert list(adaptive.prompt_token_ids) == [5, 6, 7] and not adaptive.prompt and not adaptive.chat
    assert adaptive.max_new_tokens == 16 and adaptive.temperature == 0.0
    assert not adaptive.HasField("num_speculative_tokens")  # unset: the server's adaptive K
    plain = generate_request([5], 16, 0)
    assert plain.HasField("num_speculative_tokens") and plain.num_speculative_tokens == 0


def test_service_metrics_are_read_from_the_exposition():
    text = (
        "# HELP specdec_verifier_step_seconds Time per decoding step\n"
        'specdec_verifier_step_seconds_bucket{le="0.005",model_name="m"} 3.0\n'
        'specdec_verifier_step_seconds_count{model_name="m"} 12.0\n'
        'specdec_verifier_model_info{dtype="bfloat16",model_name="m",threads="2"} 1.0\n'
    )
    assert metric_value(text, "specdec_verifier_step_seconds_count") == 12.0
    assert metric_value(text, "specdec_verifier_requests_total") is None
    assert metric_labels(text, "specdec_verifier_model_info") == {"dtype": "bfloat16", "model_name": "m", "threads": "2"}


def test_through_the_services_a_batchs_shared_passes_are_unknown_but_one_requests_are_its_own():
    def answer(tokens, passes):
        return Answer(tokens, 1.0, pb.GenerationStats(target_forward_passes=passes, draft_tokens=4, accepted_tokens=3))

    replies = {1: Together([answer([5, 6], 2)], 1.0, 3), 2: Together([answer([5, 6], 2), answer([7], 1)], 1.5, 4)}
    pair = SimpleNamespace(generate_together=lambda prompts, max_new_tokens, k: replies[len(prompts)])
    one = service_runner(pair, 16, None)([[2]])
    assert (one.passes, one.forward_passes, one.runs[0].drafted, one.runs[0].accepted) == (2, 3, 4, 3)
    two = service_runner(pair, 16, None)([[2], [3]])
    assert (two.passes, two.forward_passes, two.seconds) == (None, 4, 1.5)
    assert [run.passes for run in two.runs] == [2, 1]
