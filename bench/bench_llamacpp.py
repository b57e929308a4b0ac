"""llama.cpp on the same GGUF file, as a baseline: single-stream greedy tokens/s beside ours.

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        .venv/bin/pip install llama-cpp-python==0.3.36        # built from the sdist; not needed by make test
    python -m bench.bench_llamacpp [--max-new-tokens 128] [--out bench/results]

A CPU user today would run this GGUF (SmolLM2-135M-Instruct, Q4_1) with
llama.cpp. In one run, interleaved per prompt of ``bench.workloads``:

* ``llama.cpp``: plain greedy decoding of the quantized file (its own kernels);
* ``llama.cpp-pld``: the same with llama-cpp-python's prompt lookup drafts (10 tokens);
* ``plain`` and ``adaptive``: our engine in the form a verifier serves here by
  default (``bench.served``: on an AVX512-BF16 CPU the file's own 4-bit integers
  with bfloat16 activations), K=0 and adaptive K (as ``bench_core``: one engine
  for the run, a fresh drafter per request);
* ``float32-plain`` and ``float32-adaptive``: the same in float32, weights
  dequantized from that file (the form that was the default before forms were
  measured).

Every method is timed over the whole request (prompt included) with the same
chat-template token ids. The engines do not compute the same numbers (Q4_1
kernels, int4 with bfloat16, float32), so their outputs may differ; ours are
checked against our plain decoding of the same form. The native build crashed on one of these machines, hence the explicit
instruction-set flags. Writes ``llamacpp.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from bench.bench_core import ADAPTIVE, run_fresh
from bench.served import load_form
from bench.workloads import workloads
from verifier_service.core.engine import SpeculativeEngine
from verifier_service.core.forms import using_threads
from verifier_service.core.model_loading import DEFAULT_MODEL, chat_prompt_ids, find_default_gguf

PLD_TOKENS = 10  # llama-cpp-python's default for prompt lookup


def llama_cpp(draft: bool, threads: int | None = None):
    """The default model's GGUF in llama.cpp, on ``threads`` threads (every core by default),
    with prompt lookup of PLD_TOKENS tokens when ``draft``."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = threads or os.cpu_count()
    return Llama(
        model_path=str(find_default_gguf()),
        n_ctx=4096,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PLD_TOKENS) if draft else None,
        # With a draft model llama-cpp-python (0.3.36) keeps every position's logits, but sizes
        # their buffer for all positions only when asked: past n_batch (512) tokens it fails.
        logits_all=draft,
    )


def run_llama(llm, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    llm.reset()
    started = time.perf_counter()
    tokens = []
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(token)
        if token == llm.token_eos() or len(tokens) >= max_new_tokens:
            break
    return tokens, time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    float32, float32_form = load_form(DEFAULT_MODEL, "float32", "float", torch.get_num_threads())  # as before: torch's threads
    served, form = load_form(DEFAULT_MODEL)
    tokenizer = served.tokenizer
    ours = {}  # name -> (engine, k, threads)
    for prefix, loaded, its in (("", served, form), ("float32-", float32, float32_form)):
        with using_threads(its.threads):
            for k, name in ((0, "plain"), (ADAPTIVE, "adaptive")):
                ours[prefix + name] = (SpeculativeEngine(loaded.model, loaded.tokenizer), k, its.threads)
    llamas = {"llama.cpp": llama_cpp(draft=False), "llama.cpp-pld": llama_cpp(draft=True)}
    warm = chat_prompt_ids(tokenizer, "Say hello.")
    for llm in llamas.values():
        run_llama(llm, warm, 8)
    report, mismatches = {}, set()
    for workload in workloads():
        totals = {name: [0, 0.0] for name in (*ours, *llamas)}
        for prompt in workload.prompts:
            ids = chat_prompt_ids(tokenizer, prompt)
            outputs = {}
            for name, (engine, k, threads) in ours.items():
                with using_threads(threads):
                    tokens, _, seconds = run_fresh(engine, ids, args.max_new_tokens, k, workload.repeated)
                outputs[name] = tokens
                totals[name][0] += len(tokens)
                totals[name][1] += seconds
            mismatches |= {name for name in ours if outputs[name] != outputs[name.replace("adaptive", "plain")]}
            for name, llm in llamas.items():
                tokens, seconds = run_llama(llm, ids, args.max_new_tokens)
                totals[name][0] += len(tokens)
                totals[name][1] += seconds
        rates = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
        report[workload.name] = {name: round(rate, 2) for name, rate in rates.items()}
        print(workload.name, report[workload.name], flush=True)
    meta = {
        "max_new_tokens": args.max_new_tokens,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "pld_tokens": PLD_TOKENS,
        "form": str(form),
        "float32_form": str(float32_form),
        "speculative_differs_from_plain": sorted(mismatches),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llamacpp.json").write_text(json.dumps({"meta": meta, "tokens_per_s": report}, indent=2) + "\n")
    names = [*ours, *llamas]
    print(f"\nours: {form}; float32: {float32_form}; speculative differs from plain: {sorted(mismatches) or 'never'}")
    print("\n| workload | " + " | ".join(f"{n} tok/s" for n in names) + " | adaptive / llama.cpp |")
    print("|---|" + "---:|" * (len(names) + 1))
    for name, rates in report.items():
        print(f"| {name} | " + " | ".join(f"{rates[n]:.1f}" for n in names) + f" | {rates['adaptive'] / rates['llama.cpp']:.2f} |")


if __name__ == "__main__":
    main()
