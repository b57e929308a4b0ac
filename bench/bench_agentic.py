"""Agent loops through our engine beside SuffixDecoding, transformers' and llama.cpp's prompt lookup, greedy, one agent or many at once.

    python -m bench.bench_agentic [--max-new-tokens 128] [--loops N] [--out bench/results/agentic]
        [--agents N] [--through-services] [--methods adaptive suffix hf-pld llama-lookup]

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
  (``prompt_lookup_num_tokens``, ``--pld-k``);
* ``llama-greedy`` and ``llama-lookup`` (only when asked, ``--methods llama-lookup``: they
  need llama-cpp-python, installed as ``bench.bench_llamacpp`` says): llama.cpp on the
  default model's GGUF, greedy, and with llama-cpp-python's ``LlamaPromptLookupDecoding``
  (``num_pred_tokens`` 10, its default), run as ``bench.bench_llamacpp`` runs them, on the
  same token ids and ``--max-new-tokens``, on as many threads as ours. Its Q4_1 kernels are
  not our arithmetic, so llama-greedy is compared with plain and llama-lookup with
  llama-greedy, and a difference is reported, never required to be absent (batched
  evaluation may round differently).

Two phases: ``cold`` (the first pass over the loops) and ``warm`` (the same loops again,
the drafter's table and the suffix cache holding the first pass's answers). Each of our
methods keeps one engine for the whole run. Per phase and kind: tokens per forward pass
(the prefill pass included; transformers' forward calls counted by a hook, llama.cpp's
``eval`` calls, the prompt's one call counted once as our prefill is), tokens/s
(prefill included, as a user waits for it), speedup over plain (all of the kind's tokens
over all its seconds), and how many turns gave exactly plain's output (prompt lookup:
transformers' greedy output). Writes ``agentic.json`` under ``--out`` and prints Markdown
tables.

**Agents at once** (``--agents N``, 1 to 16, default 1). The loops run N at a time
(``agent_groups``: the first N loops, then the next N), and each method sends turn t of
the N loops together, as one ``generate`` over one engine that batches every request in
flight into one forward pass a step. transformers' and llama.cpp's methods run one
prompt at a time here, so with N > 1 they are left out (the output says so). Per phase,
over every batch: aggregate tokens/s (the batch's tokens over its wall time), speedup over
plain at the same N, turns identical to plain, and tokens per pass counted three ways:

* ``tokens_per_pass``: over the batch's passes, each counted once however many sequences
  it carried, as a request's own stats count its passes: a step counts when it gave some
  sequence tokens (a decode step, or the one that finished a prompt's prefill), not when
  it only carried earlier chunks of prompts. Plain with 8 agents gives up to 8 tokens a
  pass; at N = 1 this is the request's ``target_forward_passes``, as above;
* ``tokens_per_forward_pass``: over every forward pass, prefill chunks included;
* ``tokens_per_pass_per_sequence``: over each request's own passes summed (what
  speculation gives a sequence, whatever its batch-mates do).

**Through the services** (``--through-services``): a real drafter (on an empty table) and
verifier run as processes on loopback (``bench.agentic_service``: ``Pair`` of
``bench.bench_spec_service``), learning on, and every turn goes through the verifier's
``Generate``, greedy, as the same chat-templated token ids; N agents are N concurrent
calls. Methods: ``plain`` (``num_speculative_tokens`` 0, which never touches the drafter)
and ``adaptive`` (unset: the default); SuffixDecoding, transformers and llama.cpp run in
this process only, so they are refused here. ``cold``: the drafter's table empty;
``warm``: the same loops again on the same drafter. A request is timed by the client,
from its call to its response. The verifier learns in the background, so a finished
answer may reach the table a moment later than in process. A client cannot see which
passes its requests shared: with N > 1, ``tokens_per_pass`` is unknown, and
``tokens_per_forward_pass`` counts the steps the verifier reports on its /metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.agentic_service import ServicePair
from bench.agentic_workloads import KINDS, LOOPS_PER_KIND, TURNS, AgentLoop, agentic_loops, conversation
from bench.bench_core import run_hf
from bench.bench_llamacpp import PLD_TOKENS, llama_cpp, run_llama
from bench.served import add_form_flags, load_form
from bench.suffix_proposer import SuffixProposer, SuffixSettings
from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import DraftProposer, SessionProposer
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.generation import GenerationResult, SequenceHandle
from verifier_service.core.model_loading import DEFAULT_MODEL, chat_ids, chat_prompt_ids, resolve_model_path

PHASES = ("cold", "warm")
# transformers' documentation uses 10; agent loops copy long spans, where longer lookups pay.
DEFAULT_PLD_K = 10
# Each compared method and the method whose output it must equal.
REFERENCE = {
    "adaptive": "plain",
    "suffix": "plain",
    "hf-greedy": "plain",
    "hf-pld": "hf-greedy",
    "llama-greedy": "plain",
    "llama-lookup": "llama-greedy",
}
# Methods that must reproduce their reference exactly (transformers' greedy may differ from
# ours in the last bit of a logit; it is reported, not required).
EXACT = ("adaptive", "suffix", "hf-pld")
# Whose identical turns the passes table shows: the exact ones, and llama.cpp's lookup
# (llama.cpp may round a batch of tokens otherwise than one, so it is shown, not required).
SHOWN_IDENTICAL = (*EXACT, "llama-lookup")
# Every method in the order a turn runs them and the tables show them.
METHOD_ORDER = ("plain", "adaptive", "suffix", "hf-greedy", "hf-pld", "llama-greedy", "llama-lookup")
# What --methods may name (plain always runs; hf-pld brings hf-greedy, llama-lookup llama-greedy).
METHODS = ("adaptive", "suffix", "hf-pld", "llama-greedy", "llama-lookup")
DEFAULT_METHODS = ("adaptive", "suffix", "hf-pld")
# The services serve our engine only: plain is K=0 on the same verifier.
SERVICE_METHODS = ("adaptive",)
# Methods that run one prompt at a time (transformers' and llama-cpp-python's generate).
ONE_AT_A_TIME = ("hf-pld", "llama-greedy", "llama-lookup")
# Every loop of every kind at once; also the engine's default batch (max_batch_size 16).
MAX_AGENTS = LOOPS_PER_KIND * len(KINDS)


@dataclass(frozen=True)
class Run:
    tokens: list[int]
    seconds: float  # alone: the request's; in a batch: from the batch's start to this request's result
    passes: int  # forward passes of the target this request took part in, prefill included (0: not counted)
    drafted: int = 0  # draft tokens verified (our engine only)
    accepted: int = 0  # of those, accepted


@dataclass(frozen=True)
class BatchRun:
    """One method's turn of a group of loops, sent together."""

    runs: list[Run]  # per prompt, in order
    seconds: float  # the whole batch, from the first request's start to the last result
    # Passes that gave some sequence tokens, each once however many sequences it carried
    # (None: not known, as to a client of the services).
    passes: int | None
    forward_passes: int | None = None  # every forward pass, prefill chunks included (None: not counted)


