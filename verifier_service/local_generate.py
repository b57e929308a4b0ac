"""Generate locally with speculative decoding on the default model.

    python -m verifier_service.local_generate ["prompt" ...] [--k 5] [--max-new-tokens 96]

Without prompts it runs two samples: an input-grounded task (quoting real
documentation, where drafts copied from the prompt are accepted in long runs)
and an open question. Each prompt runs twice, plain (K=0) and speculative, so
the output shows both the speedup and that the tokens are identical.
"""

from __future__ import annotations

import argparse
import logging
import textwrap
import time

import pydoc_data.topics

from drafter_service.ngram import NGramDrafter
from verifier_service.drafting import SessionProposer
from verifier_service.engine import GenerationRequest, SpeculativeEngine
from verifier_service.model_loading import DEFAULT_MODEL, chat_prompt_ids, load_model
from verifier_service.rejection import SamplingParams

SAMPLE_DOC = "\n\n".join(pydoc_data.topics.topics["assert"].split("\n\n")[:4])
SAMPLE_PROMPTS = (
    "Here is documentation from the Python reference:\n\n" + SAMPLE_DOC
    + "\n\nQuote the sentences that explain the extended form, word for word.",
    "What is speculative decoding in language models? Answer in two sentences.",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="*", default=list(SAMPLE_PROMPTS))
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--k", type=int, default=8, help="draft tokens per step (0 = plain decoding only)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    started = time.perf_counter()
    loaded = load_model(args.model)
    print(f"loaded {args.model} on {loaded.device} in {time.perf_counter() - started:.1f}s")
    engine = SpeculativeEngine(loaded.model, loaded.tokenizer, SessionProposer(NGramDrafter()))
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    for prompt in args.prompts:
        prompt_ids = chat_prompt_ids(loaded.tokenizer, prompt)
        print("\n=== prompt\n" + textwrap.indent(prompt.strip(), "  "))
        plain = run_once(engine, GenerationRequest(prompt_ids, args.max_new_tokens, sampling, num_speculative_tokens=0))
        if args.k == 0:
            report("plain (K=0)", *plain)
            continue
        speculative = run_once(engine, GenerationRequest(prompt_ids, args.max_new_tokens, sampling, num_speculative_tokens=args.k))
        report(f"speculative (K={args.k})", *speculative)
        print(f"=== plain (K=0): {plain[1]:.2f}s; speculative: {speculative[1]:.2f}s, "
              f"{plain[1] / speculative[1]:.2f}x faster; same tokens: {plain[0].token_ids == speculative[0].token_ids}")


def run_once(engine: SpeculativeEngine, request: GenerationRequest):
    started = time.perf_counter()
    [result] = engine.generate([request])
    return result, time.perf_counter() - started


def report(label: str, result, elapsed: float) -> None:
    stats = result.stats
    print(f"=== output, {label}\n" + textwrap.indent(result.text.strip(), "  "))
    print(
        f"=== {stats.generated_tokens} tokens in {elapsed:.2f}s ({stats.generated_tokens / elapsed:.1f} tok/s), "
        f"finish={result.finish_reason}, forward passes={stats.target_forward_passes}, "
        f"drafted={stats.draft_tokens}, accepted={stats.accepted_tokens}, "
        f"acceptance={stats.acceptance_rate:.2f}, mean accepted length={stats.mean_accepted_length:.2f}, "
        f"tokens/forward pass={stats.tokens_per_forward_pass:.2f}"
    )

if __name__ == "__main__":
    main()
