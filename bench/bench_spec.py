"""Spec-Bench, per group: our defaults against plain decoding, the previous adaptive chain,
and transformers' prompt lookup, greedy, on the default model in the form a verifier
serves here (``--dtype``, ``--weights``, ``--threads``: ``bench.served``).

    python -m bench.bench_spec ../shared/spec_bench/question.jsonl [--per-group 4] [--max-new-tokens 96]
        [--batch 16] [--rounds 1] [--out bench/results]

The prompt
file is Spec-Bench's ``question.jsonl`` (``bench.spec_bench``); it is read from
the path given and never copied into the project.

Single stream, per group, ``--per-group`` prompts, each method in turn per
prompt (so the machine's drift hits them alike), whole requests timed
(prefill included, as Spec-Bench times them):

* ``plain``: our engine with K=0, the baseline;
* ``chain``: adaptive K over n-gram chains (``--max-adaptive-nodes 0``), the
  default before draft trees;
* ``default``: the engine's defaults, what users get;
* ``head``: the defaults plus the trained draft head (``--draft-head``; auto:
  the one ``python -m verifier_service.head.train`` stored for this model),
  when there is one;
* ``suffix`` (opt-in, ``--methods``; the bench extra): SuffixDecoding's drafts
  (``bench.suffix_proposer``, vLLM's defaults) verified whole by our engine, a
  fresh cache per request as our drafter is;
* ``hf-pld-3``, ``hf-pld-10``: transformers' prompt lookup; the faster of the
  two per group is the baseline ``×PLD`` compares against.

Each of our methods keeps one engine for the run (what adaptive K learns
carries over, as in the service) and gets a fresh drafter per request
(cold: no request is drafted from an earlier answer). Every output is
checked against plain's: greedy speculation must not change a token.

Batch (``--batch N``, 0 to skip): the group's first N prompts prefilled
together, then only the decoding timed, for plain, chain and default.

Speedups are per group (single stream: the median over ``--rounds`` of
same-round ratios), then the geometric mean over the six groups.
Writes ``spec_bench.json`` and ``spec_bench.png`` under ``--out``, and
prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.bench_core import decode_batch, run_hf
from bench.served import add_form_flags, load_form
from bench.spec_bench import geometric_mean, load_groups
from bench.suffix_proposer import SuffixProposer, SuffixSettings
from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import DraftProposer, SessionProposer
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.model_loading import DEFAULT_MODEL, chat_prompt_ids
from verifier_service.head.model import DEFAULT_HEAD_VOCABULARY, HeadDrafter, find_head
from verifier_service.head.proposer import DEFAULT_HEAD_DEPTH, HeadProposer

SUFFIX = SuffixSettings()
OURS = {
    "plain": (EngineConfig(), 0),
    "chain": (EngineConfig(max_adaptive_nodes=0), None),
    "default": (EngineConfig(), None),
    "head": (EngineConfig(), None),  # with the draft head, when one is found
    # SuffixDecoding's drafts verified whole, as vLLM does (its K is its max_spec_tokens).
    "suffix": (EngineConfig(max_speculative_tokens=max(16, SUFFIX.max_spec_tokens)), SUFFIX.max_spec_tokens),
}
PLD_KS = (3, 10)
ALL_METHODS = (*OURS, *(f"hf-pld-{k}" for k in PLD_KS))
# What runs unless --methods says otherwise: suffix needs the bench extra (arctic-inference).
DEFAULT_METHODS = tuple(name for name in ALL_METHODS if name != "suffix")


def new_proposer(name: str) -> DraftProposer:
    """A fresh drafter for one request: SuffixDecoding's cache for suffix, else ours."""
    return SuffixProposer(SUFFIX) if name == "suffix" else SessionProposer(NGramDrafter())


def run_ours(engine: SpeculativeEngine, ids: list[int], max_new_tokens: int, k: int | None, name: str = "default"):
    engine.proposer = new_proposer(name)
    started = time.perf_counter()
    [result] = engine.generate([GenerationRequest(ids, max_new_tokens, num_speculative_tokens=k)])
    return result.token_ids, result.stats, time.perf_counter() - started


