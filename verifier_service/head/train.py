"""Train a draft head (``head.model``) for a target by self-distillation, within a time budget.

    python -m verifier_service.head.train                 # the default model, 60 minutes
    python -m verifier_service.head.train --minutes 10 --model PATH --out FOLDER

1. Data: the target answers prompts written for this (``head.prompts``),
   greedily, batched, in our own engine. Every pass hands over the hidden
   states it computed (``SpeculativeEngine.feature_listener``), so nothing
   is computed twice: each answer token comes with the target's feature at
   the position that produced it.
2. Draft vocabulary: the most frequent tokens of those answers.
3. Training, the target frozen: from (feature at t, token t+1) the head
   predicts the feature at t+1, scored against the target's own distribution
   there (read out through the target's output rows of the draft vocabulary:
   soft labels at no extra storage), and against the feature itself. The head
   is unrolled on its own guesses for a few levels (EAGLE-3's training-time
   test), since that is how it drafts a chain.
4. Held out: answers about subjects it never trained on
   (``head.prompts.HELD_OUT``). Their first-token accuracy (the head's best
   guess is the target's greedy token) and mean accepted chain length are
   logged and kept in the manifest.

The weights go to FOLDER, or by default to the cache folder
($SPECDEC_CACHE_DIR/draft-heads/<target fingerprint>), where the verifier
finds them (``--draft-head auto``).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specdec.vocabulary import tokenizer_fingerprint
from verifier_service.core.engine import EngineConfig, SpeculativeEngine
from verifier_service.core.generation import GenerationRequest, SequenceHandle
from verifier_service.core.model_loading import DEFAULT_MODEL, cache_root, chat_prompt_ids, load_model
from verifier_service.head.model import (
    HEAD_FORMAT,
    DraftHead,
    HeadDrafter,
    HeadManifest,
    cached_head_folder,
    head_sizes,
    save_head,
    target_fingerprint,
)
from verifier_service.head.prompts import HELD_OUT, SUBJECTS, prompts

log = logging.getLogger("train_head")

DEFAULT_WIDTH = 1536
DEFAULT_DRAFT_VOCABULARY = 8192
# Levels the head is unrolled on its own guesses in training, and their weights.
UNROLL_WEIGHTS = (1.0, 0.6, 0.4)
FEATURE_LOSS_WEIGHT = 0.2
CHAIN_DEPTH = 4  # for the held-out chain length


@dataclass
class Trace:
    """One answer: ``features[i]`` is the target's feature at the position that produced ``tokens[i]``."""

    features: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def collect(
    engine: SpeculativeEngine, tokenizer, texts: list[str], max_new_tokens: int, seconds: float, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy answers to ``texts`` (in order, as many as ``seconds`` allow, the batch kept
    full), as (features [n, hidden], tokens [n]) per finished answer."""
    traces: dict[SequenceHandle, Trace] = {}

    def listen(handle: SequenceHandle, features: torch.Tensor, tokens: list[int]) -> None:
        trace = traces.get(handle)
        if trace is not None:
            trace.features.append(features.to("cpu", dtype))
            trace.tokens += tokens

    engine.listen_features(listen)
    finished: list[tuple[torch.Tensor, torch.Tensor]] = []
    deadline, pending = time.monotonic() + seconds, list(texts)
    generated = 0
    try:
        while True:
            while pending and engine.free_slots > 0 and time.monotonic() < deadline:
                request = GenerationRequest(chat_prompt_ids(tokenizer, pending.pop(0)), max_new_tokens, num_speculative_tokens=0)
                traces[engine.add(request)] = Trace()
            if not engine.busy:
                break
            for outcome in engine.step():
                if outcome.result is None and outcome.error is None:
                    continue
                trace = traces.pop(outcome.sequence, None)
                if trace is not None and outcome.result is not None and len(trace.tokens) > 1:
                    finished.append((torch.cat(trace.features), torch.tensor(trace.tokens)))
                    generated += len(trace.tokens)
            if time.monotonic() > deadline:  # the answers under way are cut short, not lost
                for handle in list(traces):
                    engine.cancel(handle)
    finally:
        engine.listen_features(None)
    log.info("collected %d answers, %d tokens", len(finished), generated)
    return finished


def draft_vocabulary(traces: list[tuple[torch.Tensor, torch.Tensor]], size: int, vocabulary: int) -> torch.Tensor:
    """The ``size`` tokens most frequent in the answers, as target ids, most frequent
    first (ties by id): a server may cut the head to its first rows."""
    counts = torch.zeros(vocabulary, dtype=torch.long)
    for _, tokens in traces:
        counts += torch.bincount(tokens, minlength=vocabulary)
    order = sorted(range(vocabulary), key=lambda token: (-int(counts[token]), token))
    chosen = torch.tensor(order[: min(size, vocabulary)], dtype=torch.long)
    covered = int(counts[chosen].sum()) / max(1, int(counts.sum()))
    log.info("draft vocabulary: %d tokens cover %.1f%% of the answers' tokens", len(chosen), 100 * covered)
    return chosen


class Examples:
    """Training positions over concatenated traces: position i is usable when the next
    ``levels`` tokens belong to the same answer."""

    def __init__(self, traces: list[tuple[torch.Tensor, torch.Tensor]], levels: int, device: torch.device | str = "cpu") -> None:
        self.features = torch.cat([features for features, _ in traces]).to(device, torch.float32)
        self.tokens = torch.cat([tokens for _, tokens in traces]).to(device)
        starts, end = [], 0
        for features, _ in traces:
            n = len(features)
            starts.append(torch.arange(end, end + max(0, n - levels)))  # an answer this short gives none
            end += n
        self.usable = (torch.cat(starts) if starts else torch.empty(0, dtype=torch.long)).to(device)

    def __len__(self) -> int:
        return len(self.usable)


def losses(head: DraftHead, drafter: HeadDrafter, examples: Examples, at: torch.Tensor, levels: int):
    """(loss, first-level accuracy) of a batch of positions ``at``, unrolled ``levels`` deep."""
    feature = examples.features[at]
    total = torch.zeros((), device=feature.device)
    correct = torch.zeros((), device=feature.device)
    for level in range(levels):
        token = examples.tokens[at + level]  # emitted from the current feature
        predicted = head(feature, drafter.embeddings(token).float())
        truth = examples.features[at + level + 1]
        with torch.no_grad():
            target = drafter.logits(truth).float().softmax(dim=-1)  # the target's own distribution, over the draft vocabulary
        logits = drafter.logits(predicted).float()
        cross_entropy = -(target * logits.log_softmax(dim=-1)).sum(dim=-1).mean()
        total = total + UNROLL_WEIGHTS[level] * cross_entropy
        if level == 0:
            total = total + FEATURE_LOSS_WEIGHT * nn.functional.smooth_l1_loss(predicted, truth)
            guess = drafter.vocab[logits.argmax(dim=-1)]
            correct = (guess == examples.tokens[at + 1]).float().mean()
        feature = predicted
    return total, correct


@torch.no_grad()
def evaluate(head: DraftHead, drafter: HeadDrafter, examples: Examples, depth: int = CHAIN_DEPTH) -> tuple[float, float]:
    """(first-token accuracy, mean accepted length of a greedy chain ``depth`` deep) on held-out positions."""
    usable = examples.usable
    if not len(usable):
        return 0.0, 0.0
    head.eval()
    hits = first = 0.0
    for batch in usable.split(2048):
        feature = examples.features[batch]
        alive = torch.ones(len(batch), dtype=torch.bool, device=batch.device)
        token = examples.tokens[batch]
        for level in range(depth):
            valid = batch + level + 1 < len(examples.tokens)
            feature = head(feature, drafter.embeddings(token).float())
            guess = drafter.vocab[drafter.logits(feature).argmax(dim=-1)]
            truth = examples.tokens[(batch + level + 1).clamp(max=len(examples.tokens) - 1)]
            alive &= (guess == truth) & valid
            if level == 0:
                first += float(alive.sum())
            hits += float(alive.sum())
            token = guess
    head.train()
    return first / len(usable), hits / len(usable)


def train(
    head: DraftHead,
    drafter: HeadDrafter,
    examples: Examples,
    held_out: Examples,
    seconds: float,
    batch: int,
    rate: float,
    steps: int | None = None,
) -> int:
    """AdamW on a cosine schedule for ``seconds`` (the step count estimated from the first
    steps' pace), or for exactly ``steps``; returns the steps taken."""
    levels = len(UNROLL_WEIGHTS)
    parameters = [p for name, p in head.named_parameters()]
    optimiser = torch.optim.AdamW(parameters, lr=rate, weight_decay=0.01)
    started = time.monotonic()
    planned, step, generator = steps, 0, torch.Generator().manual_seed(0)
    head.train()
    while True:
        elapsed = time.monotonic() - started
        if step == 20 and steps is None:
            planned = max(40, int(20 * seconds / max(elapsed, 1e-3)))
        if (steps is None and elapsed > seconds) or (planned is not None and step >= planned):
            break
        horizon = planned or 10_000
        warm = min(1.0, (step + 1) / 20)
        for group in optimiser.param_groups:
            group["lr"] = rate * warm * 0.5 * (1 + math.cos(math.pi * min(step, horizon) / horizon))
        at = examples.usable[torch.randint(len(examples), (batch,), generator=generator).to(examples.usable.device)]
        loss, accuracy = losses(head, drafter, examples, at, levels)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(parameters, 1.0)
        optimiser.step()
        step += 1
        if step % 200 == 0:
            first, chain = evaluate(head, drafter, held_out)
            log.info(
                "step %d/%s loss %.3f batch accuracy %.2f | held out: first token %.3f, chain %.2f (%.0f s)",
                step, planned, loss.item(), accuracy.item(), first, chain, time.monotonic() - started,
            )  # fmt: skip
    return step


def parser() -> argparse.ArgumentParser:
    """The trainer's command line (``docs/reference/tools.md`` is made from it)."""
    parser = argparse.ArgumentParser(prog="python -m verifier_service.head.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the head (default: the cache folder the verifier reads)")
    parser.add_argument("--minutes", type=float, default=60.0, help="the whole budget, end to end (default %(default)s)")
    parser.add_argument("--data-share", type=float, default=0.5, help="share of the budget spent generating answers (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="answers generated at once (default %(default)s)")
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="the head's inner size (default %(default)s)")
    parser.add_argument(
        "--draft-vocabulary", type=int, default=DEFAULT_DRAFT_VOCABULARY, help="tokens the head drafts from (default %(default)s)"
    )
    parser.add_argument("--train-batch", type=int, default=256, help="positions per optimiser step (default %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=2e-3, help="AdamW's peak rate, on a cosine schedule (default %(default)s)")
    parser.add_argument(
        "--held-out-share", type=float, default=0.08, help="share of the data budget spent on held-out answers (default %(default)s)"
    )
    return parser


def too_little_data(traces: list, held_out: list, args: argparse.Namespace) -> str | None:
    """Why training cannot start on what ``collect`` gathered (no answer for training or none
    held out: the data budget ran out first), or None."""
    if traces and held_out:
        return None
    data_minutes = args.minutes * args.data_share
    which = "for training" if not traces else "held out"
    return (
        f"no answer was completed {which} within the data budget ({data_minutes:.2f} of --minutes {args.minutes:g}, "
        f"--data-share {args.data_share:g}); give more --minutes or a larger --data-share, or fewer --max-new-tokens"
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = time.monotonic()
    budget = args.minutes * 60

    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.requires_grad_(False)
    fingerprint = target_fingerprint(model, tokenizer)
    config = EngineConfig(max_batch_size=args.batch_size, successor_top_k=0)
    # Calibrated (or the stored calibration) as the service is: it also picks the fastest linear kernels.
    engine = SpeculativeEngine(model, tokenizer, None, config, calibration_folder=cache_root() / "calibration")
    data_seconds = budget * args.data_share
    held_out_traces = collect(engine, tokenizer, prompts(HELD_OUT), args.max_new_tokens, data_seconds * args.held_out_share, torch.float32)
    traces = collect(engine, tokenizer, prompts(SUBJECTS), args.max_new_tokens, data_seconds * (1 - args.held_out_share), torch.float32)
    problem = too_little_data(traces, held_out_traces, args)
    if problem:
        log.error("%s", problem)
        return 2
    trained_tokens = sum(len(tokens) for _, tokens in traces)

    hidden, embedding = head_sizes(model)
    vocabulary = model.get_output_embeddings().weight.shape[0]
    head = DraftHead(hidden, embedding, args.width, min(args.draft_vocabulary, vocabulary))
    head.vocab.copy_(draft_vocabulary(traces, args.draft_vocabulary, vocabulary))
    drafter = HeadDrafter(head, model)
    head.requires_grad_(True).float()  # HeadDrafter froze it for serving (and moved it to the model's device)
    device = next(model.parameters()).device
    examples, held_out = Examples(traces, len(UNROLL_WEIGHTS), device), Examples(held_out_traces, 1, device)
    log.info("%d training positions, %d held out", len(examples), len(held_out))
    remaining = budget - (time.monotonic() - started) - 30  # saving and the last evaluation
    steps = train(head, drafter, examples, held_out, max(remaining, 10), args.train_batch, args.learning_rate)
    first, chain = evaluate(head, drafter, held_out)
    log.info("held out after %d steps: first-token accuracy %.3f, mean accepted chain %.2f of %d", steps, first, chain, CHAIN_DEPTH)

    manifest = HeadManifest(
        format=HEAD_FORMAT,
        target=fingerprint,
        vocabulary=tokenizer_fingerprint(tokenizer),
        hidden_size=hidden,
        embedding_size=embedding,
        width=args.width,
        draft_vocabulary=len(head.vocab),
        trained_tokens=trained_tokens,
        held_out_accuracy=round(first, 4),
        note=f"{steps} steps, {len(examples)} positions, held-out chain {chain:.2f}, {time.monotonic() - started:.0f} s",
    )
    folder = args.out or cached_head_folder(cache_root(), fingerprint)
    save_head(folder, head.eval(), manifest)
    log.info("saved to %s (%.0f s in all)", folder, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
