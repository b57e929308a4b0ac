"""Every form on every instruction set this CPU can show: plain and speculative decoding per
form, against float32 plain, and what the start-up chooser picks there.

    python -m bench.bench_forms [--isas native avx512_core_bf16 avx2] [--max-new-tokens 64]
                                [--batch 16] [--out bench/results/forms]

A CPU runs the kernels of the newest instruction set it has; users' CPUs have fewer. Each
``--isas`` entry runs in a process of its own, with oneDNN and ATen held to that set before
torch loads (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``): ``native`` as the CPU is (AMX
where it has it), ``avx512_core_bf16`` AVX-512 with native bfloat16 and no AMX (as AMD's Zen 4
and 5, Intel's Cooper Lake), ``avx2`` an AVX2 laptop's (no AVX-512, bfloat16 emulated). An
entry above what the CPU has measures nothing new and is skipped: the report says which
instruction sets were real and which held back.

In each, the default model in each form (``float32``; ``bfloat16``; ``bfloat16, int4
weights``), on torch's thread count, as a verifier serves it (batch-invariant passes where
the start-up probe finds them, ``--batch-invariant auto``):

* one stream: each workload's first prompt (``bench.workloads``), ``--max-new-tokens``,
  decoded plain (K=0) and with adaptive K and the n-gram drafter (``bench_core.run_fresh``:
  a fresh drafter per request, the engine kept): tokens/s over the prompts together,
  prefill included;
* a batch: ``--batch`` prompts of grounded text (``bench.workloads.service_prompts``)
  prefilled, then only their decoding timed, plain and adaptive;
* every speculative output checked against plain's in its form (greedy);
* the form ``choose_form`` picks there for ``--optimize-for balanced``, and what it expected
  of each (its timing of the forms, not the decoding above).

Ratios are to float32's plain decoding in the same process. Writes ``forms.json`` under
``--out`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

# What each --isas entry holds oneDNN and ATen to (nothing: as the CPU is).
ISAS = {
    "native": {},
    "avx512_core_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
# The CPU flags an entry needs to be real here; without them it is skipped.
NEEDS = {"native": set(), "avx512_core_bf16": {"avx512_bf16"}, "avx2": {"avx2"}}
FORMS = (("float32", "float"), ("bfloat16", "float"), ("bfloat16", "int4"))


def worker(args: argparse.Namespace) -> dict:
    """One instruction set's measurements, in this process (its variables already set)."""
    import torch

    from bench.bench_core import decode_batch, run_fresh
    from bench.workloads import service_prompts, workloads
    from drafter_service.sessions import NGramDrafter
    from verifier_service.core.drafting import SessionProposer
    from verifier_service.core.engine import EngineConfig, GenerationRequest, SpeculativeEngine
    from verifier_service.core.forms import Form, choose_form, in_form
    from verifier_service.core.model_loading import DEFAULT_MODEL, chat_prompt_ids, load_model

    threads = torch.get_num_threads()
    loaded = load_model(DEFAULT_MODEL, device="cpu", dtype="float32")
    tokenizer = loaded.tokenizer
    singles = [chat_prompt_ids(tokenizer, workload.prompts[0]) for workload in workloads()]
    batch = [chat_prompt_ids(tokenizer, prompt) for prompt in service_prompts("grounded")[: args.batch]]
    config = EngineConfig()
    report: dict = {"aten_capability": torch.backends.cpu.get_cpu_capability(), "threads": threads, "forms": {}}

    for dtype, weights in FORMS:
        form = Form(dtype, weights, threads)
        engine = SpeculativeEngine(in_form(loaded.model, form, keep=True), tokenizer, None, config)
        cell: dict = {"batch_invariant": engine.target.invariance is not None}
        outputs: dict = {}
        with torch.inference_mode():
            engine.generate([GenerationRequest(singles[0][:16], 4, num_speculative_tokens=0)])  # warm-up
            for name, k in (("plain", 0), ("adaptive", None)):
                runs = [run_fresh(engine, ids, args.max_new_tokens, k, repeated=False) for ids in singles]
                outputs[name] = [tokens for tokens, _, _ in runs]
                produced, seconds = sum(len(tokens) for tokens, _, _ in runs), sum(seconds for *_, seconds in runs)
                cell[f"one_stream_{name}_tokens_per_s"] = round(produced / seconds, 2)
            for name, k in (("plain", 0), ("adaptive", None)):
                engine.proposer = SessionProposer(NGramDrafter()) if k is None else None
                tokens, seconds, _ = decode_batch(engine, batch, args.max_new_tokens, k)
                outputs[f"batch_{name}"] = tokens
                cell[f"batch_{name}_tokens_per_s"] = round((sum(map(len, tokens)) - len(tokens)) / seconds, 2)
        cell["speculative_equals_plain"] = outputs["adaptive"] == outputs["plain"] and outputs["batch_adaptive"] == outputs["batch_plain"]
        report["forms"][str(form)] = cell
        print(f"{form}: {cell}", flush=True)
        del engine

    base = report["forms"][str(Form("float32", "float", threads))]
    for cell in report["forms"].values():
        for key in [key for key in cell if key.endswith("_tokens_per_s")]:
            reference = base["one_stream_plain_tokens_per_s"] if key.startswith("one_stream") else base["batch_plain_tokens_per_s"]
            cell[key.replace("_tokens_per_s", "_vs_float32_plain")] = round(cell[key] / reference, 3)

    candidates = [Form(dtype, weights, threads) for dtype, weights in FORMS]
    with tempfile.TemporaryDirectory() as folder:
        choice = choose_form(loaded.model, tokenizer, candidates, config, Path(folder))
    expected = {str(form): {"one_stream": round(s.one_stream, 1), "batch": round(s.batch, 1)} for form, s in choice.speeds.items()}
    report["chosen"] = {"form": str(choice.form), "expected_tokens_per_s": expected}
    print(f"chosen: {report['chosen']}", flush=True)
    return report


