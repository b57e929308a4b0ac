"""Agent loops through our engine beside SuffixDecoding and transformers' prompt lookup, greedy, one stream.

    python -m bench.bench_agentic [--max-new-tokens 128] [--loops N] [--out bench/results/agentic]

Every loop of ``bench.agentic_workloads`` (``--loops`` per kind) runs turn by turn, each
turn's prompt the conversation an agent framework would resend (the chat template
applied), its assistant messages our plain decoding's answers to the earlier turns, so
every method gets the same prompts. On each turn the methods run back to back (machine
noise hits them alike), all in one process, on the model in the form a verifier serves
here (``bench.served``):

* ``plain``: our engine with K=0, the baseline;
* ``adaptive``: our default, K left to the engine, drafting from
  ``SessionProposer(NGramDrafter())``, one drafter for the whole run, so its global table
  learns every answer as the drafter service would;
* ``suffix``: our engine verifying SuffixDecoding's drafts (``bench.suffix_proposer``,
  vLLM's defaults, one cache for the whole run), at a fixed K of its ``max_spec_tokens``,
  as vLLM verifies every token it drafts;
* ``hf-greedy`` and ``hf-pld``: transformers ``generate`` greedy, and with prompt lookup
  (``prompt_lookup_num_tokens``, ``--pld-k``).

Two phases: ``cold`` (the first pass over the loops) and ``warm`` (the same loops again,
the drafter's table and the suffix cache holding the first pass's answers). Each of our
methods keeps one engine for the whole run. Per phase and kind: tokens per forward pass
(the prefill pass included; transformers' forward calls counted by a hook), tokens/s
(prefill included, as a user waits for it), speedup over plain (all of the kind's tokens
over all its seconds), and how many turns gave exactly plain's output (prompt lookup:
transformers' greedy output). Writes ``agentic.json`` under ``--out`` and prints Markdown
tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.agentic_workloads import KINDS, LOOPS_PER_KIND, TURNS, AgentLoop, agentic_loops, conversation
from bench.bench_core import run_hf
from bench.served import add_form_flags, load_form
from bench.suffix_proposer import SuffixProposer, SuffixSettings
from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import DraftProposer, SessionProposer
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.model_loading import DEFAULT_MODEL, chat_ids, chat_prompt_ids

PHASES = ("cold", "warm")
# transformers' documentation uses 10; agent loops copy long spans, where longer lookups pay.
DEFAULT_PLD_K = 10
# Each compared method and the method whose output it must equal.
REFERENCE = {"adaptive": "plain", "suffix": "plain", "hf-greedy": "plain", "hf-pld": "hf-greedy"}
# Methods that must reproduce their reference exactly (transformers' greedy may differ from
# ours in the last bit of a logit; it is reported, not required).
EXACT = ("adaptive", "suffix", "hf-pld")


@dataclass(frozen=True)
class Run:
    tokens: list[int]
    seconds: float
    passes: int  # forward passes of the target, prefill included (0: not counted)
    drafted: int = 0  # draft tokens verified (our engine only)
    accepted: int = 0  # of those, accepted


Runner = Callable[[list[int]], Run]


def engine_runner(engine: SpeculativeEngine, max_new_tokens: int, k: int | None) -> Runner:
    """One request at a time through ``engine`` (K: 0 plain, None adaptive, n fixed)."""

    def run(prompt_ids: list[int]) -> Run:
        started = time.perf_counter()
        [result] = engine.generate([GenerationRequest(prompt_ids, max_new_tokens, num_speculative_tokens=k)])
        stats = result.stats
        return Run(result.token_ids, time.perf_counter() - started, stats.target_forward_passes, stats.draft_tokens, stats.accepted_tokens)

    return run


def hf_runner(model, max_new_tokens: int, pld_k: int | None = None) -> Runner:
    """transformers ``generate``, greedy, with prompt lookup when ``pld_k`` is set; its forward calls are counted."""

    def run(prompt_ids: list[int]) -> Run:
        calls = [0]
        hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            tokens, _, seconds = run_hf(model, prompt_ids, max_new_tokens, pld_k)
        finally:
            hook.remove()
        return Run(tokens, seconds, calls[0])

    return run


def build_methods(model, tokenizer, max_new_tokens: int, names: list[str], suffix: SuffixSettings, pld_k: int) -> dict[str, Runner]:
    """A runner per method in ``names`` (plain always, hf-greedy with hf-pld), each of our
    methods on its own engine with its proposer, warmed up first on a throwaway proposer so
    neither the drafter's table nor the suffix cache learns the warm-up."""
    config = EngineConfig()
    first = SpeculativeEngine(model, tokenizer, None, config)  # measures the step cost, shared by the others
    engines: dict[str, tuple[SpeculativeEngine, int | None, Callable[[], DraftProposer] | None]] = {"plain": (first, 0, None)}
    if "adaptive" in names:
        engines["adaptive"] = (
            SpeculativeEngine(model, tokenizer, None, config, step_cost=first.step_cost),
            None,
            lambda: SessionProposer(NGramDrafter()),
        )
    if "suffix" in names:
        wider = dataclasses.replace(config, max_speculative_tokens=max(config.max_speculative_tokens, suffix.max_spec_tokens))
        engines["suffix"] = (
            SpeculativeEngine(model, tokenizer, None, wider, step_cost=first.step_cost),
            suffix.max_spec_tokens,
            lambda: SuffixProposer(suffix),
        )
    warm_ids = chat_prompt_ids(tokenizer, "Say hello.")
    runners: dict[str, Runner] = {}
    for name, (engine, k, make_proposer) in engines.items():
        if make_proposer is not None:
            engine.proposer = make_proposer()  # thrown away after the warm-up
        engine_runner(engine, 8, k)(warm_ids)
        if make_proposer is not None:
            engine.proposer = make_proposer()  # kept for the whole run
        runners[name] = engine_runner(engine, max_new_tokens, k)
    if "hf-pld" in names:
        runners["hf-greedy"] = hf_runner(model, max_new_tokens)
        runners["hf-pld"] = hf_runner(model, max_new_tokens, pld_k)
        runners["hf-greedy"](warm_ids)
        runners["hf-pld"](warm_ids)
    return runners