Runner = Callable[[list[list[int]]], BatchRun]


def alone(run: Run) -> BatchRun:
    """A run of one prompt as a batch of one: its passes are the batch's."""
    return BatchRun([run], run.seconds, run.passes)


def one_prompt(prompts: list[list[int]], method: str) -> list[int]:
    if len(prompts) != 1:
        raise ValueError(f"{method} runs one prompt at a time, got {len(prompts)}")
    return prompts[0]


def engine_runner(engine: SpeculativeEngine, max_new_tokens: int, k: int | None) -> Runner:
    """Every prompt at once through ``engine`` (K: 0 plain, None adaptive, n fixed), its steps
    driven here: a step is one forward pass for the whole batch, so the batch's passes are
    counted once a step (``BatchRun.passes``), not summed over its requests."""

    def run(prompts: list[list[int]]) -> BatchRun:
        if len(prompts) > engine.free_slots:
            raise ValueError(f"{len(prompts)} prompts at once, but the engine has {engine.free_slots} free slots")
        started = time.perf_counter()
        handles = [engine.add(GenerationRequest(ids, max_new_tokens, num_speculative_tokens=k)) for ids in prompts]
        done: dict[SequenceHandle, tuple[GenerationResult, float]] = {}
        passes = forward_passes = 0
        while engine.busy:
            outcomes = engine.step()
            forward_passes += engine.last_step is not None
            passes += any(outcome.tokens for outcome in outcomes)
            for outcome in outcomes:
                if outcome.error is not None:
                    engine.abort_all()
                    raise outcome.error
                if outcome.result is not None:
                    done[outcome.sequence] = (outcome.result, time.perf_counter() - started)
        seconds = time.perf_counter() - started
        runs = []
        for handle in handles:
            result, finished = done[handle]
            stats = result.stats
            runs.append(Run(result.token_ids, finished, stats.target_forward_passes, stats.draft_tokens, stats.accepted_tokens))
        return BatchRun(runs, seconds, passes, forward_passes)

    return run