def markdown(report: dict) -> str:
    batch = report["batch"]
    lines = [
        f"| instruction set | form | 1 stream plain | 1 stream adaptive | {batch} plain | {batch} adaptive | exact | chosen |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for isa, result in report["isas"].items():
        if "skipped" in result:
            lines.append(f"| {isa} | skipped: {result['skipped']} | | | | | | |")
            continue
        for form, cell in result["forms"].items():
            lines.append(
                f"| {isa} | {form} | {cell['one_stream_plain_tokens_per_s']} ({cell['one_stream_plain_vs_float32_plain']:.2f}x) "
                f"| {cell['one_stream_adaptive_tokens_per_s']} ({cell['one_stream_adaptive_vs_float32_plain']:.2f}x) "
                f"| {cell['batch_plain_tokens_per_s']} ({cell['batch_plain_vs_float32_plain']:.2f}x) "
                f"| {cell['batch_adaptive_tokens_per_s']} ({cell['batch_adaptive_vs_float32_plain']:.2f}x) "
                f"| {'yes' if cell['speculative_equals_plain'] else 'NO'} | {'**yes**' if form == result['chosen']['form'] else ''} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isas", nargs="+", choices=list(ISAS), default=list(ISAS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/forms"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one instruction set, in this process
    args = parser.parse_args(argv)
    if args.worker:
        print("REPORT " + json.dumps(worker(args)), flush=True)
        return

    from verifier_service.core.model_loading import cpu_flags  # torch loads here; each worker sets its own variables first

    flags = cpu_flags()
    report: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "amx": "amx_tile" in flags, "avx512_bf16": "avx512_bf16" in flags},
        "max_new_tokens": args.max_new_tokens,
        "batch": args.batch,
        "isas": {},
    }
    for isa in args.isas:
        missing = NEEDS[isa] - flags
        if missing:
            report["isas"][isa] = {"skipped": f"the CPU lacks {', '.join(sorted(missing))}"}
            continue
        if isa == "avx512_core_bf16" and "amx_tile" not in flags:
            report["isas"][isa] = {"skipped": "the CPU has no AMX: native is this set"}
            continue
        command = [sys.executable, "-m", "bench.bench_forms", "--worker", "--max-new-tokens", str(args.max_new_tokens)]
        command += ["--batch", str(args.batch)]
        env = {**os.environ, **ISAS[isa]}
        print(f"== {isa} {ISAS[isa] or '(as the CPU is)'}", flush=True)
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        sys.stderr.write(done.stderr[-2000:] if done.returncode else "")
        lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
        if done.returncode or not lines:
            raise SystemExit(f"{isa}: the worker failed (exit {done.returncode})")
        report["isas"][isa] = {"variables": ISAS[isa], **json.loads(lines[-1].removeprefix("REPORT "))}
        print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("REPORT ")), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forms.json").write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