@dataclass(frozen=True)
class TurnRecord:
    phase: str
    kind: str
    loop: str
    turn: int
    prompt_tokens: int
    # The machine's 1-minute load average as the turn began: on a shared machine, what else ran
    # (above the cores the threads use, the turn's seconds measure the neighbours too).
    load_average: float
    runs: dict[str, dict]  # method -> {tokens, seconds, passes, identical}


def run_phase(phase: str, loops: list[AgentLoop], runners: dict[str, Runner], tokenizer) -> list[TurnRecord]:
    """Every loop turn by turn, every method on each turn; the next turn's history holds plain's answer."""
    records = []
    for loop in loops:
        answers: list[str] = []
        for turn in range(len(loop.turns)):
            prompt_ids = chat_ids(tokenizer, conversation(loop, turn, answers))
            load = os.getloadavg()[0]
            runs = {name: runner(prompt_ids) for name, runner in runners.items()}
            cells = {
                name: {
                    "tokens": len(run.tokens),
                    "seconds": round(run.seconds, 4),
                    "passes": run.passes,
                    "drafted": run.drafted,
                    "accepted": run.accepted,
                    **({"identical": run.tokens == runs[REFERENCE[name]].tokens} if name in REFERENCE else {}),
                }
                for name, run in runs.items()
            }
            records.append(TurnRecord(phase, loop.kind, loop.name, turn, len(prompt_ids), round(load, 2), cells))
            print(f"{phase} {loop.name} turn {turn} ({len(prompt_ids)} prompt tokens): " + _turn_line(cells), flush=True)
            answers.append(tokenizer.decode(runs["plain"].tokens, skip_special_tokens=True))
    return records


def _turn_line(cells: dict[str, dict]) -> str:
    parts = []
    for name, cell in cells.items():
        mark = "" if cell.get("identical", True) else " MISMATCH" if name in EXACT else " (differs from plain)"
        parts.append(f"{name} {cell['tokens'] / cell['seconds']:.1f} tok/s {cell['tokens'] / max(cell['passes'], 1):.2f} tok/pass{mark}")
    return "; ".join(parts)


def summarise(records: list[TurnRecord]) -> dict:
    """Per phase, per kind and "all": each method's totals, rates, speedup over plain and identical turns."""
    summary: dict[str, dict] = {}
    for phase in PHASES:
        summary[phase] = {}
        for kind in (*KINDS, "all"):
            chosen = [r for r in records if r.phase == phase and (kind == "all" or r.kind == kind)]
            if chosen:
                summary[phase][kind] = _summarise_turns(chosen)
    return summary


def _summarise_turns(records: list[TurnRecord]) -> dict:
    totals: dict[str, dict] = {}
    for name in records[0].runs:
        tokens = sum(r.runs[name]["tokens"] for r in records)
        seconds = sum(r.runs[name]["seconds"] for r in records)
        passes = sum(r.runs[name]["passes"] for r in records)
        drafted = sum(r.runs[name].get("drafted", 0) for r in records)
        totals[name] = {
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "tokens_per_pass": round(tokens / passes, 3) if passes else None,
            "acceptance_rate": round(sum(r.runs[name].get("accepted", 0) for r in records) / drafted, 3) if drafted else None,
        }
        if name in REFERENCE:
            totals[name]["identical_turns"] = sum(r.runs[name]["identical"] for r in records)
            totals[name]["turns"] = len(records)
    for row in totals.values():
        row["speedup_vs_plain"] = round(row["tokens_per_s"] / totals["plain"]["tokens_per_s"], 3)
    if "hf-pld" in totals:
        totals["hf-pld"]["speedup_vs_hf_greedy"] = round(totals["hf-pld"]["tokens_per_s"] / totals["hf-greedy"]["tokens_per_s"], 3)
    return totals