def hf_runner(model, max_new_tokens: int, pld_k: int | None = None) -> Runner:
    """transformers ``generate``, greedy, with prompt lookup when ``pld_k`` is set; its forward calls are counted."""

    def run(prompts: list[list[int]]) -> BatchRun:
        prompt_ids = one_prompt(prompts, "transformers' generate")
        calls = [0]
        hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            tokens, _, seconds = run_hf(model, prompt_ids, max_new_tokens, pld_k)
        finally:
            hook.remove()
        return alone(Run(tokens, seconds, calls[0]))

    return run


def llama_runner(llm, max_new_tokens: int) -> Runner:
    """llama-cpp-python's ``generate``, greedy, as ``bench.bench_llamacpp`` runs it (``run_llama``),
    its ``eval`` calls counted as passes: ``generate`` evaluates the prompt in one call (which
    llama.cpp splits into ``n_batch`` decodes, as our prefill's chunks count once), then one
    call a step, the step's token with the lookup's drafts."""

    def run(prompts: list[list[int]]) -> BatchRun:
        prompt_ids = one_prompt(prompts, "llama.cpp")
        calls = [0]
        evaluate = llm.eval

        def counted(tokens):
            calls[0] += 1
            return evaluate(tokens)

        llm.eval = counted  # an attribute of this object, in front of the class's method
        try:
            tokens, seconds = run_llama(llm, prompt_ids, max_new_tokens)
        finally:
            del llm.eval  # the class's method again
        return alone(Run(tokens, seconds, calls[0]))

    return run


def service_runner(pair: ServicePair, max_new_tokens: int, k: int | None) -> Runner:
    """Every prompt as a concurrent ``Generate`` call to the verifier (K: 0 plain, None adaptive)."""

    def run(prompts: list[list[int]]) -> BatchRun:
        together = pair.generate_together(prompts, max_new_tokens, k)
        runs = [
            Run(a.token_ids, a.seconds, a.stats.target_forward_passes, a.stats.draft_tokens, a.stats.accepted_tokens)
            for a in together.answers
        ]
        # One request alone: its passes are the batch's. Several: a client sees each one's passes, never which they shared.
        return BatchRun(runs, together.seconds, runs[0].passes if len(runs) == 1 else None, together.steps)

    return run


def build_methods(model, tokenizer, max_new_tokens: int, names: list[str], suffix: SuffixSettings, pld_k: int) -> dict[str, Runner]:
    """A runner per method in ``names`` (plain always, hf-greedy with hf-pld, llama-greedy with
    llama-lookup), each of our methods on its own engine with its proposer, warmed up first on a
    throwaway proposer so neither the drafter's table nor the suffix cache learns the warm-up."""
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
        engine_runner(engine, 8, k)([warm_ids])
        if make_proposer is not None:
            engine.proposer = make_proposer()  # kept for the whole run
        runners[name] = engine_runner(engine, max_new_tokens, k)
    baselines: dict[str, Runner] = {}
    if "hf-pld" in names:
        baselines["hf-greedy"] = hf_runner(model, max_new_tokens)
        baselines["hf-pld"] = hf_runner(model, max_new_tokens, pld_k)
    if "llama-greedy" in names or "llama-lookup" in names:
        baselines["llama-greedy"] = llama_runner(llama_cpp(False, torch.get_num_threads()), max_new_tokens)
    if "llama-lookup" in names:
        baselines["llama-lookup"] = llama_runner(llama_cpp(True, torch.get_num_threads()), max_new_tokens)
    for runner in baselines.values():
        runner([warm_ids])
    return runners | baselines


def build_service_methods(pair: ServicePair, tokenizer, max_new_tokens: int, names: list[str]) -> dict[str, Runner]:
    """plain and (when named) adaptive through the verifier, after one untimed plain request
    (K 0 never touches the drafter, whose table stays empty for the cold phase)."""
    runners = {"plain": service_runner(pair, max_new_tokens, 0)}
    if "adaptive" in names:
        runners["adaptive"] = service_runner(pair, max_new_tokens, None)
    service_runner(pair, 8, 0)([chat_prompt_ids(tokenizer, "Say hello.")])
    return runners


