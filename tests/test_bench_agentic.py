"""The agentic benchmark's workloads: deterministic, real text, each turn resending the earlier ones."""

from __future__ import annotations

import calendar
import inspect
import json
import pydoc_data.topics

import pytest

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
