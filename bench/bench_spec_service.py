"""Spec-Bench through both services, cold and warm: what a deployed pair gives once its
drafter has learned from other traffic, and whether that survives ``kill -9``.

    python -m bench.bench_spec_service ../shared/spec_bench/question.jsonl [--per-group 4]
        [--teach-per-group 6] [--max-new-tokens 96] [--out bench/results]

The drafter and the verifier run as real processes on loopback ports, and
every request goes through the verifier's ``Generate`` (greedy, the chat
template applied), timed whole by the client (prefill included, as
Spec-Bench times them). The measured prompts are ``bench.spec_bench``'s
(``--per-group`` per group, as ``bench_spec``); the teaching prompts are
``--teach-per-group`` other questions of each group, never a measured one.

1. **Teach.** A drafter on an empty table and a verifier with the defaults
   serve the teaching prompts: the drafter learns their n-grams and the
   target's predictions (the successor table), as it would from a deployed
   service's traffic. Then the verifier stops and the drafter is killed with
   SIGKILL; its table, as the crash left it, is the warm state.
2. **Measure**, three phases, each with a fresh verifier (its planner
   unlearned) and a drafter restarted on its own copy of a table:
   ``cold`` (an empty table, the defaults), ``warm-chain`` (the warm table,
   ``--max-adaptive-nodes 0``: the adaptive chains that were the default
   before draft trees) and ``warm`` (the warm table, the defaults). Each
   measured prompt runs speculative, then plain (K=0, which never touches the
   drafter), back to back so the machine's drift hits both alike. A phase's
   drafter keeps learning from the measured prompts it has served, as a
   service does; each prompt runs once, so none is drafted from its own answer.

Per phase and group: speculative over plain tokens/s (all of the group's
tokens over all its seconds), tokens per forward pass (the prefill pass
included, as the service counts), and the geometric mean over groups. The
warm table's record counts (n-grams, successor-table keys) are read from
its files after the kill. Every speculative output is checked against
plain's. Writes ``spec_bench_service.json`` under ``--out`` and prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import lmdb

from bench.spec_bench import geometric_mean, load_groups, other_prompts
from specdec.processes import ServiceProcess, free_port
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

REQUEST_TIMEOUT_S = 600
# (phase, table: "empty" or "warm", extra verifier flags)
PHASES = (("cold", "empty", ()), ("warm-chain", "warm", ("--max-adaptive-nodes", "0")), ("warm", "warm", ()))


class Pair:
    """A drafter on ``db`` (always on the same port) and a verifier using it."""

    def __init__(self, db: Path, port: int, verifier_flags: tuple[str, ...] = ()) -> None:
        self.drafter = ServiceProcess("drafter_service", "--port", str(port), "--metrics-port", "-1", "--db", str(db), inherit_stderr=True)
        self.verifier: ServiceProcess | None = None
        try:
            self.drafter.wait_until_serving()
            self.verifier = ServiceProcess(
                "verifier_service",
                *("--port", "0", "--metrics-port", "-1", "--http-port", "-1", "--drafter", f"127.0.0.1:{port}", *verifier_flags),
                inherit_stderr=True,
            )
            self.verifier.wait_until_serving()
            self.stub = rpc.VerifierStub(self.verifier.channel)
        except BaseException:
            self.stop()
            raise

    def generate(self, prompt: str, max_new_tokens: int, k: int | None) -> tuple[list[int], pb.GenerationStats, float]:
        request = pb.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=max_new_tokens)
        if k is not None:
            request.num_speculative_tokens = k
        started = time.perf_counter()
        response = self.stub.Generate(request, timeout=REQUEST_TIMEOUT_S)
        return list(response.token_ids), response.stats, time.perf_counter() - started

    def crash_drafter(self) -> None:
        """The verifier stops (its sessions closed); then the drafter dies by SIGKILL."""
        if self.verifier is not None:
            self.verifier.stop()
        time.sleep(1.0)  # what the drafter's writer had queued gets its chance, as in a crash between requests
        self.drafter.kill()

    def stop(self) -> None:
        if self.verifier is not None:  # the verifier first: it holds drafter sessions
            self.verifier.stop()
        self.drafter.stop()


def table_records(db: Path) -> dict[str, int]:
    """Entries per sub-database of the (one) table under a drafter's ``--db`` (read only)."""
    counts: dict[str, int] = {}
    for folder in sorted(path for path in db.iterdir() if path.is_dir()):
        env = lmdb.open(str(folder), readonly=True, lock=False, max_dbs=8, subdir=True)
        try:
            for name in ("ngrams", "successors"):
                with env.begin() as txn:
                    handle = env.open_db(name.encode(), txn=txn, create=False)
                    counts[name] = counts.get(name, 0) + txn.stat(handle)["entries"]
        finally:
            env.close()
    return counts