def agent_groups(loops: list[AgentLoop], agents: int) -> list[list[AgentLoop]]:
    """The loops ``agents`` at a time, in order, the last group what is left:
    12 loops, 8 agents -> loops 0-7, then 8-11; 1 agent -> each loop alone."""
    if agents < 1:
        raise ValueError(f"agents must be >= 1, got {agents}")
    return [loops[start : start + agents] for start in range(0, len(loops), agents)]


def batch_methods(names: list[str], agents: int) -> tuple[list[str], dict[str, str]]:
    """(the methods that run with ``agents`` at once, {left-out method: why})."""
    if agents == 1:
        return list(names), {}
    skipped = {name: "runs one prompt at a time (no batching)" for name in names if name in ONE_AT_A_TIME}
    return [name for name in names if name not in skipped], skipped


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
    runs: dict[str, dict]  # method -> {tokens, seconds, passes, drafted, accepted, identical}


@dataclass(frozen=True)
class BatchRecord:
    """One turn of a group of loops sent together (``--agents`` > 1)."""

    phase: str
    loops: tuple[str, ...]
    turn: int
    prompt_tokens: int  # over the batch's prompts
    load_average: float
    # method -> {tokens, seconds (the batch's wall time), passes and forward_passes (the batch's,
    # each pass once), sequence_passes (each request's own, summed), drafted, accepted,
    # identical (requests equal to the reference's), requests}
    runs: dict[str, dict]


def run_phase(
    phase: str, loops: list[AgentLoop], runners: dict[str, Runner], tokenizer, agents: int = 1
) -> tuple[list[TurnRecord], list[BatchRecord]]:
    """Every loop turn by turn, ``agents`` loops at once, every method on each turn; each loop's
    next turn holds plain's answer. A record per loop and turn, and with agents > 1 one per batch."""
    turns: list[TurnRecord] = []
    batches: list[BatchRecord] = []
    for group in agent_groups(loops, agents):
        answers: dict[str, list[str]] = {loop.name: [] for loop in group}
        for turn in range(len(group[0].turns)):
            prompts = [chat_ids(tokenizer, conversation(loop, turn, answers[loop.name])) for loop in group]
            load = round(os.getloadavg()[0], 2)
            ran = {name: runner(prompts) for name, runner in runners.items()}
            for index, loop in enumerate(group):
                cells = request_cells({name: together.runs[index] for name, together in ran.items()})
                turns.append(TurnRecord(phase, loop.kind, loop.name, turn, len(prompts[index]), load, cells))
            if agents == 1:
                print(f"{phase} {group[0].name} turn {turn} ({len(prompts[0])} prompt tokens): " + _turn_line(turns[-1].runs), flush=True)
            else:
                cells = batch_cells(ran, turns[-len(group) :])
                batches.append(BatchRecord(phase, tuple(loop.name for loop in group), turn, sum(map(len, prompts)), load, cells))
                print(
                    f"{phase} turn {turn} of {len(group)} loops at once ({group[0].name} .. {group[-1].name}, "
                    f"{sum(map(len, prompts))} prompt tokens): " + _turn_line(cells),
                    flush=True,
                )
            for index, loop in enumerate(group):
                answers[loop.name].append(tokenizer.decode(ran["plain"].runs[index].tokens, skip_special_tokens=True))
    return turns, batches


