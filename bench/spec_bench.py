"""Spec-Bench's prompts, grouped as the paper groups them (Xia et al., ACL Findings 2024).

The file is never part of the project: benchmarks take its path (the shared
half is ``../shared/spec_bench/question.jsonl``). One JSON object a line with
``question_id``, ``category`` and ``turns``; the first turn is the prompt.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

# The paper's six groups, in its order; mt_bench gathers MT-Bench's eight categories.
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def group_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def load_groups(path: str | Path, per_group: int) -> dict[str, list[str]]:
    """``per_group`` first turns per group, spread evenly over the group's questions in
    id order (so mt_bench's come from its different categories), deterministically."""
    return {group: [prompt for _, prompt in chosen] for group, chosen in _split(path, per_group).items()}


def other_prompts(path: str | Path, per_group: int, count: int) -> dict[str, list[str]]:
    """``count`` first turns per group that ``load_groups(path, per_group)`` does not
    choose, spread evenly over the rest of the group: traffic to warm a drafter on
    before the chosen prompts are measured, none of them a measured prompt."""
    chosen = _split(path, per_group)
    others = {}
    for group, questions in _questions(path).items():
        taken = {question_id for question_id, _ in chosen[group]}
        rest = [question for question in questions if question[0] not in taken]
        if len(rest) < count:
            raise ValueError(f"{path}: group {group} has {len(rest)} questions besides the {per_group} measured, fewer than {count}")
        step = len(rest) / count if count else 1
        others[group] = [rest[int(i * step)][1] for i in range(count)]
    return others


def _split(path: str | Path, per_group: int) -> dict[str, list[tuple[int, str]]]:
    chosen = {}
    for group, questions in _questions(path).items():
        if len(questions) < per_group:
            raise ValueError(f"{path}: group {group} has {len(questions)} questions, fewer than --per-group {per_group}")
        step = len(questions) / per_group
        chosen[group] = [questions[int(i * step)] for i in range(per_group)]
    return chosen


def _questions(path: str | Path) -> dict[str, list[tuple[int, str]]]:
    """(question id, first turn) per group, in id order."""
    by_group: dict[str, list[tuple[int, str]]] = {group: [] for group in GROUPS}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            question = json.loads(line)
            group = group_of(question["category"])
            if group not in by_group:
                raise ValueError(f"{path}: unknown category {question['category']!r} (question {question['question_id']})")
            by_group[group].append((int(question["question_id"]), question["turns"][0]))
    for questions in by_group.values():
        questions.sort()
    return by_group


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(value) for value in values) / len(values))
