"""Greedy benchmark of the speculative core against honest baselines: single stream, and a decoding batch.

    python -m bench.bench_core [--max-new-tokens 128] [--batch 16] [--out bench/results]

Single stream, in one run, on the default model, for every workload in ``bench.workloads``:

* ``plain``: our engine with K=0 (same code path, no drafts) -- the baseline;
* ``adaptive``: our engine with the n-gram drafter, K left to the engine --
  what the service does by default, and the headline number;
* ``spec-K`` for K in {1, 2, 3, 5, 8}: fixed K, for reference;
* ``hf-greedy``: transformers ``generate(do_sample=False)``;
* ``hf-pld-K``: transformers prompt lookup (``prompt_lookup_num_tokens``).

Methods run interleaved per prompt (so machine noise hits them alike) after
one untimed warm-up, in ``--single-rounds`` rounds; a speedup is the median
over rounds of same-round ratios (one round's adaptive-vs-fixed ranking
swung by ±15% with the machine's load). Each of our methods keeps one engine for the whole run,
as the service does (what adaptive K learns about draft odds carries over),
with a fresh drafter per request, so no request is drafted from an earlier
answer. Every method of ours is checked against our plain decoding, prompt
lookup against transformers' greedy: greedy speculative decoding must not
change the output. The model is in the form a verifier serves on this machine
(``--dtype``, ``--weights``, ``--threads``; ``bench.served``), transformers'
methods included; ``--dtype float32`` is today's arithmetic of transformers.

Batch mode (``--batch N``, 0 to skip): N distinct prompts of a kind
(``bench.workloads.service_prompts``) are prefilled together, then only the
decoding is timed, for plain, adaptive and fixed K: what batched
verification and adaptive K control, apart from prefill, which speculation
cannot speed up. ``oracle-K`` rows draft plain's own output (every draft
accepted): the most any drafter could give at that K on this machine. ``--repeats`` rounds of every method; speedups are medians
over rounds of same-round ratios.

Writes ``core.json``, ``core_batch.json``, ``core_speedup.png`` and
``step_cost.json`` (the start-up calibration the engine decides padding and
adaptive K from) under ``--out``, and prints Markdown tables for the README.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.served import add_form_flags, load_form
from bench.workloads import Workload, service_prompts, workloads
from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import DraftProposer, DraftRequest, ProposedDraft, SessionProposer
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.model_loading import DEFAULT_MODEL, chat_prompt_ids

SPEC_KS = (1, 2, 3, 5, 8)
ADAPTIVE = None  # num_speculative_tokens unset: the engine chooses per step
# transformers' docs use 10 for prompt lookup; 3 is closer to our best K.
# Both are measured and the faster one is the baseline we compare against.
PLD_KS = (3, 10)
BATCH_KS = (0, ADAPTIVE, 3, 5, 8)
# Batch mode's ceiling: a drafter that always proposes plain's own output.
ORACLE_KS = (2, 4, 8)


def method_name(k: int | None) -> str:
    return "plain" if k == 0 else "adaptive" if k is ADAPTIVE else f"spec-{k}"


# (name, K, drafts from the oracle) of every batch-mode method, plain first.
BATCH_METHODS = [(method_name(k), k, False) for k in BATCH_KS] + [(f"oracle-{k}", k, True) for k in ORACLE_KS]


class ReferenceOracle:
    """A proposer whose every draft is right: the rest of plain decoding's output.

    Run beside the n-gram drafter in batch mode, it measures the ceiling this
    machine puts on batched verification: what speculation at a fixed K would
    give if no draft token were ever rejected. If even that is slower than a
    target, no drafter and no choice of K can reach it here.
    """

    def __init__(self, references: list[list[int]]) -> None:
        self.references = references  # prompt + plain's output, per sequence
        self._sessions: dict[str, list[int]] = {}  # session -> its reference, found on its first call

    def propose(self, requests: list[DraftRequest]) -> list[ProposedDraft]:
        drafts = []
        for request in requests:
            length = len(request.tokens)
            reference = self._sessions.get(request.session_id)
            if reference is None:
                reference = next((r for r in self.references if r[:length] == request.tokens), [])
                self._sessions[request.session_id] = reference
            drafts.append(ProposedDraft(reference[length : length + request.k]))
        return drafts

    def close(self, finished) -> None:
        for session_id, *_ in finished:
            self._sessions.pop(session_id, None)


def run_engine(engine: SpeculativeEngine, prompt_ids, max_new_tokens, k, drafter):
    """(tokens, stats, seconds) for one request through our engine, drafting with ``drafter``."""
    engine.proposer = SessionProposer(drafter)
    started = time.perf_counter()
    [result] = engine.generate([GenerationRequest(prompt_ids, max_new_tokens, num_speculative_tokens=k)])
    return result.token_ids, result.stats, time.perf_counter() - started


@torch.inference_mode()
def run_hf(model, prompt_ids, max_new_tokens, pld_k=None):
    input_ids = torch.tensor([prompt_ids], device=model.device)
    extra = {"prompt_lookup_num_tokens": pld_k} if pld_k else {}
    started = time.perf_counter()
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=model.generation_config.eos_token_id,
        **extra,
    )
    return output[0, len(prompt_ids) :].tolist(), None, time.perf_counter() - started


def run_fresh(engine: SpeculativeEngine, prompt_ids, max_new_tokens, k, repeated: bool):
    """``run_engine`` with a fresh drafter: its global table must not remember
    the timed output from a warm-up or an earlier method, unless the workload
    is a ``repeated`` request, which it then sees once, untimed, before."""
    drafter = NGramDrafter()
    if repeated:
        run_engine(engine, prompt_ids, max_new_tokens, k, drafter)
    return run_engine(engine, prompt_ids, max_new_tokens, k, drafter)


def methods(model, engines: dict, max_new_tokens, workload: Workload) -> dict[str, Callable]:
    table: dict[str, Callable] = {
        method_name(k): (lambda ids, k=k: run_fresh(engines[k], ids, max_new_tokens, k, workload.repeated)) for k in (0, ADAPTIVE, *SPEC_KS)
    }
    table["hf-greedy"] = lambda ids: run_hf(model, ids, max_new_tokens)
    table.update({f"hf-pld-{k}": (lambda ids, k=k: run_hf(model, ids, max_new_tokens, k)) for k in PLD_KS})
    return table


def measure(model, tokenizer, max_new_tokens: int, rounds: int, only: list[str] | None = None, config: EngineConfig | None = None) -> dict:
    """Per workload, ``rounds`` rounds of every method over its prompts (interleaved per
    prompt); each method's speedup is the median over rounds of its rate over plain's
    rate in the same round (a shared machine's speed drifts by 10-30% within minutes)."""
    report = {}
    engines = {k: SpeculativeEngine(model, tokenizer, None, config) for k in (0, ADAPTIVE, *SPEC_KS)}  # one per method, for the whole run
    for workload in workloads():
        if only and workload.name not in only:
            continue
        prompt_ids = [chat_prompt_ids(tokenizer, prompt) for prompt in workload.prompts]
        table = methods(model, engines, max_new_tokens, workload)
        per_round: list[dict] = []
        mismatches: set[str] = set()
        for _ in range(rounds):
            totals = {name: {"tokens": 0, "seconds": 0.0, "forward": 0, "drafted": 0, "accepted": 0, "steps": 0} for name in table}
            for ids in prompt_ids:
                outputs = {}
                for name, run in table.items():
                    tokens, stats, elapsed = run(ids)
                    outputs[name] = tokens
                    total = totals[name]
                    total["tokens"] += len(tokens)
                    total["seconds"] += elapsed
                    if stats is not None:
                        total["forward"] += stats.target_forward_passes
                        total["drafted"] += stats.draft_tokens
                        total["accepted"] += stats.accepted_tokens
                        total["steps"] += stats.verify_steps_with_drafts
                # Ours against our plain decoding (the same form); transformers' prompt lookup against its greedy.
                mismatches.update(
                    name for name, tokens in outputs.items() if tokens != outputs["hf-greedy" if name.startswith("hf-") else "plain"]
                )
            per_round.append(totals)
        report[workload.name] = _summarise(workload, per_round, sorted(mismatches))
        _print_workload(workload.name, report[workload.name])
    return report


def _summarise(workload, per_round: list[dict], mismatches: list[str]) -> dict:
    """Per method: the first round's counts and rates, with speedups and rates as medians over rounds."""

    def rate(totals, name):
        return totals[name]["tokens"] / totals[name]["seconds"]

    rows = {}
    for name, total in per_round[0].items():
        rows[name] = {
            "tokens": total["tokens"],
            "seconds_per_round": [round(totals[name]["seconds"], 3) for totals in per_round],
            "tokens_per_s": round(statistics.median(rate(totals, name) for totals in per_round), 2),
            "speedup_vs_plain": round(statistics.median(rate(totals, name) / rate(totals, "plain") for totals in per_round), 3),
            "speedup_vs_hf_greedy": round(statistics.median(rate(totals, name) / rate(totals, "hf-greedy") for totals in per_round), 3),
        }
        if total["forward"]:
            rows[name].update(
                acceptance_rate=round(total["accepted"] / total["drafted"], 3) if total["drafted"] else 0.0,
                mean_accepted_length=round(total["accepted"] / total["steps"], 3) if total["steps"] else 0.0,
                tokens_per_forward_pass=round(total["tokens"] / total["forward"], 3),
            )
    # Adaptive against the fixed K whose median speedup is best, as a median of same-round ratios.
    best = max((m for m in rows if m.startswith("spec-")), key=lambda m: rows[m]["speedup_vs_plain"])
    return {
        "grounded": workload.grounded,
        "repeated": workload.repeated,
        "rounds": len(per_round),
        "mismatches": mismatches,
        "best_fixed": best,
        "adaptive_vs_best_fixed": round(statistics.median(rate(totals, "adaptive") / rate(totals, best) for totals in per_round), 3),
        "methods": rows,
    }


def _print_workload(name, summary):
    print(f"\n## {name}" + (f"  (OUTPUT MISMATCH: {summary['mismatches']})" if summary["mismatches"] else ""))
    for method, row in summary["methods"].items():
        extra = ""
        if "tokens_per_forward_pass" in row:
            extra = f"  acc={row['acceptance_rate']:.2f} mal={row['mean_accepted_length']:.2f} tpf={row['tokens_per_forward_pass']:.2f}"
        print(
            f"{method:>11}: {row['tokens_per_s']:6.1f} tok/s  x{row['speedup_vs_plain']:.2f} plain  "
            f"x{row['speedup_vs_hf_greedy']:.2f} hf{extra}"
        )


def markdown_table(report) -> str:
    lines = [
        "| workload | plain tok/s | adaptive tok/s | adaptive ×plain | best fixed K ×plain | adaptive / best fixed "
        "| ×hf greedy | ×best hf PLD | acceptance | tokens/pass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, summary in report.items():
        rows, best = summary["methods"], summary["best_fixed"]
        pld = max(rows[m]["speedup_vs_plain"] for m in rows if m.startswith("hf-pld-"))
        row = rows["adaptive"]
        lines.append(
            f"| {name} | {rows['plain']['tokens_per_s']:.1f} | {row['tokens_per_s']:.1f} | {row['speedup_vs_plain']:.2f} | "
            f"{rows[best]['speedup_vs_plain']:.2f} ({best[5:]}) | {summary['adaptive_vs_best_fixed']:.2f} | "
            f"{row['speedup_vs_hf_greedy']:.2f} | {row['speedup_vs_plain'] / pld:.2f} | "
            f"{row['acceptance_rate']:.2f} | {row['tokens_per_forward_pass']:.2f} |"
        )
    return "\n".join(lines)


def k_table(report) -> str:
    """Speedup over plain for every method, one row per workload."""
    names = ["adaptive", *(f"spec-{k}" for k in SPEC_KS), *(f"hf-pld-{k}" for k in PLD_KS)]
    lines = ["| workload | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for name, summary in report.items():
        rows = summary["methods"]
        lines.append(f"| {name} | " + " | ".join(f"{rows[m]['speedup_vs_plain']:.2f}" for m in names) + " |")
    return "\n".join(lines)


def measure_batch(model, tokenizer, batch: int, max_new_tokens: int, repeats: int, config: EngineConfig | None = None) -> dict:
    """Decode-only tokens/s of ``batch`` prefilled sequences, per prompt kind and method.

    Every method runs once per round, ``repeats`` rounds; a method's speedup
    is the median over rounds of its tokens/s over plain's in the same round
    (this machine is shared: rounds differed by up to 30% in absolute speed).
    """
    report = {}
    for kind in ("grounded", "open_ended"):
        prompts = [chat_prompt_ids(tokenizer, p) for p in service_prompts(kind)[:batch]]
        rounds, reference = [], None
        for round_ in range(repeats):
            cells = {}
            for name, k, oracle in BATCH_METHODS:
                if oracle:
                    assert reference is not None  # plain runs first
                    proposer: DraftProposer = ReferenceOracle([prompt + output for prompt, output in zip(prompts, reference)])
                else:
                    proposer = SessionProposer(NGramDrafter())
                engine = SpeculativeEngine(model, tokenizer, proposer, config)
                tokens, seconds, stats = decode_batch(engine, prompts, max_new_tokens, k)
                reference = tokens if reference is None else reference
                decoded = sum(map(len, tokens)) - len(tokens)  # the first token of each comes from prefill
                cells[name] = {
                    "decode_tokens": decoded,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(decoded / seconds, 2),
                    "forward_passes": stats["passes"],
                    "tokens_per_pass_per_sequence": round(stats["tokens"] / stats["row_passes"], 3),
                    "identical_to_plain": tokens == reference,
                }
                print(f"batch {batch} {kind} round {round_} {name}: {cells[name]}", flush=True)
            for cell in cells.values():
                cell["speedup_vs_plain"] = round(cell["tokens_per_s"] / cells["plain"]["tokens_per_s"], 3)
            rounds.append(cells)
        report[kind] = {
            name: {
                "speedup_vs_plain": statistics.median(r[name]["speedup_vs_plain"] for r in rounds),
                "tokens_per_s": statistics.median(r[name]["tokens_per_s"] for r in rounds),
                "tokens_per_pass_per_sequence": rounds[0][name]["tokens_per_pass_per_sequence"],
                "identical_to_plain": all(r[name]["identical_to_plain"] for r in rounds),
                "rounds": [r[name] for r in rounds],
            }
            for name in rounds[0]
        }
    return report


def decode_batch(engine: SpeculativeEngine, prompts, max_new_tokens: int, k) -> tuple[list[list[int]], float, dict]:
    """Prefill every prompt (untimed), then decode all to the end: (tokens per prompt, decode seconds, counts)."""
    sequences = [engine.add(GenerationRequest(ids, max_new_tokens, num_speculative_tokens=k)) for ids in prompts]
    tokens: dict[int, list[int]] = {id(s): [] for s in sequences}
    while any(not tokens[id(s)] for s in sequences):
        for outcome in engine.step():
            tokens[id(outcome.sequence)] += outcome.tokens
    started, passes, row_passes, decoded, accepting = time.perf_counter(), 0, 0, 0, 0
    while engine.busy:
        outcomes = engine.step()
        passes += 1
        for outcome in outcomes:
            tokens[id(outcome.sequence)] += outcome.tokens
            if outcome.tokens:
                row_passes += 1
                decoded += len(outcome.tokens)
                accepting += outcome.accepted > 0
    seconds = time.perf_counter() - started
    counts = {"passes": passes, "row_passes": row_passes, "tokens": decoded, "accepting": accepting}
    return [tokens[id(s)] for s in sequences], seconds, counts


def batch_table(report, batch: int) -> str:
    names = [name for name, _, _ in BATCH_METHODS]
    lines = [f"| {batch} sequences, decode only | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for kind, cells in report.items():
        lines.append(f"| {kind} tok/s (median) | " + " | ".join(f"{cells[m]['tokens_per_s']:.1f}" for m in names) + " |")
        lines.append(f"| {kind} ×plain (median of rounds) | " + " | ".join(f"{cells[m]['speedup_vs_plain']:.2f}" for m in names) + " |")
        lines.append(f"| {kind} tokens/pass/seq | " + " | ".join(f"{cells[m]['tokens_per_pass_per_sequence']:.2f}" for m in names) + " |")
    return "\n".join(lines)


def plot(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, summary in report.items():
        rows = summary["methods"]
        [line] = axes.plot([0, *SPEC_KS], [1.0] + [rows[f"spec-{k}"]["speedup_vs_plain"] for k in SPEC_KS], marker="o", label=name)
        # Adaptive K (the default) picks per step, so it has no K: a dashed level in the same colour.
        axes.axhline(rows["adaptive"]["speedup_vs_plain"], color=line.get_color(), linestyle="--", linewidth=1)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xlabel("K (draft tokens per step); dashed: adaptive K")
    axes.set_ylabel("speedup vs our plain decoding (K=0)")
    axes.set_title("Greedy speculative decoding, SmolLM2-135M-Instruct, CPU")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="sequences in the decode-only batch run (0: skip it)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the batch run (the median speedup is reported)")
    parser.add_argument("--single", action=argparse.BooleanOptionalAction, default=True, help="run the single-stream part")
    parser.add_argument(
        "--single-rounds", type=int, default=3, help="rounds of the single-stream run (speedups are medians of same-round ratios)"
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=[workload.name for workload in workloads()], help="single-stream workloads to run (default: all)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--max-adaptive-nodes", type=int, help="the engine's --max-adaptive-nodes (default: the engine's; 0: chains, as before draft trees)"
    )
    add_form_flags(parser)
    args = parser.parse_args(argv)
    config = EngineConfig() if args.max_adaptive_nodes is None else EngineConfig(max_adaptive_nodes=args.max_adaptive_nodes)
    loaded, form = load_form(args.model, args.dtype, args.weights, args.threads)
    model, tokenizer = loaded.model, loaded.tokenizer
    warm_ids = chat_prompt_ids(tokenizer, "Say hello.")
    warm_engine = SpeculativeEngine(model, tokenizer)  # measures the step cost (once per model)
    run_engine(warm_engine, warm_ids, 8, 3, NGramDrafter())
    run_hf(model, warm_ids, 8)
    args.out.mkdir(parents=True, exist_ok=True)
    # What padding and adaptive K decide from on this machine: kept as a record, never read back.
    cost = warm_engine.step_cost
    (args.out / "step_cost.json").write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "torch_threads": torch.get_num_threads(),
                "ms_by_tokens": {tokens: round(1000 * seconds, 2) for tokens, seconds in cost.points().items()},
                "us_per_cached_token_read": round(1e6 * cost.per_context_token, 3),
                "padding_by_tokens": {tokens: cost.padding(tokens) for tokens in range(1, 33) if cost.padding(tokens)},
            },
            indent=2,
        )
        + "\n"
    )
    meta = {
        "model": args.model,
        "form": str(form),
        "max_new_tokens": args.max_new_tokens,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "cpu_count": __import__("os").cpu_count(),
    }
    if args.single:
        report = measure(model, tokenizer, args.max_new_tokens, args.single_rounds, args.workloads, config)
        (args.out / "core.json").write_text(json.dumps({"meta": meta, "workloads": report}, indent=2) + "\n")
        plot(report, args.out / "core_speedup.png")
        print("\n" + markdown_table(report) + "\n\n" + k_table(report))
    if args.batch:
        batch = measure_batch(model, tokenizer, args.batch, args.max_new_tokens, args.repeats, config)
        (args.out / "core_batch.json").write_text(json.dumps({"meta": {**meta, "batch": args.batch}, "kinds": batch}, indent=2) + "\n")
        print("\n" + batch_table(batch, args.batch))


if __name__ == "__main__":
    main()