def engine_for(model, tokenizer, name: str, head: HeadDrafter | None, proposer=None) -> SpeculativeEngine:
    beside = [HeadProposer(head, DEFAULT_HEAD_DEPTH)] if name == "head" and head is not None else []
    return SpeculativeEngine(model, tokenizer, proposer, OURS[name][0], beside=beside)


def measure_single(
    model, tokenizer, groups: dict[str, list[str]], max_new_tokens: int, rounds: int, methods: list[str], head: HeadDrafter | None
) -> dict:
    """Per group, ``rounds`` passes over its prompts, every method in turn per prompt; a
    method's speedup is the median over rounds of its tokens/s over plain's in the same
    round (this machine's speed drifts by tens of percent within minutes)."""
    engines = {name: engine_for(model, tokenizer, name, head) for name in OURS if name in methods}
    names = [name for name in [*OURS, *(f"hf-pld-{k}" for k in PLD_KS)] if name in methods]
    report = {}
    for group, prompts in groups.items():
        ids_list = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
        per_round = []
        mismatches = set()
        for _ in range(rounds):
            totals = {name: {"tokens": 0, "seconds": 0.0, "passes": 0, "drafted": 0, "accepted": 0, "accepting": 0} for name in names}
            for ids in ids_list:
                reference = None
                for name in names:
                    if name in OURS:
                        tokens, stats, seconds = run_ours(engines[name], ids, max_new_tokens, OURS[name][1], name)
                    else:
                        tokens, stats, seconds = run_hf(model, ids, max_new_tokens, int(name.rsplit("-", 1)[1]))
                    reference = tokens if reference is None else reference
                    if tokens != reference:
                        mismatches.add(name)
                    total = totals[name]
                    total["tokens"] += len(tokens)
                    total["seconds"] += seconds
                    if stats is not None:
                        total["passes"] += stats.target_forward_passes
                        total["drafted"] += stats.draft_tokens
                        total["accepted"] += stats.accepted_tokens
                        total["accepting"] += stats.steps_with_accepted_drafts
            per_round.append(totals)
        rows: dict[str, dict] = {}
        for name in names:
            rates = [totals[name]["tokens"] / totals[name]["seconds"] for totals in per_round]
            ratios = [rate / (totals["plain"]["tokens"] / totals["plain"]["seconds"]) for rate, totals in zip(rates, per_round)]
            first = per_round[0][name]
            rows[name] = {
                "tokens_per_s": round(statistics.median(rates), 2),
                "speedup_vs_plain": round(statistics.median(ratios), 3),
                "speedup_per_round": [round(ratio, 3) for ratio in ratios],
                "tokens": first["tokens"],
            }
            if first["passes"]:
                rows[name]["tokens_per_pass"] = round(first["tokens"] / first["passes"], 3)
                rows[name]["acceptance_rate"] = round(first["accepted"] / first["drafted"], 3) if first["drafted"] else 0.0
                # Decode passes (the prefill's excluded) that kept at least one draft token.
                rows[name]["passes_with_accepted_draft"] = round(first["accepting"] / max(1, first["passes"] - len(ids_list)), 3)
        plds = [name for name in names if name.startswith("hf-pld-")]
        pld = max(plds, key=lambda name: rows[name]["speedup_vs_plain"]) if plds else None
        report[group] = {"prompts": len(prompts), "rounds": rounds, "mismatches": sorted(mismatches), "best_pld": pld, "methods": rows}
        print(f"{group}: " + ", ".join(f"{name} x{row['speedup_vs_plain']:.2f}" for name, row in rows.items()), flush=True)
    return report


