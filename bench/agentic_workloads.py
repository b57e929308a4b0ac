"""Agent loops built from real text that ships with Python: the workloads where model-free drafting pays most.

An agent framework resends the whole conversation every turn: its system prompt, each
user message or tool result, and the model's own earlier answers. So a loop here is a
system prompt and a list of turns, each adding the messages that come before one
model answer; ``conversation(loop, turn, answers)`` is what the framework would send
for that turn, given the model's answers to the turns before it.

Four kinds, several loops each (``LOOPS_PER_KIND``), ``TURNS`` turns each:

* ``code_edit``: a standard-library function (``inspect.getsource``) to be returned
  whole after one change per turn, the changes read off its own syntax tree (rename a
  local, add a keyword-only parameter, rename a parameter, rename the function);
* ``tool_calls``: one tool whose JSON schema is built from a real function's
  ``inspect.signature``; the user asks for two calls, and each call is answered by a
  tool result that the real function computed (``calendar``, ``os.stat``, ...);
* ``document_qa``: questions over one ``pydoc_data.topics`` document in the context,
  each naming a part of that document (a paragraph's opening words, its last paragraph);
* ``template``: one request template filled with a real value per turn (a module and
  its docstring, an exception and its docstring, a named tuple's fields as a table,
  a function's signature), as a batch job sends it (AgenticSQL's case).

Only the instructions are ours; the text the answers draw on is the standard library's.
Everything is deterministic for one Python installation (``os.stat`` keeps its size,
mode and link count, never its times).
"""

from __future__ import annotations

import ast
import calendar
import difflib
import email.utils
import inspect
import json
import os
import pydoc_data.topics
import re
import shutil
import statistics
import sysconfig
import textwrap
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("code_edit", "tool_calls", "document_qa", "template")
TURNS = 4  # model answers per loop: enough for a loop's history to outweigh its first prompt
LOOPS_PER_KIND = 4
# A document's paragraphs are kept up to this many characters (~1,000 tokens), so the fourth
# turn's prompt stays under ~2,000 tokens: a 2-core CPU prefills it in about a second.
MAX_DOCUMENT_CHARS = 4000


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user", "assistant" or "tool"
    content: str

    def as_chat(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class AgentLoop:
    kind: str
    name: str  # "<kind>/<what it is built from>", unique
    system: str
    # The messages each turn adds before the model answers it.
    turns: tuple[tuple[Message, ...], ...]


def conversation(loop: AgentLoop, turn: int, answers: Sequence[str]) -> list[dict[str, str]]:
    """The chat messages an agent framework sends for ``turn`` (0-based): the system prompt,
    then every earlier turn's messages each followed by the model's answer to it, then this
    turn's messages. ``answers`` holds the model's answers to turns 0 .. turn-1.

    Turns [(u0,), (t1,)], answers ["a0"], turn 1 -> [system, u0, assistant a0, t1].
    """
    if not 0 <= turn < len(loop.turns) or len(answers) < turn:
        raise ValueError(f"turn {turn} of {len(loop.turns)} needs {turn} answers, got {len(answers)}")
    messages = [Message("system", loop.system).as_chat()]
    for earlier in range(turn):
        messages += [message.as_chat() for message in loop.turns[earlier]]
        messages.append(Message("assistant", answers[earlier]).as_chat())
    return messages + [message.as_chat() for message in loop.turns[turn]]


def agentic_loops(loops_per_kind: int = LOOPS_PER_KIND, turns: int = TURNS) -> list[AgentLoop]:
    """Every kind's first ``loops_per_kind`` loops, kind by kind, each cut to ``turns`` turns."""
    if not 1 <= loops_per_kind <= LOOPS_PER_KIND or not 1 <= turns <= TURNS:
        raise ValueError(f"loops_per_kind must be in [1, {LOOPS_PER_KIND}] and turns in [1, {TURNS}]")
    built = [*code_edit_loops(), *tool_call_loops(), *document_loops(), *template_loops()]
    chosen = [loop for kind in KINDS for loop in [loop for loop in built if loop.kind == kind][:loops_per_kind]]
    return [AgentLoop(loop.kind, loop.name, loop.system, loop.turns[:turns]) for loop in chosen]


# --- code_edit -----------------------------------------------------------------------

CODE_EDIT_FUNCTIONS: tuple[Callable, ...] = (
    textwrap.dedent,
    difflib.get_close_matches,
    statistics.variance,
    email.utils.formataddr,
)
CODE_EDIT_SYSTEM = "You are a coding agent. You edit Python code exactly as asked and change nothing else."
RETURN_WHOLE = "Reply with the whole function after the change, in one Python code block, and nothing else."


def function_source(function: Callable) -> str:
    return textwrap.dedent(inspect.getsource(function))


def code_edits(source: str) -> list[str]:
    """One change per turn, read off the function's syntax tree: rename its first local
    with a name of two or more characters (else its first local), add a keyword-only
    parameter, rename its first parameter (not self or cls), rename the function.

    ``def f(data):\\n    total = sum(data)\\n    return total`` -> renames ``total`` to
    ``total_value``, adds ``verbose``, renames ``data`` to ``data_arg``, ``f`` to ``f_v2``.
    """
    function = ast.parse(source).body[0]
    assert isinstance(function, ast.FunctionDef), "a function's source"
    arguments = function.args
    parameters = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs] if a.arg not in ("self", "cls")]
    local_names: list[str] = []
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in parameters + local_names:
            local_names.append(node.id)
    edits = []
    named = [name for name in local_names if len(name) > 1] or local_names
    if named:
        edits.append(f"Rename the local variable `{named[0]}` to `{named[0]}_value` everywhere in the function.")
    else:  # no local to rename: a change of the same size
        edits.append("Remove the function's docstring.")
    edits.append("Add a keyword-only parameter `verbose: bool = False` at the end of the signature. Do not use it yet.")
    if parameters:
        edits.append(f"Rename the parameter `{parameters[0]}` to `{parameters[0]}_arg` everywhere in the function.")
    edits.append(f"Rename the function from `{function.name}` to `{function.name}_v2`.")
    return edits


