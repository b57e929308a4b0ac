"""Greedy equality of speculative with plain decoding, per dtype, over the benchmark prompts.

    python -m bench.bench_dtype [--dtypes float32 bfloat16] [--max-new-tokens 64] [--out bench/results]

Exactness is defined within a dtype: for each dtype the default model is
loaded in it, and every prompt of ``bench.workloads`` is decoded by our
engine plain (K=0, one request at a time) and speculatively with adaptive K,
both one at a time and all prompts as one batch. A prompt counts as equal
when its tokens are identical to the plain ones. In float32 they must all
be (the tests hold it to that); in bfloat16 a row's rounding can depend on
how many tokens share its forward pass, which is what this measures. Also
reports tokens/s per dtype and which form the defaults (``--dtype auto --weights auto``) choose here.
``--batch-invariant off on`` measures each dtype both ways: with fixed-shape passes
(``--batch-invariant``), a token's logits do not depend on its batch-mates.

Writes ``dtype.json`` under ``--out`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from bench.workloads import workloads
from drafter_service.sessions import NGramDrafter
from verifier_service.core.drafting import SessionProposer
from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from verifier_service.core.forms import load_served
from verifier_service.core.model_loading import DEFAULT_MODEL, chat_prompt_ids, has_fast_bfloat16, load_model
from verifier_service.core.weights import use_int4_weights


def decode(engine: SpeculativeEngine, prompts: list[list[int]], max_new_tokens: int, k, batched: bool):
    """(token lists, seconds): one generate call for all prompts, or one per prompt; a fresh drafter each."""
    engine.proposer = SessionProposer(NGramDrafter())
    started = time.perf_counter()
    if batched:
        results = engine.generate([GenerationRequest(ids, max_new_tokens, num_speculative_tokens=k) for ids in prompts])
    else:
        results = []
        for ids in prompts:
            engine.proposer = SessionProposer(NGramDrafter())
            results += engine.generate([GenerationRequest(ids, max_new_tokens, num_speculative_tokens=k)])
    return [r.token_ids for r in results], time.perf_counter() - started


def measure(dtype: str, model_name: str, max_new_tokens: int, passes: str = "off", weights: str = "float") -> dict:
    """One form's equality and speed; ``passes``: --batch-invariant, "off" or "on"."""
    loaded = load_model(model_name, device="cpu", dtype=dtype)
    if weights == "int4":
        use_int4_weights(loaded.model)
    prompts = [chat_prompt_ids(loaded.tokenizer, p) for w in workloads() for p in w.prompts]
    engine = SpeculativeEngine(loaded.model, loaded.tokenizer, config=EngineConfig(batch_invariant=passes))
    plain, plain_s = decode(engine, prompts, max_new_tokens, 0, batched=False)
    single, single_s = decode(engine, prompts, max_new_tokens, None, batched=False)
    batch, batch_s = decode(engine, prompts, max_new_tokens, None, batched=True)
    tokens = sum(map(len, plain))
    return {
        "prompts": len(prompts),
        "equal_single": sum(a == b for a, b in zip(single, plain)),
        "equal_batched": sum(a == b for a, b in zip(batch, plain)),
        "plain_tokens_per_s": round(tokens / plain_s, 2),
        "adaptive_tokens_per_s": round(sum(map(len, single)) / single_s, 2),
        "batched_tokens_per_s": round(sum(map(len, batch)) / batch_s, 2),
    }


def markdown_table(report: dict) -> str:
    lines = [
        "| dtype | prompts | adaptive = plain, one at a time | adaptive = plain, all in one batch | plain tok/s | adaptive tok/s "
        "| batched tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, row in report.items():
        lines.append(
            f"| {dtype} | {row['prompts']} | {row['equal_single']} | {row['equal_batched']} | "
            f"{row['plain_tokens_per_s']:.1f} | {row['adaptive_tokens_per_s']:.1f} | {row['batched_tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--weights", nargs="+", choices=["float", "int4"], default=["float"], help="weight forms to measure (int4: bfloat16 only)"
    )
    parser.add_argument(
        "--batch-invariant", nargs="+", choices=["off", "on"], default=["off"], help="measure without and/or with fixed-shape passes"
    )
    args = parser.parse_args(argv)
    report = {
        dtype + (", int4" if weights == "int4" else "") + (", batch-invariant" if mode == "on" else ""): measure(
            dtype, args.model, args.max_new_tokens, mode, weights
        )
        for dtype in args.dtypes
        for weights in args.weights
        if weights == "float" or dtype == "bfloat16"
        for mode in args.batch_invariant
    }
    cpu = torch.device("cpu")
    meta = {
        "model": args.model,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "native_bfloat16": has_fast_bfloat16(cpu),
        "auto_picks": str(load_served(args.model, cpu)[1]),  # measured as a start with the defaults measures, last
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dtype.json").write_text(json.dumps({"meta": meta, "dtypes": report}, indent=2) + "\n")
    print(markdown_table(report))
    print(f"\nnative bf16 on this CPU: {meta['native_bfloat16']}; the defaults choose {meta['auto_picks']}")


if __name__ == "__main__":
    main()
