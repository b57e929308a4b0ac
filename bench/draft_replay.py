"""Replay the n-gram drafter over the target's own greedy output: how good the drafts can be.

    python -m bench.draft_replay [--kind grounded] [--prompts 16] [--k 8] [--out bench/results]

Plain decoding (our engine, K=0) writes each prompt's greedy continuation
once; then, without the model, the drafter is asked for K tokens at every
point a verification pass would start, and the pass advances by the
accepted prefix plus one, as greedy verification does. Context only (an
empty global table), as for a prompt the service has never seen.

Each pass falls in one of four kinds: no draft at all (no suffix of the
context of at least ``n_min`` tokens occurs earlier in it), a draft whose
first token is wrong, partly accepted, wholly accepted. The same replay
runs for a few other drafting rules, so a change of rule can be judged
before any timing. Tree rules (``propose_tree`` at 8, 16 and 64 nodes) are
replayed as if every node were verified: a pass follows the reference
through the children. Their ``warm`` variants draft with a global table
that holds the other prompts' outputs, as a service learns from its other
traffic. Writes ``draft_replay.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Callable
from pathlib import Path

from bench.bench_core import decode_batch
from bench.workloads import service_prompts
from drafter_service.ngram import ContextIndex, InMemoryNGramTable, NGramConfig, NGramSource
from verifier_service.engine import SpeculativeEngine
from verifier_service.model_loading import DEFAULT_MODEL, chat_prompt_ids, load_model

# A chain's tokens, or a tree's (tokens, parents): parents -1 for the root's children.
Drafter = Callable[[list[int], int], "list[int] | tuple[list[int], list[int]]"]


def ngram(config: NGramConfig, nodes: int = 0, global_table: NGramSource | None = None) -> Drafter:
    """The service's drafting rule (``ContextIndex.propose``) over a fresh context: a
    chain, or with ``nodes`` a tree of that many; ``global_table`` empty unless given."""

    table = global_table if global_table is not None else InMemoryNGramTable(config.n_min, config.n_max)

    def draft(context: list[int], k: int):
        index = ContextIndex(config)
        index.extend(context)
        proposed = index.propose(table, k, nodes)
        return (proposed.tokens, proposed.parents or list(range(-1, len(proposed.tokens) - 1))) if nodes else proposed.tokens

    return draft


def accepted_path(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """How many of ``truth``'s tokens a greedy pass over the tree accepts (its path's length)."""
    children: dict[tuple[int, int], int] = {}
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        children.setdefault((parent, token), node)
    node, run = -1, 0
    while run < len(truth) and (node := children.get((node, truth[run]), -2)) != -2:
        run += 1
    return run


def prompt_lookup(most_recent: bool, n_max: int = 4, n_min: int = 2) -> Drafter:
    """Prompt lookup's rule: copy what followed one earlier occurrence of the longest suffix."""

    def draft(context: list[int], k: int) -> list[int]:
        for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
            key = context[-n:]
            starts = range(len(context) - n - 1, -1, -1) if most_recent else range(len(context) - n)
            for start in starts:
                if context[start : start + n] == key:
                    return context[start + n : start + n + k]
        return []

    return draft


def replay(draft: Drafter, references: list[tuple[list[int], list[int]]], k: int) -> dict:
    """Pass kinds, tokens per pass and the accepted share of drafted tokens for one rule."""
    kinds: collections.Counter = collections.Counter()
    produced = drafted = accepted = 0
    for prompt, output in references:
        position = 1  # the first token comes from prefill
        while position < len(output):
            proposed = draft(prompt + output[:position], min(k, len(output) - position))
            if isinstance(proposed, tuple):
                tokens, parents = proposed
                run = accepted_path(tokens, parents, output[position:])
                deepest = max(_depths(parents), default=0)
                full = run == deepest
            else:
                tokens = proposed[: len(output) - position]
                run = 0
                while run < len(tokens) and tokens[run] == output[position + run]:
                    run += 1
                full = run == len(tokens)
            kinds["no draft" if not tokens else "first wrong" if run == 0 else "all accepted" if full else "partly"] += 1
            drafted += len(tokens)
            accepted += run
            produced += run + 1
            position += run + 1
    passes = sum(kinds.values())
    return {
        "passes": passes,
        "tokens_per_pass": round(produced / passes, 3),
        "accepted_share_of_drafted": round(accepted / max(drafted, 1), 3),
        "pass_kinds": {kind: round(count / passes, 3) for kind, count in sorted(kinds.items())},
    }


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 1)
    return depths


def single_token_keys(references: list[tuple[list[int], list[int]]]) -> dict:
    """At positions where 2-token keys find nothing: how often 1-token keys' first draft token is right."""
    short, shorter = ngram(NGramConfig()), ngram(NGramConfig(n_min=1))
    positions = drafted = right = 0
    for prompt, output in references:
        for position in range(1, len(output)):
            positions += 1
            context = prompt + output[:position]
            if short(context, 1):
                continue
            tokens = shorter(context, 1)
            if tokens:
                drafted += 1
                right += tokens[0] == output[position]
    return {"positions": positions, "drafted_only_with_1_token_keys": drafted, "first_token_right": round(right / max(drafted, 1), 3)}


TREE_NODES = (8, 16, 64)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kind", choices=("grounded", "open_ended"), default="grounded")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    prompts = [chat_prompt_ids(loaded.tokenizer, p) for p in service_prompts(args.kind)[: args.prompts]]
    outputs, _, _ = decode_batch(SpeculativeEngine(loaded.model, loaded.tokenizer), prompts, args.max_new_tokens, 0)
    references = list(zip(prompts, outputs))
    rules: dict[str, Drafter] = {
        "n-gram (the service's rule)": ngram(NGramConfig()),
        "n-gram, 3-6 token keys": ngram(NGramConfig(n_min=3, n_max=6)),
        "n-gram, 2-6 token keys": ngram(NGramConfig(n_max=6)),
        "n-gram, 1-4 token keys": ngram(NGramConfig(n_min=1)),
        "prompt lookup, most recent occurrence": prompt_lookup(most_recent=True),
        "prompt lookup, first occurrence": prompt_lookup(most_recent=False),
    }
    for nodes in TREE_NODES:
        rules[f"n-gram tree, {nodes} nodes"] = ngram(NGramConfig(), nodes)
    report = {name: replay(rule, references, args.k) for name, rule in rules.items()}
    config = NGramConfig()
    for nodes in (0, *TREE_NODES):  # warm: each prompt drafted with the others' outputs in the global table
        name = f"n-gram {'chain' if not nodes else f'tree, {nodes} nodes'}, warm"
        totals = []
        for index, reference in enumerate(references):
            table = InMemoryNGramTable(config.n_min, config.n_max)
            for other, (other_prompt, other_output) in enumerate(references):
                if other != index:
                    table.observe(other_prompt + other_output)
            totals.append(replay(ngram(config, nodes, table), [reference], args.k))
        passes = sum(total["passes"] for total in totals)
        produced = sum(total["passes"] * total["tokens_per_pass"] for total in totals)
        report[name] = {"passes": passes, "tokens_per_pass": round(produced / passes, 3)}
    report["1-token keys where 2-token keys find nothing"] = single_token_keys(references)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "kind": args.kind, "prompts": len(prompts), "k": args.k, "max_new_tokens": args.max_new_tokens}
    (args.out / "draft_replay.json").write_text(json.dumps({"meta": meta, "rules": report}, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
