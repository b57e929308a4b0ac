"""Load benchmark: both services under steady and excess load for a fixed time; latency, errors, memory.

    python -m bench.bench_load [--seconds 60] [--clients 16] [--overload-clients 96] [--max-new-tokens 32] [--out bench/results]

Starts the drafter and the verifier (the default model) as real processes,
warms the verifier up, then runs three phases of ``--seconds`` each:

* ``steady``: ``--clients`` threads each send greedy ``Generate`` requests
  (adaptive K, the grounded and open-ended service prompts in turn) back to
  back: the batch is full and nobody waits for a slot long;
* ``overload``: ``--overload-clients`` threads, more than the verifier's
  batch plus queue (16 + 64): the excess must be refused with
  RESOURCE_EXHAUSTED at once, and everything admitted must complete;
* ``propose``: ``--clients`` threads call the drafter directly: a session
  opened on 600 tokens of its own with a draft of 8, one more token and
  draft, then closed (one timed call each);
* ``observe``: ``--clients`` threads each ``Observe`` a finished 600-token
  sequence under a new ``observe_id`` (acknowledged once stored: the table grows).

Per phase: calls completed, their p50/p99 latency, errors by status (any
status but RESOURCE_EXHAUSTED is an error), and both processes' memory
before and after: anonymous (heap; must not grow with the work done) and
file-backed (the drafter's mapped table, which grows as it learns).
Writes ``load.json`` under ``--out`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from bench.bench_service import percentile
from bench.workloads import service_prompts
from specdec.processes import ServiceProcess
from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc
from specdec.vocabulary import tokenizer_fingerprint
from verifier_service.model_loading import DEFAULT_MODEL, resolve_model_path

REQUEST_TIMEOUT_S = 600
REFUSED = grpc.StatusCode.RESOURCE_EXHAUSTED  # the queue is full: allowed, and counted apart


def memory_mb(pid: int) -> dict[str, int]:
    """Resident memory: anonymous (heap, tensors) and file-backed (mapped files: the model, the LMDB table)."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                fields[name[3:].lower()] = round(int(value.split()[0]) / 1024)
    return fields