def code_edit_loops() -> list[AgentLoop]:
    loops = []
    for function in CODE_EDIT_FUNCTIONS:
        source = function_source(function)
        qualified = f"{function.__module__}.{function.__qualname__}"
        first, *rest = code_edits(source)
        turns = [
            (
                Message(
                    "user", f"Here is `{qualified}` from the Python standard library:\n\n```python\n{source}```\n\n{first} {RETURN_WHOLE}"
                ),
            )
        ]
        turns += [(Message("user", f"{edit} {RETURN_WHOLE}"),) for edit in rest]
        loops.append(AgentLoop("code_edit", f"code_edit/{qualified}", CODE_EDIT_SYSTEM, tuple(turns[:TURNS])))
    return loops


# --- tool_calls ----------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A real function offered as a tool: ``name`` as the model calls it, two calls' arguments,
    and how a call's result is shown (a JSON-ready value)."""

    name: str
    function: Callable
    calls: tuple[dict[str, Any], dict[str, Any]]
    result: Callable[[Any], Any] = str


def stdlib_path(*parts: str) -> str:
    return os.path.join(sysconfig.get_paths()["stdlib"], *parts)


def stat_fields(result: os.stat_result) -> dict[str, int]:
    """The fields of ``os.stat`` that stay put on one installation (never its times or inode)."""
    return {"st_mode": result.st_mode, "st_size": result.st_size, "st_nlink": result.st_nlink}


def public_names(module) -> list[str]:
    return [name for name in sorted(dir(module)) if not name.startswith("_")]


def docs_urls(count: int) -> list[str]:
    """The first ``count`` distinct web addresses quoted in ``pydoc_data.topics``, topics in name order."""
    urls: list[str] = []
    for topic in sorted(pydoc_data.topics.topics):
        for url in re.findall(r"https?://[^\s\"'<>)]+", pydoc_data.topics.topics[topic]):
            if url.rstrip(".,") not in urls:
                urls.append(url.rstrip(".,"))
    return urls[:count]


def tools() -> list[Tool]:
    first_url, second_url = docs_urls(2)
    return [
        Tool("calendar_month", calendar.month, ({"theyear": 2024, "themonth": 2}, {"theyear": 1999, "themonth": 12})),
        Tool(
            "urllib_parse_urlsplit",
            urllib.parse.urlsplit,
            ({"url": first_url}, {"url": second_url}),
            lambda split: split._asdict(),
        ),
        Tool(
            "os_stat",
            os.stat,
            ({"path": stdlib_path("json", "__init__.py")}, {"path": stdlib_path("calendar.py")}),
            stat_fields,
        ),
        Tool(
            "difflib_get_close_matches",
            difflib.get_close_matches,
            ({"word": "dump", "possibilities": public_names(json)}, {"word": "month", "possibilities": public_names(calendar)}),
            list,
        ),
    ]


JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def tool_schema(tool: Tool) -> dict:
    """An OpenAI-style function schema from ``inspect.signature(tool.function)``: one property per
    parameter (``*args``/``**kwargs`` left out), typed by its default or, without one, by the
    first call's argument; required where it has no default; described by the docstring's first line."""
    properties, required = {}, []
    for parameter in inspect.signature(tool.function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        example = parameter.default if parameter.default is not parameter.empty else tool.calls[0].get(parameter.name)
        spec: dict[str, str] = {}
        if type(example) in JSON_TYPES:
            spec["type"] = JSON_TYPES[type(example)]
        if parameter.default is parameter.empty:
            required.append(parameter.name)
        else:
            spec["description"] = f"default: {parameter.default!r}"
        properties[parameter.name] = spec
    description = (inspect.getdoc(tool.function) or tool.name).strip().splitlines()[0]
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def tool_call_loops() -> list[AgentLoop]:
    loops = []
    for tool in tools():
        system = (
            "You are an agent with one tool. To call it, reply with only a JSON object "
            '{"name": <tool name>, "arguments": {...}}. After a tool result, answer the user from it, '
            "quoting the values you use.\n\nTools:\n" + json.dumps([tool_schema(tool)], indent=2)
        )
        turns = []
        for arguments in tool.calls:
            result = tool.result(tool.function(**arguments))
            turns.append((Message("user", f"Call `{tool.name}` with the arguments {json.dumps(arguments)}."),))
            turns.append((Message("tool", json.dumps({"name": tool.name, "result": result}, indent=2)),))
        loops.append(AgentLoop("tool_calls", f"tool_calls/{tool.name}", system, tuple(turns[:TURNS])))
    return loops


# --- document_qa ---------------------------------------------------------------------

DOCUMENT_TOPICS = ("with", "raise", "class", "exceptions")


def document(topic: str) -> str:
    """The topic's paragraphs from the first, as many as fit in ``MAX_DOCUMENT_CHARS``."""
    kept: list[str] = []
    for paragraph in pydoc_data.topics.topics[topic].split("\n\n"):
        if kept and len("\n\n".join([*kept, paragraph])) > MAX_DOCUMENT_CHARS:
            break
        kept.append(paragraph)
    return "\n\n".join(kept)


def prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of running text: not indented (grammar, code), not a heading, 12 words or more."""
    return [p for p in text.split("\n\n") if not p.startswith(" ") and "****" not in p and len(p.split()) >= 12]


def document_questions(text: str) -> list[str]:
    """Questions about parts of ``text`` named by its own words: its second prose paragraph's
    opening words, its indented (code or grammar) lines, its last paragraph."""
    prose = prose_paragraphs(text)
    opening = " ".join(prose[min(1, len(prose) - 1)].split()[:8])
    return [
        "What is this document about? Answer in two sentences.",
        f'Quote, word for word, the paragraph that begins "{opening}".',
        "Quote the indented code or grammar lines of the document exactly, then explain the first of them.",
        "Quote the last paragraph of the document word for word, then say in one sentence how it relates to the rest.",
    ]


def document_loops() -> list[AgentLoop]:
    loops = []
    for topic in DOCUMENT_TOPICS:
        text = document(topic)
        first, *rest = document_questions(text)
        turns = [(Message("user", f"Here is a page of the Python reference:\n\n{text}\n\n{first}"),)]
        turns += [(Message("user", question),) for question in rest]
        system = "You answer questions about the document the user gives, quoting it exactly where asked."
        loops.append(AgentLoop("document_qa", f"document_qa/{topic}", system, tuple(turns[:TURNS])))
    return loops


# --- template ------------------------------------------------------------------------


def first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split())


TEMPLATE_MODULES = (json, textwrap, shutil, calendar)
TEMPLATE_EXCEPTIONS = (KeyError, ValueError, ZeroDivisionError, FileNotFoundError)
TEMPLATE_TABLES: tuple[type, ...] = (
    os.stat_result,
    time.struct_time,
    urllib.parse.SplitResult,
    inspect.FullArgSpec,
)
TEMPLATE_FUNCTIONS: tuple[Callable, ...] = (shutil.copyfileobj, textwrap.shorten, calendar.monthrange, statistics.mode)


def table_columns(table: type) -> list[str]:
    fields = getattr(table, "_fields", None)
    if fields is not None:
        return list(fields)
    # struct sequences (os.stat_result, time.struct_time) name their fields as members
    return [
        name
        for name in dir(table)
        if not name.startswith("_") and name not in ("count", "index", "n_fields", "n_sequence_fields", "n_unnamed_fields")
    ]


def template_loops() -> list[AgentLoop]:
    templates: list[tuple[str, str, list[str]]] = [
        (
            "module_summary",
            "You write short, precise summaries of Python standard-library modules.",
            [
                f"Summarise the standard-library module `{module.__name__}` in two sentences. "
                f'Its docstring begins: "{first_paragraph(module.__doc__)}"'
                for module in TEMPLATE_MODULES
            ],
        ),
        (
            "exception",
            "You explain Python's built-in exceptions to programmers.",
            [
                f"Explain when Python raises `{error.__name__}` (a subclass of `{error.__mro__[1].__name__}`), "
                f'whose docstring is "{first_paragraph(error.__doc__)}". Then give a one-line example that raises it.'
                for error in TEMPLATE_EXCEPTIONS
            ],
        ),
        (
            "sql",
            "You write SQLite queries. Reply with one SQL query in a code block and nothing else.",
            [
                f"The table `{table.__name__}` has the columns {', '.join(table_columns(table))}. "
                f"Write a query that returns every column of the ten rows with the largest `{table_columns(table)[0]}`."
                for table in TEMPLATE_TABLES
            ],
        ),
        (
            "docstring",
            "You write docstrings for Python functions in the standard library's style.",
            [
                f"Write a docstring for `{function.__module__}.{function.__qualname__}{inspect.signature(function)}`, "
                f'whose current docstring begins: "{first_paragraph(inspect.getdoc(function))}"'
                for function in TEMPLATE_FUNCTIONS
            ],
        ),
    ]
    return [
        AgentLoop("template", f"template/{name}", system, tuple((Message("user", request),) for request in requests[:TURNS]))
        for name, system, requests in templates
    ]