def request_cells(runs: dict[str, Run]) -> dict[str, dict]:
    """Each method's run of one request, and whether it equals its reference's."""
    return {
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


def batch_cells(ran: dict[str, BatchRun], records: list[TurnRecord]) -> dict[str, dict]:
    """Each method's batch as a whole: its requests' cells (``records``) summed, its own seconds and passes."""
    cells = {}
    for name, together in ran.items():
        requests = [record.runs[name] for record in records]
        cells[name] = {
            "tokens": sum(cell["tokens"] for cell in requests),
            "seconds": round(together.seconds, 4),
            "passes": together.passes,
            "forward_passes": together.forward_passes,
            "sequence_passes": sum(cell["passes"] for cell in requests),
            "drafted": sum(cell["drafted"] for cell in requests),
            "accepted": sum(cell["accepted"] for cell in requests),
            "requests": len(requests),
            **({"identical": sum(cell["identical"] for cell in requests)} if name in REFERENCE else {}),
        }
    return cells


def _turn_line(cells: dict[str, dict]) -> str:
    parts = []
    for name, cell in cells.items():
        requests = cell.get("requests", 1)
        differ = requests - int(cell.get("identical", requests))
        mark = ""
        if differ:
            mark = " MISMATCH" if name in EXACT else f" (differs from {REFERENCE[name]})"
            mark += f" {differ}/{requests}" if requests > 1 else ""
        per_pass = f" {cell['tokens'] / cell['passes']:.2f} tok/pass" if cell["passes"] else ""
        parts.append(f"{name} {cell['tokens'] / cell['seconds']:.1f} tok/s{per_pass}{mark}")
    return "; ".join(parts)


def summarise(records: Sequence[TurnRecord | BatchRecord], kinds: tuple[str, ...] = (*KINDS, "all")) -> dict:
    """Per phase, per kind (``kinds``; batches mix kinds, so theirs is "all" only) and "all":
    each method's totals, rates, speedup over plain and identical turns."""
    summary: dict[str, dict] = {}
    for phase in PHASES:
        summary[phase] = {}
        for kind in kinds:
            chosen = [r for r in records if r.phase == phase and (kind == "all" or getattr(r, "kind", None) == kind)]
            if chosen:
                summary[phase][kind] = _summarise_turns(chosen)
    return summary


def per(tokens: int, counts: list[int | None]) -> float | None:
    """Tokens per counted thing, None if any cell was not counted or none was: 40, [10, 6] -> 2.5."""
    if any(count is None for count in counts) or not sum(count or 0 for count in counts):
        return None
    return round(tokens / sum(count or 0 for count in counts), 3)


def _summarise_turns(records: Sequence[TurnRecord | BatchRecord]) -> dict:
    """A request's cell counts one turn; a batch's, its ``requests``. A batch's seconds are its
    wall time and its passes shared ones, so its rates are the batch's, not a sum of its requests'."""
    totals: dict[str, dict] = {}
    for name in records[0].runs:
        cells = [r.runs[name] for r in records]
        tokens = sum(cell["tokens"] for cell in cells)
        seconds = sum(cell["seconds"] for cell in cells)
        drafted = sum(cell.get("drafted", 0) for cell in cells)
        totals[name] = {
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "tokens_per_pass": per(tokens, [cell["passes"] for cell in cells]),
            "acceptance_rate": round(sum(cell.get("accepted", 0) for cell in cells) / drafted, 3) if drafted else None,
        }
        if "forward_passes" in cells[0]:
            totals[name]["tokens_per_forward_pass"] = per(tokens, [cell["forward_passes"] for cell in cells])
            totals[name]["tokens_per_pass_per_sequence"] = per(tokens, [cell["sequence_passes"] for cell in cells])
        if name in REFERENCE:
            totals[name]["identical_turns"] = sum(int(cell["identical"]) for cell in cells)
            totals[name]["turns"] = sum(cell.get("requests", 1) for cell in cells)
    for row in totals.values():
        row["speedup_vs_plain"] = round(row["tokens_per_s"] / totals["plain"]["tokens_per_s"], 3)
    for faster, greedy in (("hf-pld", "hf-greedy"), ("llama-lookup", "llama-greedy")):
        if faster in totals and greedy in totals:
            totals[faster][f"speedup_vs_{greedy.replace('-', '_')}"] = round(
                totals[faster]["tokens_per_s"] / totals[greedy]["tokens_per_s"], 3
            )
    return totals


def _per_pass(value: float | None) -> str:
    return f"{value:.2f}" if value else "–"


def markdown_tables(summary: dict) -> str:
    """Speed (tok/s, ×plain) and passes (tokens per pass, identical turns) per phase and kind."""
    names = [name for name in METHOD_ORDER if name in summary["cold"]["all"]]
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
            identical = ", ".join(f"{n} {rows[n]['identical_turns']}/{rows[n]['turns']}" for n in names if n in SHOWN_IDENTICAL)
            passes.append(f"| {phase} | {kind} | " + " | ".join(_per_pass(rows[n]["tokens_per_pass"]) for n in names) + f" | {identical} |")
    return "\n".join(speed) + "\n\n" + "\n".join(passes)


def batch_table(summary: dict, agents: int) -> str:
    """One row per phase and method, over every batch of ``agents`` loops at once."""
    lines = [
        f"| phase ({agents} agents at once) | method | tok/s (×plain) | tok/pass | tok/forward pass | tok/pass per sequence "
        "| acceptance | identical turns |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for phase, kinds in summary.items():
        rows = kinds.get("all", {})
        for name in [n for n in METHOD_ORDER if n in rows]:
            row = rows[name]
            acceptance = "–" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
            identical = f"{row['identical_turns']}/{row['turns']}" if "identical_turns" in row else ""
            lines.append(
                f"| {phase} | {name} | {row['tokens_per_s']:.1f} (×{row['speedup_vs_plain']:.2f}) | {_per_pass(row['tokens_per_pass'])} | "
                f"{_per_pass(row.get('tokens_per_forward_pass'))} | {_per_pass(row.get('tokens_per_pass_per_sequence'))} | "
                f"{acceptance} | {identical} |"
            )
    return "\n".join(lines)


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def arctic_inference_version() -> str | None:
    return package_version("arctic-inference")


def parse_args(argv=None) -> tuple[argparse.Namespace, dict[str, str]]:
    """The flags, checked before anything loads, with ``methods`` resolved (the mode's default when
    none is named) to those that run; and those left out, each with why."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--loops", type=int, default=LOOPS_PER_KIND, help=f"loops per kind, 1 to {LOOPS_PER_KIND}")
    parser.add_argument("--turns", type=int, default=TURNS, help=f"turns per loop, 1 to {TURNS}")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        help=f"beside plain (default: {' '.join(DEFAULT_METHODS)}; through the services: {' '.join(SERVICE_METHODS)}); "
        "hf-pld brings hf-greedy, llama-lookup llama-greedy",
    )
    parser.add_argument("--pld-k", type=int, default=DEFAULT_PLD_K, help="transformers' prompt_lookup_num_tokens")
    parser.add_argument(
        "--agents",
        type=int,
        default=1,
        help=f"agent loops at once through one engine, 1 to {MAX_AGENTS} (transformers and llama.cpp: 1 only)",
    )
    parser.add_argument(
        "--through-services", action="store_true", help="through a real drafter and verifier on loopback (plain and adaptive only)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/agentic"))
    add_form_flags(parser)
    args = parser.parse_args(argv)
    if not (1 <= args.loops <= LOOPS_PER_KIND and 1 <= args.turns <= TURNS):
        parser.error(f"--loops must be in [1, {LOOPS_PER_KIND}] and --turns in [1, {TURNS}]")
    if not 1 <= args.agents <= MAX_AGENTS:
        parser.error(f"--agents must be in [1, {MAX_AGENTS}]")
    if args.agents > len(KINDS) * args.loops:
        parser.error(f"--agents {args.agents} needs at least {args.agents} loops: --loops {args.loops} gives {len(KINDS) * args.loops}")
    if args.through_services:
        refused = [name for name in args.methods or () if name not in SERVICE_METHODS]
        if refused:
            parser.error(
                f"--through-services runs plain and {', '.join(SERVICE_METHODS)} only (the services serve our engine); "
                f"{', '.join(refused)} run(s) in this process: leave --through-services out, or leave them out"
            )
    names = args.methods or list(SERVICE_METHODS if args.through_services else DEFAULT_METHODS)
    args.methods, skipped = batch_methods(names, args.agents)
    if "suffix" in args.methods and arctic_inference_version() is None:
        parser.error("--methods suffix needs arctic-inference: pip install -e '.[bench]' (it builds a C++ extension), or leave suffix out")
    if {"llama-greedy", "llama-lookup"} & set(args.methods):
        if importlib.util.find_spec("llama_cpp") is None:
            parser.error("--methods llama-* need llama-cpp-python: install it as bench/bench_llamacpp.py says, or leave them out")
        if args.model != DEFAULT_MODEL:
            parser.error(f"--methods llama-* run the default model's GGUF only: leave --model out (it is {DEFAULT_MODEL})")
    return args, skipped


def run_phases(loops: list[AgentLoop], runners: dict[str, Runner], tokenizer, agents: int, between: Callable[[], None] = lambda: None):
    """Both phases on the same runners, ``between`` them called once."""
    turns: list[TurnRecord] = []
    batches: list[BatchRecord] = []
    for index, phase in enumerate(PHASES):
        if index:
            between()
        phase_turns, phase_batches = run_phase(phase, loops, runners, tokenizer, agents)
        turns += phase_turns
        batches += phase_batches
    return turns, batches


def measure_in_process(args: argparse.Namespace, loops: list[AgentLoop]) -> tuple[list[TurnRecord], list[BatchRecord], dict]:
    loaded, form = load_form(args.model, args.dtype, args.weights, args.threads)
    suffix = SuffixSettings()
    runners = build_methods(loaded.model, loaded.tokenizer, args.max_new_tokens, args.methods, suffix, args.pld_k)
    turns, batches = run_phases(loops, runners, loaded.tokenizer, args.agents)
    return turns, batches, {"form": str(form), "suffix_settings": dataclasses.asdict(suffix)}


def measure_through_services(args: argparse.Namespace, loops: list[AgentLoop]) -> tuple[list[TurnRecord], list[BatchRecord], dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    # SIGTERM to the benchmark unwinds through the finally below, which stops both services.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    flags = ("--model", args.model, "--dtype", args.dtype, "--weights", args.weights, "--threads", str(args.threads))
    with tempfile.TemporaryDirectory() as folder:
        pair = ServicePair(Path(folder), flags)
        try:
            runners = build_service_methods(pair, tokenizer, args.max_new_tokens, args.methods)
            turns, batches = run_phases(loops, runners, tokenizer, args.agents, between=pair.settle)
            form = pair.form()
        finally:
            pair.stop()
    described = ", ".join(f"{name} {value}" for name, value in form.items() if name != "model_name")
    # The verifier's threads are what a busy machine takes from (this process only waits on it).
    return turns, batches, {"form": described, "verifier_form": form, "torch_threads": int(form.get("threads", 0)) or None}


def main(argv=None) -> None:
    args, skipped = parse_args(argv)
    for name, why in skipped.items():
        print(f"left out with --agents {args.agents}: {name} ({why})", flush=True)
    loops = agentic_loops(args.loops, args.turns)
    measure = measure_through_services if args.through_services else measure_in_process
    records, batches, mode = measure(args, loops)
    summary = summarise(batches, kinds=("all",)) if args.agents > 1 else summarise(records)
    uses_llama = {"llama-greedy", "llama-lookup"} & set(args.methods)
    meta = {
        "model": args.model,
        "max_new_tokens": args.max_new_tokens,
        "loops": [loop.name for loop in loops],
        "turns": args.turns,
        "arctic_inference": arctic_inference_version(),
        "pld_k": args.pld_k,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_max": {phase: max(r.load_average for r in records if r.phase == phase) for phase in PHASES},
        "agents": args.agents,
        "through_services": args.through_services,
        "methods": sorted(set(records[0].runs), key=METHOD_ORDER.index),
        "skipped": skipped,
        **(
            {
                "llama_cpp_python": package_version("llama_cpp_python"),
                "llama_num_pred_tokens": PLD_TOKENS,
                "llama_threads": torch.get_num_threads(),
            }
            if uses_llama
            else {}
        ),
        **mode,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "summary": summary, "turns": [dataclasses.asdict(record) for record in records]}
    if args.agents > 1:
        report["batches"] = [dataclasses.asdict(batch) for batch in batches]
    (args.out / "agentic.json").write_text(json.dumps(report, indent=2) + "\n")
    mismatched = sorted({f"{r.loop} turn {r.turn}: {n}" for r in records for n in EXACT if n in r.runs and not r.runs[n]["identical"]})
    if mismatched:
        print("\nOUTPUT MISMATCH (greedy speculative decoding must not change the output):\n" + "\n".join(mismatched))
    threads = meta["torch_threads"] or torch.get_num_threads()
    busy = {phase: load for phase, load in meta["load_average_max"].items() if load > threads + 0.5}
    if busy:
        print(
            f"\nTHE MACHINE WAS BUSY (1-minute load average up to {busy}, {threads} threads here): "
            "tokens/s and speedups measure the neighbours too"
        )
    if skipped:
        print(f"\nleft out with --agents {args.agents}: " + "; ".join(f"{name} ({why})" for name, why in skipped.items()))
    if args.through_services:
        print("\nthrough the services: plain and adaptive only (SuffixDecoding, transformers and llama.cpp run in process only)")
    print("\n" + (batch_table(summary, args.agents) if args.agents > 1 else markdown_tables(summary)))


if __name__ == "__main__":
    main()