class Phase:
    """``clients`` threads each calling ``work(client, n)`` until ``seconds`` pass; latencies and outcomes."""

    def __init__(self, name: str, clients: int, seconds: float, work) -> None:
        self.name, self.clients, self.seconds, self.work = name, clients, seconds, work
        self.latencies_s: list[float] = []
        self.outcomes: Counter = Counter()
        self._lock = threading.Lock()

    def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        threads = [threading.Thread(target=self._client, args=(client, deadline)) for client in range(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _client(self, client: int, deadline: float) -> None:
        for n in itertools.count():
            if time.monotonic() >= deadline:
                return
            started = time.perf_counter()
            try:
                self.work(client, n)
                outcome = "OK"
            except grpc.RpcError as error:
                outcome = error.code().name
                if error.code() == REFUSED:
                    time.sleep(0.05)  # a refused client backs off, as the message tells it to
            seconds = time.perf_counter() - started
            with self._lock:
                self.outcomes[outcome] += 1
                if outcome == "OK":
                    self.latencies_s.append(seconds)

    def summary(self) -> dict:
        ms = [1000 * s for s in self.latencies_s]
        errors = {name: count for name, count in self.outcomes.items() if name not in ("OK", REFUSED.name)}
        return {
            "phase": self.name,
            "clients": self.clients,
            "seconds": self.seconds,
            "completed": self.outcomes["OK"],
            "refused": self.outcomes[REFUSED.name],
            "errors": errors,
            "p50_ms": round(percentile(ms, 0.5), 1) if ms else None,
            "p99_ms": round(percentile(ms, 0.99), 1) if ms else None,
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--overload-clients", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    prompts = service_prompts("grounded") + service_prompts("open_ended")
    with tempfile.TemporaryDirectory(prefix="bench-load-") as scratch:
        drafter = ServiceProcess(
            "drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(Path(scratch) / "db"), inherit_stderr=True
        )
        verifier = None
        try:
            drafter.wait_until_serving()
            verifier = ServiceProcess(
                "verifier_service",
                *("--port", "0", "--metrics-port", "-1", "--http-port", "-1", "--drafter", drafter.address),
                inherit_stderr=True,
            )
            verifier.wait_until_serving()
            verifier_channel = grpc.insecure_channel(verifier.address)
            drafter_channel = grpc.insecure_channel(drafter.address)
            verifier_stub, drafter_stub = rpc.VerifierStub(verifier_channel), drafter_pb2_grpc.DrafterStub(drafter_channel)

            def generate(client: int, n: int) -> None:
                prompt = prompts[(client + n * 7) % len(prompts)]
                verifier_stub.Generate(
                    pb.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=args.max_new_tokens), timeout=REQUEST_TIMEOUT_S
                )

            # The default model's tokenizer names the drafter's table, as the verifier's does.
            vocabulary = tokenizer_fingerprint(AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL)))
            rng = random.Random(0)
            contexts = [[rng.randrange(49_000) for _ in range(300)] * 2 for _ in range(64)]

            def propose(client: int, n: int) -> None:
                session, tokens = f"load-{client}-{n // 3}", contexts[(client + n // 3) % len(contexts)]
                if n % 3 == 2:
                    drafter_stub.CloseSessions(drafter_pb2.CloseSessionsRequest(vocabulary=vocabulary, session_ids=[session]), timeout=10)
                    return
                update = drafter_pb2.SequenceUpdate(
                    session_id=session, new_tokens=tokens if n % 3 == 0 else [tokens[0]], open=n % 3 == 0, num_draft_tokens=8
                )
                drafter_stub.Propose(drafter_pb2.ProposeRequest(vocabulary=vocabulary, sequences=[update]), timeout=10)

            def observe(client: int, n: int) -> None:
                drafter_stub.Observe(
                    drafter_pb2.ObserveRequest(
                        vocabulary=vocabulary,
                        observe_id=f"load-{client}-{n}",
                        sequences=[drafter_pb2.TokenSequence(tokens=contexts[(client + n) % len(contexts)][:600])],
                    ),
                    timeout=30,
                )

            generate(0, 0)  # warm-up
            phases = [
                Phase("steady", args.clients, args.seconds, generate),
                Phase("overload", args.overload_clients, args.seconds, generate),
                Phase("propose", args.clients, args.seconds, propose),
                Phase("observe", args.clients, args.seconds, observe),
            ]
            results = []
            for phase in phases:
                before = {"verifier": memory_mb(verifier.process.pid), "drafter": memory_mb(drafter.process.pid)}
                phase.run()
                after = {"verifier": memory_mb(verifier.process.pid), "drafter": memory_mb(drafter.process.pid)}
                summary = phase.summary() | {"memory_mb_before": before, "memory_mb_after": after}
                results.append(summary)
                print(json.dumps(summary), flush=True)
            verifier_channel.close()
            drafter_channel.close()
        finally:
            if verifier is not None:
                verifier.stop()
            drafter.stop()

    report = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "settings": vars(args) | {"out": str(args.out)},
        "phases": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps(report, indent=2) + "\n")
    print("| phase | clients | completed | refused | errors | p50 ms | p99 ms | verifier heap MB | drafter heap MB | drafter mapped MB |")
    print("|---|---:|---:|---:|---|---:|---:|---|---|---|")
    for r in results:
        before, after = r["memory_mb_before"], r["memory_mb_after"]
        print(
            f"| {r['phase']} | {r['clients']} | {r['completed']} | {r['refused']} | {r['errors'] or 0} | {r['p50_ms']:.0f} "
            f"| {r['p99_ms']:.0f} | {before['verifier']['anon']} → {after['verifier']['anon']} "
            f"| {before['drafter']['anon']} → {after['drafter']['anon']} | {before['drafter']['file']} → {after['drafter']['file']} |"
        )


if __name__ == "__main__":
    main()