def measure_batch(
    model, tokenizer, groups: dict[str, list[str]], max_new_tokens: int, methods: list[str], head: HeadDrafter | None
) -> dict:
    report = {}
    for group, prompts in groups.items():
        ids_list = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
        cells, reference = {}, None
        for name in [name for name in OURS if name in methods]:
            engine = engine_for(model, tokenizer, name, head, new_proposer(name))
            tokens, seconds, stats = decode_batch(engine, ids_list, max_new_tokens, OURS[name][1])
            reference = tokens if reference is None else reference
            decoded = sum(map(len, tokens)) - len(tokens)
            cells[name] = {
                "tokens_per_s": round(decoded / seconds, 2),
                "tokens_per_pass_per_sequence": round(stats["tokens"] / stats["row_passes"], 3),
                "passes_with_accepted_draft": round(stats["accepting"] / stats["row_passes"], 3),
                "identical_to_plain": tokens == reference,
            }
        for cell in cells.values():
            cell["speedup_vs_plain"] = round(cell["tokens_per_s"] / cells["plain"]["tokens_per_s"], 3)
        report[group] = cells
        print(f"batch {len(prompts)} {group}: " + ", ".join(f"{n} x{c['speedup_vs_plain']:.2f}" for n, c in cells.items()), flush=True)
    return report


def single_table(report: dict) -> str:
    lines = [
        "| group | plain tok/s | chain ×plain | default ×plain | best PLD ×plain | default ×PLD | tokens/pass chain → default |",
        "|---|---|---|---|---|---|---|",
    ]
    columns: dict[str, list[float]] = {"chain": [], "default": [], "pld": [], "vs_pld": []}
    for group, summary in report.items():
        rows = summary["methods"]
        pld = rows[summary["best_pld"]]["speedup_vs_plain"]
        chain, default = rows["chain"]["speedup_vs_plain"], rows["default"]["speedup_vs_plain"]
        for key, value in (("chain", chain), ("default", default), ("pld", pld), ("vs_pld", default / pld)):
            columns[key].append(value)
        lines.append(
            f"| {group} | {rows['plain']['tokens_per_s']:.1f} | {chain:.2f} | {default:.2f} | {pld:.2f} ({summary['best_pld'][7:]}) | "
            f"{default / pld:.2f} | {rows['chain']['tokens_per_pass']:.2f} → {rows['default']['tokens_per_pass']:.2f} |"
        )
    means = {key: geometric_mean(values) for key, values in columns.items()}
    lines.append(
        f"| **geometric mean** | | {means['chain']:.2f} | **{means['default']:.2f}** | {means['pld']:.2f} | {means['vs_pld']:.2f} | |"
    )
    return "\n".join(lines)


def batch_table(report: dict, batch: int) -> str:
    lines = [f"| group ({batch} sequences, decode only) | plain tok/s | chain ×plain | default ×plain | tokens/pass/seq chain → default |"]
    lines.append("|---|---|---|---|---|")
    chain, default = [], []
    for group, cells in report.items():
        chain.append(cells["chain"]["speedup_vs_plain"])
        default.append(cells["default"]["speedup_vs_plain"])
        lines.append(
            f"| {group} | {cells['plain']['tokens_per_s']:.1f} | {chain[-1]:.2f} | {default[-1]:.2f} | "
            f"{cells['chain']['tokens_per_pass_per_sequence']:.2f} → {cells['default']['tokens_per_pass_per_sequence']:.2f} |"
        )
    lines.append(f"| **geometric mean** | | {geometric_mean(chain):.2f} | **{geometric_mean(default):.2f}** | |")
    return "\n".join(lines)