def markdown_tables(summary: dict) -> str:
    """Speed (tok/s, ×plain) and passes (tokens per pass, identical turns) per phase and kind."""
    names = [name for name in ("plain", "adaptive", "suffix", "hf-greedy", "hf-pld") if name in summary["cold"]["all"]]
    speed = ["| phase | workload | " + " | ".join(f"{n} tok/s (×plain)" for n in names) + " |", "|---|---|" + "---|" * len(names)]
    passes = [
        "| phase | workload | " + " | ".join(f"{n} tok/pass" for n in names) + " | identical turns |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    for phase, kinds in summary.items():
        for kind, rows in kinds.items():
            speed.append(
                f"| {phase} | {kind} | "
                + " | ".join(f"{rows[n]['tokens_per_s']:.1f} (×{rows[n]['speedup_vs_plain']:.2f})" for n in names)
                + " |"
            )
            identical = ", ".join(f"{n} {rows[n]['identical_turns']}/{rows[n]['turns']}" for n in names if n in EXACT)
            per_pass = [f"{rows[n]['tokens_per_pass']:.2f}" if rows[n]["tokens_per_pass"] else "–" for n in names]
            passes.append(f"| {phase} | {kind} | " + " | ".join(per_pass) + f" | {identical} |")
    return "\n".join(speed) + "\n\n" + "\n".join(passes)


def arctic_inference_version() -> str | None:
    try:
        return importlib.metadata.version("arctic-inference")
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--loops", type=int, default=LOOPS_PER_KIND, help=f"loops per kind, 1 to {LOOPS_PER_KIND}")
    parser.add_argument("--turns", type=int, default=TURNS, help=f"turns per loop, 1 to {TURNS}")
    parser.add_argument(
        "--methods", nargs="+", choices=["adaptive", "suffix", "hf-pld"], default=["adaptive", "suffix", "hf-pld"], help="beside plain"
    )
    parser.add_argument("--pld-k", type=int, default=DEFAULT_PLD_K, help="transformers' prompt_lookup_num_tokens")
    parser.add_argument("--out", type=Path, default=Path("bench/results/agentic"))
    add_form_flags(parser)
    args = parser.parse_args(argv)
    if not (1 <= args.loops <= LOOPS_PER_KIND and 1 <= args.turns <= TURNS):
        parser.error(f"--loops must be in [1, {LOOPS_PER_KIND}] and --turns in [1, {TURNS}]")
    if "suffix" in args.methods and arctic_inference_version() is None:
        parser.error("--methods suffix needs arctic-inference: pip install -e '.[bench]' (it builds a C++ extension), or leave suffix out")
    loops = agentic_loops(args.loops, args.turns)
    loaded, form = load_form(args.model, args.dtype, args.weights, args.threads)
    suffix = SuffixSettings()
    runners = build_methods(loaded.model, loaded.tokenizer, args.max_new_tokens, args.methods, suffix, args.pld_k)
    records = [record for phase in PHASES for record in run_phase(phase, loops, runners, loaded.tokenizer)]
    summary = summarise(records)
    meta = {
        "model": args.model,
        "form": str(form),
        "max_new_tokens": args.max_new_tokens,
        "loops": [loop.name for loop in loops],
        "turns": args.turns,
        "suffix_settings": dataclasses.asdict(suffix),
        "arctic_inference": arctic_inference_version(),
        "pld_k": args.pld_k,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_max": {phase: max(r.load_average for r in records if r.phase == phase) for phase in PHASES},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "summary": summary, "turns": [dataclasses.asdict(record) for record in records]}
    (args.out / "agentic.json").write_text(json.dumps(report, indent=2) + "\n")
    mismatched = sorted({f"{r.loop} turn {r.turn}: {n}" for r in records for n in EXACT if n in r.runs and not r.runs[n]["identical"]})
    if mismatched:
        print("\nOUTPUT MISMATCH (greedy speculative decoding must not change the output):\n" + "\n".join(mismatched))
    busy = {phase: load for phase, load in meta["load_average_max"].items() if load > torch.get_num_threads() + 0.5}
    if busy:
        print(
            f"\nTHE MACHINE WAS BUSY (1-minute load average up to {busy}, {torch.get_num_threads()} threads here): "
            "tokens/s and speedups measure the neighbours too"
        )
    print("\n" + markdown_tables(summary))


if __name__ == "__main__":
    main()
