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
    chosen = {}
    for group, questions in by_group.items():
        questions.sort()
        if len(questions) < per_group:
            raise ValueError(f"{path}: group {group} has {len(questions)} questions, fewer than --per-group {per_group}")
        step = len(questions) / per_group
        chosen[group] = [questions[int(i * step)][1] for i in range(per_group)]
    return chosen


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(value) for value in values) / len(values))