def methods_table(report: dict[str, dict], methods: list[str]) -> str:
    """Per group and method: ×plain, tokens per pass (per sequence in a batch) and the share of
    decode passes that kept a draft token; then the geometric mean of ×plain."""
    ours = [name for name in methods if name in OURS and name != "plain"]
    lines = ["| group | plain tok/s | " + " | ".join(f"{name} ×plain" for name in methods if name != "plain") + " | "
             + " | ".join(f"{name} tokens/pass, passes with an accepted draft" for name in ours) + " |"]  # fmt: skip
    lines.append("|---|---|" + "---|" * (len(methods) - 1 + len(ours)))
    speedups: dict[str, list[float]] = {name: [] for name in methods if name != "plain"}
    for group, rows in report.items():
        cells = [f"{rows['plain']['tokens_per_s']:.1f}"]
        for name in speedups:
            speedups[name].append(rows[name]["speedup_vs_plain"])
            cells.append(f"{rows[name]['speedup_vs_plain']:.2f}")
        for name in ours:
            per_pass = rows[name].get("tokens_per_pass", rows[name].get("tokens_per_pass_per_sequence", 0.0))
            cells.append(f"{per_pass:.2f}, {100 * rows[name].get('passes_with_accepted_draft', 0.0):.0f}%")
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    means = [f"**{geometric_mean(values):.2f}**" for values in speedups.values()]
    lines.append("| **geometric mean** | | " + " | ".join(means) + " |" + " |" * len(ours))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(report)
    figure, (speed, passes) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.2
    for offset, name in enumerate(("chain", "default", "pld")):
        values = []
        for group in groups:
            rows = report[group]["methods"]
            values.append(rows[report[group]["best_pld"] if name == "pld" else name]["speedup_vs_plain"])
        label = "best prompt lookup" if name == "pld" else name
        speed.bar([i + (offset - 1) * width for i in range(len(groups))], values, width, label=label)
    for offset, name in enumerate(("chain", "default")):
        values = [report[group]["methods"][name]["tokens_per_pass"] for group in groups]
        passes.bar([i + (offset - 0.5) * width for i in range(len(groups))], values, width, label=name)
    for axes, label in ((speed, "speedup vs our plain decoding"), (passes, "tokens per forward pass")):
        axes.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
        axes.set_ylabel(label)
        axes.legend()
    speed.axhline(1.0, color="grey", linewidth=0.8)
    figure.suptitle("Spec-Bench (shared half), greedy, batch 1, SmolLM2-135M-Instruct on this CPU")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("questions", type=Path, help="Spec-Bench's question.jsonl")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--per-group", type=int, default=4, help="prompts per group, single stream")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--rounds", type=int, default=3, help="passes over the prompts, single stream (speedups: medians of same-round ratios)"
    )
    parser.add_argument("--batch", type=int, default=16, help="prefilled sequences per group in the batch run (0: skip it)")
    parser.add_argument("--single", action=argparse.BooleanOptionalAction, default=True, help="run the single-stream part")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated, from %(default)s and suffix (SuffixDecoding, the bench extra; head: only when a head is found)",
    )
    parser.add_argument("--draft-head", default="auto", help="the head for the head method: a folder, auto (the cache's), none")
    parser.add_argument("--draft-head-vocabulary", type=int, default=DEFAULT_HEAD_VOCABULARY, help="draft tokens the head keeps (0: all)")
    add_form_flags(parser)
    args = parser.parse_args(argv)
    loaded, form = load_form(args.model, args.dtype, args.weights, args.threads)
    model, tokenizer = loaded.model, loaded.tokenizer
    head = find_head(args.draft_head, model, tokenizer, args.draft_head_vocabulary)
    methods = [name for name in args.methods.split(",") if name in ALL_METHODS and (name != "head" or head is not None)]
    print(f"methods: {methods}" + (f"; head {head.manifest}" if head is not None else ""), flush=True)
    warm = SpeculativeEngine(model, tokenizer)  # measures the step cost, once per model
    run_ours(warm, chat_prompt_ids(tokenizer, "Say hello."), 8, None)
    run_hf(model, chat_prompt_ids(tokenizer, "Say hello."), 8)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "meta": {
            "model": args.model,
            "form": str(form),
            "questions": args.questions.name,
            "per_group": args.per_group,
            "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds,
            "batch": args.batch,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.platform(),
            "methods": methods,
            "head": None if head is None else str(head.manifest),
        }
    }
    full = set(DEFAULT_METHODS) - {"head"} <= set(methods)  # what the standing tables and the plot show
    if args.single:
        groups = load_groups(args.questions, args.per_group)
        result["single"] = measure_single(model, tokenizer, groups, args.max_new_tokens, args.rounds, methods, head)
        if full:
            plot(result["single"], args.out / "spec_bench.png")
            print("\n" + single_table(result["single"]))
        print("\n" + methods_table({group: summary["methods"] for group, summary in result["single"].items()}, methods))
    if args.batch:
        result["batch"] = measure_batch(model, tokenizer, load_groups(args.questions, args.batch), args.max_new_tokens, methods, head)
        if full:
            print("\n" + batch_table(result["batch"], args.batch))
        print("\n" + methods_table(result["batch"], [name for name in methods if name in OURS]))
    (args.out / "spec_bench.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
