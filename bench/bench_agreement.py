"""How close each served form of the default model comes to float32, on held-out text.

    python -m bench.bench_agreement ../shared/spec_bench/question.jsonl [--limit N] [--out bench/results]

Each form a verifier may serve (``verifier_service.core.forms``: bfloat16 with float
weights, and bfloat16 activations with int4 weights) reads the same texts as float32,
teacher-forced, one text a forward pass of at most ``MAX_TOKENS`` tokens. The texts are
Spec-Bench's prompts, every turn of every question as raw text (no chat template), read
from the path given and never copied into the project; the form choice never sees them.
Over every next-token position of every text it reports

* **agreement**: the share of positions whose most likely next token is float32's;
* **mean gap**: float32's log-probability of the text's actual next token less the form's,
  in nats a token (positive: the form finds the text less likely), and the mean of its
  absolute value, which does not let positions of opposite sign cancel.

The forms are computed by a plain transformers forward in their dtype and weights; the
service's batch-invariant passes round differently in detail, at the same precision (with
int4 weights they read prompts through a bfloat16 copy of the weights, ``core/weights``). The
default model's weights come from a 4-bit GGUF, so its float32 already holds the integers
the int4 form keeps (``verifier_service.core.weights``): int4 moves it little further than
bfloat16 does.

Writes ``agreement.json`` under ``--out`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verifier_service.core.forms import Form, in_form
from verifier_service.core.model_loading import DEFAULT_MODEL, load_model

MAX_TOKENS = 512  # a text's tokens read in one pass: Spec-Bench's long prompts (summaries, RAG) are cut here
MIN_TOKENS = 8  # shorter texts have too few positions to say much, and are mostly their first tokens
# in_form does not set threads: one pass's rounding is the dtype's and the weights', whatever the count.
FORMS = (Form("bfloat16", "float", 1), Form("bfloat16", "int4", 1), Form("bfloat16", "int8", 1))


@dataclass
class Totals:
    """Sums over the positions read so far, of one form against float32."""

    agreeing: int = 0
    gap: float = 0.0  # nats
    absolute_gap: float = 0.0  # nats


def texts_of(path: Path, limit: int | None = None) -> list[str]:
    """Every turn of every question in Spec-Bench's ``question.jsonl``, in file order: the
    first ``limit`` of them. ``{"turns": ["a", "b"]}`` then ``{"turns": ["c"]}`` → ["a", "b", "c"]."""
    texts: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts.extend(str(turn) for turn in json.loads(line)["turns"])
    return texts[:limit]


def token_texts(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> list[list[int]]:
    """The texts' tokens, each cut to MAX_TOKENS; texts of fewer than MIN_TOKENS left out."""
    ids = [list(tokenizer(text).input_ids[:MAX_TOKENS]) for text in texts]
    return [text for text in ids if len(text) >= MIN_TOKENS]


def label(form: Form) -> str:
    return form.dtype + ("" if form.weights == "float" else f", {form.weights} weights")


@torch.inference_mode()
def log_probs(model: PreTrainedModel, text: list[int]) -> torch.Tensor:
    """The next-token log-probabilities after each of the text's tokens but the last:
    [tokens-1, vocab], in float32 whatever the model computes in."""
    logits = model(torch.tensor([text])).logits  # [1, tokens, vocab]
    return torch.log_softmax(logits[0, :-1].float(), dim=-1)


def compare(reference: PreTrainedModel, others: dict[str, PreTrainedModel], texts: list[list[int]]) -> dict:
    """Each of ``others`` against ``reference`` over every next-token position of ``texts``
    (token lists): agreement of the most likely token, and the mean (and mean absolute) gap
    in the actual next token's log-probability, reference less other, in nats."""
    assert texts and all(len(text) >= 2 for text in texts), "each text needs a next token"
    totals = {name: Totals() for name in others}
    positions = 0
    for text in texts:
        expected = log_probs(reference, text)  # [tokens-1, vocab]
        following = torch.tensor(text[1:])[:, None]  # [tokens-1, 1]: the actual next tokens
        expected_actual = expected.gather(1, following)
        expected_choice = expected.argmax(-1)
        for name, model in others.items():
            theirs = log_probs(model, text)
            gap = (expected_actual - theirs.gather(1, following)).double()
            totals[name].agreeing += int((theirs.argmax(-1) == expected_choice).sum())
            totals[name].gap += float(gap.sum())
            totals[name].absolute_gap += float(gap.abs().sum())
        positions += len(text) - 1
    return {
        name: {
            "positions": positions,
            "agreement": round(total.agreeing / positions, 4),
            "mean_gap_nats": round(total.gap / positions, 5),
            "mean_abs_gap_nats": round(total.absolute_gap / positions, 5),
        }
        for name, total in totals.items()
    }


def measure(model: PreTrainedModel, texts: list[list[int]], forms: Iterable[Form] = FORMS) -> dict:
    """Each form of ``model`` (float32) against ``model`` itself, over ``texts`` (token lists)."""
    return compare(model, {label(form): in_form(model, form, keep=True) for form in forms}, texts)


def markdown_table(report: dict) -> str:
    lines = [
        "| form | next-token agreement with float32 | mean log-prob gap (nats/token) | mean \\|gap\\| (nats/token) | positions |",
        "|---|---:|---:|---:|---:|",
    ]
    for form, row in report.items():
        lines.append(
            f"| {form} | {row['agreement']:.4f} | {row['mean_gap_nats']:+.4f} | {row['mean_abs_gap_nats']:.4f} | {row['positions']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("questions", type=Path, help="Spec-Bench's question.jsonl (held-out text)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--limit", type=int, help="texts to read (default: all)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    loaded = load_model(args.model, device="cpu", dtype="float32")
    texts = texts_of(args.questions, args.limit)
    read = token_texts(loaded.tokenizer, texts)
    report = measure(loaded.model, read)
    meta = {
        "model": args.model,
        "questions": args.questions.name,
        "texts": len(read),
        "texts_too_short": len(texts) - len(read),
        "positions": sum(len(text) - 1 for text in read),
        "max_tokens": MAX_TOKENS,
        "threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "torch": torch.__version__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agreement.json").write_text(json.dumps({"meta": meta, "forms": report}, indent=2) + "\n")
    print(markdown_table(report))
    print(f"\n{meta['texts']} texts ({meta['texts_too_short']} under {MIN_TOKENS} tokens left out), {meta['positions']} positions")


if __name__ == "__main__":
    main()
