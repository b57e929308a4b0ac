"""Tokens per pass at fixed K against Leviathan et al.'s expectation (1 - a^(K+1)) / (1 - a).

    python -m bench.acceptance_curve ../shared/spec_bench/question.jsonl [--per-group 4] [--ks 2 4 8]
        [--max-new-tokens 96] [--out bench/results]

Leviathan et al. 2023 (sec. 3.1) model each draft token as accepted with the
same probability a, independently: a pass that verifies K drafts then emits
(1 - a^(K+1)) / (1 - a) tokens in expectation. Here, greedy, with the n-gram
drafter and a fixed K, every pass whose draft had all K tokens is recorded as
(accepted, K). a is estimated per request as accepted / (accepted +
rejections) over those passes (a pass stops at its first rejection, so that is
the maximum-likelihood estimate under the model); requests are binned by it,
and each bin's measured tokens per pass is set beside the formula at the bin's
pooled a. Writes ``acceptance_curve.json`` and ``acceptance_curve.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.spec_bench import load_groups
from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import GenerationRequest, SpeculativeEngine
from verifier_service.core.model_loading import DEFAULT_MODEL, chat_prompt_ids, load_model

BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0001)


def expected_tokens(alpha: float, k: int) -> float:
    """(1 - a^(K+1)) / (1 - a): K + 1 when every draft is accepted."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def full_passes(engine: SpeculativeEngine, ids: list[int], max_new_tokens: int, k: int) -> list[int]:
    """Accepted drafts of each pass that verified all ``k`` (one request, greedy)."""
    engine.proposer = SessionProposer(NGramDrafter())
    handle = engine.add(GenerationRequest(ids, max_new_tokens, num_speculative_tokens=k))
    accepted: list[int] = []
    while engine.busy:
        for outcome in engine.step():
            if outcome.sequence is handle and outcome.verified == k:
                accepted.append(outcome.accepted)
    return accepted


def curve(requests: list[list[int]], k: int) -> list[dict]:
    """Per bin of per-request a: requests, passes, pooled a, measured and expected tokens per pass."""
    rows = []
    for low, high in zip(BINS, BINS[1:]):
        chosen = []
        for request in requests:
            accepted = sum(request)
            rejections = sum(count < k for count in request)
            if request and low <= accepted / (accepted + rejections or 1) < high:
                chosen.append(request)
        if not chosen:
            continue
        accepted = sum(sum(request) for request in chosen)
        rejections = sum(count < k for request in chosen for count in request)
        alpha = accepted / (accepted + rejections) if accepted + rejections else 0.0
        passes = sum(len(request) for request in chosen)
        rows.append(
            {
                "bin": [low, min(high, 1.0)],
                "requests": len(chosen),
                "passes": passes,
                "alpha": round(alpha, 3),
                "measured_tokens_per_pass": round((accepted + passes) / passes, 3),
                "expected_tokens_per_pass": round(expected_tokens(alpha, k), 3),
                "all_accepted_share": round(sum(count == k for request in chosen for count in request) / passes, 3),
                "expected_all_accepted_share": round(alpha**k, 3),
            }
        )
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    grid = [i / 100 for i in range(100)]
    for k, rows in report.items():
        [line] = axes.plot(grid, [expected_tokens(a, int(k)) for a in grid], linewidth=1)
        axes.plot(
            [row["alpha"] for row in rows],
            [row["measured_tokens_per_pass"] for row in rows],
            "o",
            color=line.get_color(),
            label=f"K={k}: measured (dots), (1-a^(K+1))/(1-a) (line)",
        )
    axes.set_xlabel("a, acceptance per draft token (per-request estimate, binned)")
    axes.set_ylabel("tokens per pass, passes that verified K drafts")
    axes.set_title("Fixed K, greedy, n-gram drafts, Spec-Bench prompts, SmolLM2-135M")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("questions", type=Path, help="Spec-Bench's question.jsonl")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    engine = SpeculativeEngine(loaded.model, loaded.tokenizer)
    prompts = [chat_prompt_ids(loaded.tokenizer, p) for group in load_groups(args.questions, args.per_group).values() for p in group]
    report = {}
    for k in args.ks:
        report[str(k)] = curve([full_passes(engine, ids, args.max_new_tokens, k) for ids in prompts], k)
        print(f"K={k}: " + json.dumps(report[str(k)]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "per_group": args.per_group, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    (args.out / "acceptance_curve.json").write_text(json.dumps({"meta": meta, "curves": report}, indent=2) + "\n")
    plot(report, args.out / "acceptance_curve.png")


if __name__ == "__main__":
    main()
