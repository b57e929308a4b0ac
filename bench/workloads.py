"""Benchmark workloads built from real text that ships with Python.

Each workload is a list of user prompts (the chat template is applied by the
benchmark). The input-grounded ones quote real standard-library source and
real documentation (``pydoc_data.topics``), so an answer that edits, quotes
or summarises the input copies spans a drafter can find in the prompt.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass

import pydoc_data.topics
import shlex
import statistics


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]
    grounded: bool  # the 2x target applies to input-grounded workloads
    repeated: bool = False  # timed run follows an identical, untimed request


def _function_source(function) -> str:
    return textwrap.dedent(inspect.getsource(function))


def _doc_paragraphs(topic: str, count: int) -> str:
    text = pydoc_data.topics.topics[topic]
    return "\n\n".join(text.split("\n\n")[:count])


def workloads() -> list[Workload]:
    code_a = _function_source(statistics.median)
    code_b = _function_source(shlex.join)
    code_c = _function_source(textwrap.indent)
    return [
        Workload(
            "repetitive",
            (
                "Repeat the following sentence ten times, one per line: "
                "The quick brown fox jumps over the lazy dog.",
                "Write the list of the days of the week three times, one list per line.",
            ),
            grounded=False,
        ),
        Workload(
            "code_edit",
            (
                "Rewrite this Python function with the parameter `data` renamed to `values`. "
                "Output only the code.\n\n" + code_a,
                "Add type hints to this Python function. Output only the code.\n\n" + code_b,
                "Rewrite this Python function with the parameter `predicate` renamed to `keep`. "
                "Output only the code.\n\n" + code_c,
            ),
            grounded=True,
        ),
        Workload(
            "doc_quote",
            (
                "Here is documentation from the Python reference:\n\n"
                + _doc_paragraphs("assert", 4)
                + "\n\nQuote the sentences that explain the extended form, word for word.",
                "Here is documentation from the Python reference:\n\n"
                + _doc_paragraphs("pass", 3)
                + "\n\nSummarise this documentation, quoting its key sentences.",
            ),
            grounded=True,
        ),
        Workload(
            "open_ended",
            (
                "Write a short story about a lighthouse keeper who finds a message in a bottle.",
                "Explain why the sky is blue to a ten-year-old.",
            ),
            grounded=False,
        ),
        Workload(
            "repeated_request",
            ("Give three tips for writing clear commit messages.",),
            grounded=False,
            repeated=True,
        ),
    ]
