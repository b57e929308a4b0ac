"""Prompts the draft head is trained on: written for it, never taken from a benchmark.

Each prompt is one task template applied to one subject. The subjects are
split in two: the head trains on the target's answers about the first
group and is scored on answers about subjects it never saw (``HELD_OUT``),
so its held-out accuracy says how it does on new text, not on text it
memorised. Neither list draws on Spec-Bench or ``bench/workloads.py``.
"""

from __future__ import annotations

import random

TEMPLATES = (
    "Explain {s} to a curious twelve-year-old.",
    "Write a short blog post about {s}.",
    "What are the three most common misconceptions about {s}?",
    "Give me a step-by-step beginner's guide to {s}.",
    "Write a short story in which {s} plays a central role.",
    "List the pros and cons of {s} in a table.",
    "Summarise the history of {s} in one paragraph.",
    "Write a friendly email inviting a colleague to a workshop on {s}.",
    "Compose a poem of four stanzas about {s}.",
    "What questions would an expert ask a newcomer about {s}? Answer each briefly.",
    "Describe a typical day for someone whose job revolves around {s}.",
    "Write a product description for a beginner's kit about {s}.",
    "Compare {s} today with how it was fifty years ago.",
    "Give five practical tips for getting better at {s}.",
    "Write a dialogue between a teacher and a student about {s}.",
    "What would change in everyday life if {s} disappeared tomorrow?",
    "Write a persuasive paragraph arguing that schools should teach {s}.",
    "Draft an outline for a ten-minute talk on {s}.",
    "Answer as a helpful assistant: how do I explain {s} to my grandparents?",
    "Write a Python function related to {s}, and explain how it works.",
    "Create a short quiz of five questions about {s}, with the answers.",
    "Describe {s} using only simple words, then in technical terms.",
    "What are the ethical questions raised by {s}?",
    "Write a news headline and a short article about a breakthrough in {s}.",
    "Give a recipe-style list of instructions for a weekend project involving {s}.",
    "Role-play as a tour guide showing visitors something about {s}.",
    "Write the opening paragraph of a textbook chapter on {s}.",
    "Which careers involve {s}, and what skills do they need?",
    "Write a haiku about {s}, then explain its imagery.",
    "Give a balanced answer: is {s} overrated?",
)

SUBJECTS = (
    "beekeeping",
    "urban gardening",
    "volcanoes",
    "the printing press",
    "sourdough baking",
    "chess openings",
    "solar panels",
    "the water cycle",
    "ancient Rome",
    "jazz improvisation",
    "bird migration",
    "budget travel",
    "the human immune system",
    "rock climbing",
    "origami",
    "electric cars",
    "coral reefs",
    "the stock market",
    "learning a second language",
    "public libraries",
    "knitting",
    "black holes",
    "composting",
    "the Silk Road",
    "photography",
    "recycling plastics",
    "sleep hygiene",
    "the Renaissance",
    "tea ceremonies",
    "wind turbines",
    "marathon training",
    "honey bees",
    "medieval castles",
    "bicycles in cities",
    "the moon landing",
    "mushrooms",
    "board game design",
    "tides",
    "glass blowing",
    "street food",
    "the periodic table",
    "penguins",
    "podcasting",
    "rainforests",
    "typewriters",
    "fermentation",
    "lighthouses",
    "the Olympic Games",
    "home budgeting",
    "earthquakes",
    "calligraphy",
    "vaccines",
    "rivers",
    "video game music",
    "kites",
    "the metric system",
    "sign language",
    "deserts",
    "public transport",
    "pottery",
    "weather forecasting",
    "the internet's early days",
    "time zones",
    "dinosaurs",
    "meditation",
    "bridges",
    "chocolate making",
    "camping",
    "robots in factories",
    "the violin",
    "maps",
    "friendship",
    "clocks",
    "hot air balloons",
)

# Scored only: the head never trains on answers about these.
HELD_OUT = (
    "submarines",
    "cheese making",
    "the Great Wall of China",
    "wolves",
    "tennis",
    "rainbows",
    "crossword puzzles",
    "space stations",
    "gardening with children",
    "the saxophone",
)


def prompts(subjects: tuple[str, ...], seed: int = 0) -> list[str]:
    """Every template applied to every subject, in a seeded random order."""
    everything = [template.format(s=subject) for subject in subjects for template in TEMPLATES]
    random.Random(seed).shuffle(everything)
    return everything
