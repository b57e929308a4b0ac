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
traffic. The successor-table rules (``with_successors``) add the target's
own top-8 predictions (one teacher-forced pass per reference), learned as
the verifier sends them: at the positions passes scored, and with "prompt's
predictions too" at the prompt's positions as well (what prefill would have
to compute); their prefill cost is timed beside (``prompt_prediction_cost``).
Writes ``draft_replay.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Callable
from pathlib import Path

from bench.bench_core import decode_batch
from bench.workloads import service_prompts
from drafter_service.ngram import (
    SOURCE_CONTEXT,
    SOURCE_GLOBAL,
    ContextIndex,
    InMemoryNGramTable,
    NGramConfig,
    NGramSource,
    propose_chain_or_successors,
    propose_tree,
)
from verifier_service.core.engine import SpeculativeEngine
from verifier_service.core.model_loading import DEFAULT_MODEL, chat_prompt_ids, load_model

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
# Predictions per position kept in the successor table (the verifier's --successor-top-k).
SUCCESSOR_TOP_K = 8
SUCCESSOR_TREE_NODES = 16


def target_predictions(model, references: list[tuple[list[int], list[int]]], k: int = SUCCESSOR_TOP_K) -> list[list[tuple[int, ...]]]:
    """The target's top ``k`` next tokens after every token of each prompt + output, best
    first (one teacher-forced pass each: at an output position its first is greedy's next token)."""
    import torch

    found = []
    with torch.inference_mode():
        for prompt, output in references:
            ids = torch.tensor([prompt + output], device=model.device)
            found.append([tuple(row) for row in model(ids).logits[0].topk(k, dim=-1).indices.tolist()])
    return found


def successor_entries(tokens: list[int], predictions: list[tuple[int, ...]], start: int, stop: int) -> list:
    """The successor-table updates of positions [start, stop): each position's predictions
    under (its token,) and (the token before, its token), as ``ngram.successor_updates``."""
    updates: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for position in range(max(start, 0), stop):
        updates.append(((tokens[position],), predictions[position]))
        if position > 0:
            updates.append(((tokens[position - 1], tokens[position]), predictions[position]))
    return updates


def prompt_prediction_cost(model, prompts: list[list[int]], k: int = SUCCESSOR_TOP_K) -> dict:
    """What the prompt's predictions add to prefill: each prompt prefilled with logits at its
    last position only (as the engine does) and with logits and top ``k`` at every
    position, best of three each, summed over the prompts."""
    import time

    import torch

    def best(run) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return min(times)

    last = every = 0.0
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            last += best(lambda: model(ids, logits_to_keep=1))
            every += best(lambda: model(ids).logits[0].topk(k, dim=-1))
    return {
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "prefill_s": round(last, 3),
        "prefill_with_predictions_s": round(every, 3),
        "extra_s_per_prompt": round((every - last) / len(prompts), 4),
    }


def with_successors(
    references: list[tuple[list[int], list[int]]],
    predictions: list[list[tuple[int, ...]]],
    config: NGramConfig,
    nodes: int = 0,
    prompt_predictions: bool = False,
    warm: bool = False,
) -> Drafter:
    """The service's rule with the successor table (the n-gram chain, its gaps filled
    from the target's earlier predictions; with ``nodes``, the tree the drafter builds).

    The table learns a reference's predictions as the verifier sends them: a pass
    drafting after ``context`` knows those at every position before its last token
    (the passes before scored them) from the first output token on, or, with
    ``prompt_predictions``, from the prompt's first token (prefill sends them too).
    ``warm``: each reference's table starts with every other reference's n-grams and
    predictions, as a service's table holds its other traffic's. Each reference
    starts from a table of its own (and its own context), however many passes came before.
    """
    full = [prompt + output for prompt, output in references]
    state: dict = {"reference": -1, "table": None, "known": 0}

    def table_for(index: int) -> InMemoryNGramTable:
        table = InMemoryNGramTable(config.n_min, config.n_max)
        if warm:
            for other, tokens in enumerate(full):
                if other != index:
                    table.observe(tokens)
                    table.record_successors(successor_entries(tokens, predictions[other], 0, len(tokens)))
        return table

    def draft(context: list[int], k: int):
        index = state["reference"]
        if index < 0 or full[index][: len(context)] != context:
            index = next(i for i, tokens in enumerate(full) if tokens[: len(context)] == context and len(context) > len(references[i][0]))
            state.update(reference=index, table=table_for(index), known=0 if prompt_predictions else len(references[index][0]) - 1)
        table = state["table"]
        known = len(context) - 1  # the prediction after the last token is what this pass computes
        table.record_successors(successor_entries(full[index], predictions[index], state["known"], known))
        state["known"] = max(state["known"], known)
        index_of_context = ContextIndex(config)
        index_of_context.extend(context)
        sources = ((SOURCE_CONTEXT, index_of_context), (SOURCE_GLOBAL, table))
        if nodes:
            proposed = propose_tree(context, sources, k, nodes, config)
            return proposed.tokens, proposed.parents or list(range(-1, len(proposed.tokens) - 1))
        return propose_chain_or_successors(context, sources, k, config).tokens

    return draft


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
    predictions = target_predictions(loaded.model, references)
    for nodes in (0, SUCCESSOR_TREE_NODES):
        for prompt_predictions in (False, True):
            for warm in (False, True):
                name = f"n-gram {'chain' if not nodes else f'tree, {nodes} nodes'} + successor table"
                name += ", prompt's predictions too" * prompt_predictions + ", warm" * warm
                report[name] = replay(with_successors(references, predictions, config, nodes, prompt_predictions, warm), references, args.k)
    report["prompt's predictions at prefill"] = prompt_prediction_cost(loaded.model, prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "kind": args.kind, "prompts": len(prompts), "k": args.k, "max_new_tokens": args.max_new_tokens}
    (args.out / "draft_replay.json").write_text(json.dumps({"meta": meta, "rules": report}, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