def teach(db: Path, port: int, prompts: dict[str, list[str]], max_new_tokens: int) -> dict:
    pair = Pair(db, port)
    started = time.perf_counter()
    try:
        for group, group_prompts in prompts.items():
            for prompt in group_prompts:
                pair.generate(prompt, max_new_tokens, None)
            print(f"taught {group}: {len(group_prompts)} prompts", file=sys.stderr, flush=True)
        pair.crash_drafter()
    finally:
        pair.stop()
    return {"requests": sum(map(len, prompts.values())), "seconds": round(time.perf_counter() - started, 1), **table_records(db)}


def measure(db: Path, port: int, flags: tuple[str, ...], groups: dict[str, list[str]], max_new_tokens: int) -> dict:
    pair = Pair(db, port, flags)
    report = {}
    try:
        pair.generate("Say hello.", 8, None)  # the verifier's first request pays for lazy set-up; untimed
        for group, prompts in groups.items():
            spec = {"tokens": 0, "seconds": 0.0, "passes": 0}
            plain = {"tokens": 0, "seconds": 0.0}
            mismatches = 0
            for prompt in prompts:
                spec_tokens, stats, spec_s = pair.generate(prompt, max_new_tokens, None)
                plain_tokens, _, plain_s = pair.generate(prompt, max_new_tokens, 0)
                mismatches += spec_tokens != plain_tokens
                spec["tokens"] += len(spec_tokens)
                spec["seconds"] += spec_s
                spec["passes"] += stats.target_forward_passes
                plain["tokens"] += len(plain_tokens)
                plain["seconds"] += plain_s
            report[group] = {
                "prompts": len(prompts),
                "plain_tokens_per_s": round(plain["tokens"] / plain["seconds"], 2),
                "tokens_per_s": round(spec["tokens"] / spec["seconds"], 2),
                "speedup_vs_plain": round((spec["tokens"] / spec["seconds"]) / (plain["tokens"] / plain["seconds"]), 3),
                "tokens_per_pass": round(spec["tokens"] / spec["passes"], 3),
                "mismatches": mismatches,
            }
            row = report[group]
            print(f"  {group}: x{row['speedup_vs_plain']:.2f} plain, {row['tokens_per_pass']:.2f} tokens/pass", file=sys.stderr, flush=True)
    finally:
        pair.stop()
    return report


def markdown(phases: dict) -> str:
    names = list(phases)
    groups = list(next(iter(phases.values())))
    lines = [
        "| group | " + " | ".join(f"{name} ×plain" for name in names) + " | " + " | ".join(f"{name} tokens/pass" for name in names) + " |",
        "|---|" + "---|" * (2 * len(names)),
    ]
    for group in groups:
        cells = [f"{phases[name][group]['speedup_vs_plain']:.2f}" for name in names]
        cells += [f"{phases[name][group]['tokens_per_pass']:.2f}" for name in names]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    means = [geometric_mean([phases[name][group]["speedup_vs_plain"] for group in groups]) for name in names]
    lines.append("| **geometric mean** | " + " | ".join(f"**{mean:.2f}**" for mean in means) + " |" + " |" * len(names))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("questions", type=Path, help="Spec-Bench's question.jsonl")
    parser.add_argument("--per-group", type=int, default=4, help="measured prompts per group")
    parser.add_argument("--teach-per-group", type=int, default=6, help="other prompts per group the warm drafter learns from")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--phases", nargs="+", choices=[name for name, _, _ in PHASES], default=[name for name, _, _ in PHASES])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if min(args.per_group, args.max_new_tokens) < 1 or args.teach_per_group < 0:
        parser.error("--per-group and --max-new-tokens must be >= 1, --teach-per-group >= 0")
    groups = load_groups(args.questions, args.per_group)
    lessons = other_prompts(args.questions, args.per_group, args.teach_per_group)
    # SIGTERM to the benchmark unwinds through the finally blocks, which stop both services.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    port = free_port()
    result: dict = {
        "meta": {
            "questions": args.questions.name,
            "per_group": args.per_group,
            "teach_per_group": args.teach_per_group,
            "max_new_tokens": args.max_new_tokens,
            "machine": platform.platform(),
        }
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        warm = root / "taught"  # never a phase's name: each phase's copy is a folder of its own
        result["teach"] = teach(warm, port, lessons, args.max_new_tokens)
        print(f"warm table after SIGKILL: {result['teach']}", file=sys.stderr, flush=True)
        result["phases"] = {}
        args.out.mkdir(parents=True, exist_ok=True)
        for name, table, flags in PHASES:
            if name not in args.phases:
                continue
            db = root / f"phase-{name}"
            if table == "warm":
                shutil.copytree(warm, db)
            print(f"{name}:", file=sys.stderr, flush=True)
            result["phases"][name] = measure(db, port, flags, groups, args.max_new_tokens)
            (args.out / "spec_bench_service.json").write_text(json.dumps(result, indent=2) + "\n")  # each phase kept as it ends
    print(markdown(result["phases"]))


if __name__ == "__main__":
    main()
