"""Benchmark workloads built from real text that ships with Python.

Each workload is a list of user prompts (the chat template is applied by the
benchmark). The input-grounded ones quote real standard-library source and
real documentation (``pydoc_data.topics``), so an answer that edits, quotes
or summarises the input copies spans a drafter can find in the prompt.
"""

from __future__ import annotations

import base64
import calendar
import colorsys
import fnmatch
import glob
import html
import inspect
import pydoc_data.topics
import shlex
import statistics
import string
import textwrap
from dataclasses import dataclass


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
                "Repeat the following sentence ten times, one per line: " "The quick brown fox jumps over the lazy dog.",
                "Write the list of the days of the week three times, one list per line.",
            ),
            grounded=False,
        ),
        Workload(
            "code_edit",
            (
                "Rewrite this Python function with the parameter `data` renamed to `values`. " "Output only the code.\n\n" + code_a,
                "Add type hints to this Python function. Output only the code.\n\n" + code_b,
                "Rewrite this Python function with the parameter `predicate` renamed to `keep`. " "Output only the code.\n\n" + code_c,
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


# Many distinct prompts for the service benchmark, where every concurrent
# request must be new: a repeated prompt would be drafted from its earlier
# answer and flatter speculation.
SERVICE_FUNCTIONS = (
    statistics.median,
    statistics.median_low,
    statistics.median_high,
    statistics.mode,
    shlex.join,
    shlex.quote,
    textwrap.indent,
    textwrap.shorten,
    textwrap.fill,
    fnmatch.fnmatch,
    fnmatch.filter,
    string.capwords,
    calendar.isleap,
    calendar.leapdays,
    colorsys.rgb_to_hsv,
    colorsys.hsv_to_rgb,
    colorsys.rgb_to_hls,
    colorsys.hls_to_rgb,
    glob.escape,
    html.escape,
    base64.urlsafe_b64encode,
)
SERVICE_DOC_TOPICS = (
    "assert",
    "pass",
    "break",
    "continue",
    "return",
    "del",
    "global",
    "if",
    "while",
    "for",
    "try",
    "with",
    "import",
    "raise",
    "lambda",
    "nonlocal",
    "yield",
    "assignment",
    "augassign",
    "booleans",
    "comparisons",
)
SERVICE_SUBJECTS = (
    "a lighthouse keeper",
    "a lost robot",
    "a baker in Lisbon",
    "a retired astronaut",
    "a stubborn goat",
    "a night-shift nurse",
    "a chess prodigy",
    "a clockmaker",
    "a city fox",
    "a shy dragon",
    "a beekeeper",
    "a tram driver",
    "a violin maker",
    "a desert botanist",
    "a deep-sea diver",
    "a village librarian",
)
SERVICE_QUESTIONS = (
    "Explain why the sky is blue",
    "Explain how a rainbow forms",
    "Explain why we have seasons",
    "Explain how bees make honey",
    "Explain why the sea is salty",
    "Explain how a fridge keeps food cold",
    "Explain why leaves change colour in autumn",
    "Explain how airplanes stay in the air",
    "Explain why ice floats",
    "Explain how the moon causes tides",
    "Explain why cats purr",
    "Explain how a compass works",
    "Explain why bread rises",
    "Explain how volcanoes erupt",
    "Explain why we dream",
    "Explain how soap cleans hands",
)


def service_prompts(kind: str) -> tuple[str, ...]:
    """Distinct prompts: ``grounded`` (code edits and documentation quotes,
    alternating, 42) or ``open_ended`` (stories and explanations, alternating, 32)."""
    if kind == "grounded":
        code = [
            "Rewrite this Python function with its first parameter renamed to `value`. Output only the code.\n\n"
            + _function_source(function)
            for function in SERVICE_FUNCTIONS
        ]
        docs = [
            "Here is documentation from the Python reference:\n\n"
            + _doc_paragraphs(topic, 3)
            + "\n\nQuote its first two sentences word for word."
            for topic in SERVICE_DOC_TOPICS
        ]
        return tuple(prompt for pair in zip(code, docs) for prompt in pair)
    if kind == "open_ended":
        stories = [f"Write a short story about {subject}." for subject in SERVICE_SUBJECTS]
        questions = [f"{question} to a ten-year-old." for question in SERVICE_QUESTIONS]
        return tuple(prompt for pair in zip(stories, questions) for prompt in pair)
    raise ValueError(f"unknown kind {kind!r}: grounded or open_ended")
