"""Service benchmark: end-to-end greedy throughput and latency of the verifier, speculative vs plain, under concurrency.

    python -m bench.bench_service [--clients 1 4 16] [--max-new-tokens 128] [--requests-per-client 2] [--out bench/results]

Starts the drafter and the verifier as real processes on loopback ports (the
drafter's LMDB table in a temporary folder), waits until both report SERVING
on standard health checking, sends one untimed warm-up request per workload,
then measures, for each workload (``grounded``: code edits and documentation
quotes; ``open_ended``: stories and explanations; ``bench.workloads.service_prompts``),
each client count N and each mode:

* ``plain``: ``num_speculative_tokens=0`` (the target alone, same server);
* ``spec``: ``num_speculative_tokens`` unset (the server picks K per step);

N client threads each send ``--requests-per-client`` greedy ``GenerateStream``
requests (chat template applied) one after another, and we record per request
the latency, the time to the first chunk that carries tokens (client side,
queueing included), the time per output token after it (TPOT) and the
generated tokens. Per cell we report aggregate tokens/s (all tokens over the
cell's wall time), p50/p99 latency, p50 TTFT, p50/p99 TPOT, the verifier's
peak resident memory so far, and per (workload, N) the speedup spec/plain in
tokens/s. Plain runs just before spec for each (workload, N) so machine noise
hits both alike.

Every request in a cell has its own prompt, and the drafter restarts on an
empty table before each (workload, N) pair: the drafter's global table learns
from finished requests, so a repeated prompt would be drafted from its earlier
answer and flatter speculation. What speculation gains here comes from each
request's own context and from n-grams the cell's other requests share.

Writes ``service.json`` under ``--out`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.workloads import service_prompts
from specdec.processes import ServiceProcess, free_port
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

# One request of 64 tokens behind 15 others on CPU takes seconds, not minutes;
# the deadline only keeps a wedged server from hanging the benchmark.
REQUEST_TIMEOUT_S = 600
MODES = ("plain", "spec")


@dataclass(frozen=True)
class RequestResult:
    latency_s: float
    ttft_s: float | None  # None: no chunk carried tokens
    generated_tokens: int
    acceptance_rate: float
    tokens_per_forward_pass: float

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        if self.ttft_s is None or self.generated_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.generated_tokens - 1)


def prompt_sets() -> dict[str, tuple[str, ...]]:
    return {kind: service_prompts(kind) for kind in ("grounded", "open_ended")}


def prompt_for(prompts: tuple[str, ...], client: int, request: int, clients: int) -> str:
    """Client c's r-th request takes prompt (c + r * clients) mod len: distinct
    while the cell has no more requests than prompts, and concurrent clients
    start on different prompts. 5 prompts, 4 clients: client 0 sends prompts 0
    then 4, client 1: 1 then 0."""
    return prompts[(client + request * clients) % len(prompts)]


def percentile(samples: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default).
    [1, 2, 3, 4], q=0.5 -> 2.5; q=0.99 -> 3.97; one sample -> itself."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def summarise_cell(results: list[RequestResult], wall_s: float) -> dict:
    latencies_ms = [1000 * r.latency_s for r in results]
    ttfts_ms = [1000 * r.ttft_s for r in results if r.ttft_s is not None]
    tpots_ms = [1000 * r.tpot_s for r in results if r.tpot_s is not None]
    tokens = sum(r.generated_tokens for r in results)
    return {
        "requests": len(results),
        "generated_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2),
        "p50_ms": round(percentile(latencies_ms, 0.5), 1),
        "p99_ms": round(percentile(latencies_ms, 0.99), 1),
        "ttft_p50_ms": round(percentile(ttfts_ms, 0.5), 1) if ttfts_ms else None,
        "tpot_p50_ms": round(percentile(tpots_ms, 0.5), 1) if tpots_ms else None,
        "tpot_p99_ms": round(percentile(tpots_ms, 0.99), 1) if tpots_ms else None,
        "mean_acceptance_rate": round(sum(r.acceptance_rate for r in results) / len(results), 3),
        "mean_tokens_per_forward_pass": round(sum(r.tokens_per_forward_pass for r in results) / len(results), 3),
    }


def add_speedups(cells: list[dict]) -> None:
    """Set each spec cell's "speedup" to its tokens/s over the plain cell with the same workload and N."""
    plain = {(c["workload"], c["clients"]): c["tokens_per_s"] for c in cells if c["mode"] == "plain"}
    for cell in cells:
        baseline = plain.get((cell["workload"], cell["clients"]))
        if cell["mode"] == "spec" and baseline:
            cell["speedup"] = round(cell["tokens_per_s"] / baseline, 3)


def markdown_table(cells: list[dict]) -> str:
    lines = [
        "| workload | clients | mode | tok/s | p50 ms | p99 ms | TTFT p50 ms | TPOT p50 / p99 ms | peak RSS MB | speedup |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def number(value) -> str:
        return "" if value is None else f"{value:.0f}"

    for c in cells:
        speedup = f"{c['speedup']:.2f}x" if "speedup" in c else ""
        lines.append(
            f"| {c['workload']} | {c['clients']} | {c['mode']} | {c['tokens_per_s']:.1f} | "
            f"{c['p50_ms']:.0f} | {c['p99_ms']:.0f} | {number(c['ttft_p50_ms'])} | "
            f"{number(c.get('tpot_p50_ms'))} / {number(c.get('tpot_p99_ms'))} | {number(c.get('verifier_peak_rss_mb'))} | {speedup} |"
        )
    return "\n".join(lines)


def peak_rss_mb(pid: int) -> float | None:
    """A process's peak resident memory so far (Linux VmHWM), in MB; None where /proc has no such line."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def build_request(prompt: str, max_new_tokens: int, mode: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=max_new_tokens, temperature=0.0)
    if mode == "plain":
        request.num_speculative_tokens = 0  # unset (spec) lets the server choose K
    return request


def timed_stream(stub: rpc.VerifierStub, request: pb.GenerateRequest) -> RequestResult:
    started = time.perf_counter()
    first_token_at = None
    tokens, stats = 0, pb.GenerationStats()
    for chunk in stub.GenerateStream(request, timeout=REQUEST_TIMEOUT_S):
        if chunk.token_ids and first_token_at is None:
            first_token_at = time.perf_counter()
        tokens += len(chunk.token_ids)
        if chunk.HasField("stats"):
            stats = chunk.stats
    finished = time.perf_counter()
    return RequestResult(
        latency_s=finished - started,
        ttft_s=None if first_token_at is None else first_token_at - started,
        generated_tokens=tokens,
        acceptance_rate=stats.acceptance_rate,
        tokens_per_forward_pass=stats.tokens_per_forward_pass,
    )


def run_cell(stub, prompts, clients: int, requests_per_client: int, max_new_tokens: int, mode: str) -> dict:
    """N client threads, started together, each sending its requests back to back."""
    start_together = threading.Barrier(clients)

    def one_client(client: int) -> list[RequestResult]:
        start_together.wait()
        return [
            timed_stream(stub, build_request(prompt_for(prompts, client, r, clients), max_new_tokens, mode))
            for r in range(requests_per_client)
        ]

    with ThreadPoolExecutor(max_workers=clients) as pool:
        started = time.perf_counter()
        per_client = list(pool.map(one_client, range(clients)))  # re-raises a client's RpcError
        wall_s = time.perf_counter() - started
    return summarise_cell([r for results in per_client for r in results], wall_s)


class Drafter:
    """The drafter process on a fixed port, restartable on an empty table."""

    def __init__(self, root: Path) -> None:
        self.root, self.generation = root, 0
        self.process: ServiceProcess | None = None
        self.port = free_port()  # kept across restarts

    def restart_empty(self) -> None:
        self.stop()
        self.generation += 1
        db = self.root / f"db-{self.generation}"
        self.process = ServiceProcess(
            "drafter_service", "--port", str(self.port), "--metrics-port", "-1", "--db", str(db), inherit_stderr=True
        )
        self.process.wait_until_serving()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


def run_benchmark(verifier_target: str, verifier_pid: int, drafter: Drafter, args: argparse.Namespace) -> list[dict]:
    cells = []
    with grpc.insecure_channel(verifier_target) as channel:
        stub = rpc.VerifierStub(channel)
        prompts_by_workload = prompt_sets()
        for prompts in prompts_by_workload.values():
            timed_stream(stub, build_request(prompts[-1], args.max_new_tokens, "spec"))  # warm-up, untimed
        for workload, prompts in prompts_by_workload.items():
            for clients in args.clients:
                drafter.restart_empty()  # nothing learned from earlier cells (plain never drafts)
                for mode in MODES:
                    cell = run_cell(stub, prompts, clients, args.requests_per_client, args.max_new_tokens, mode)
                    cell["verifier_peak_rss_mb"] = peak_rss_mb(verifier_pid)
                    cells.append({"workload": workload, "clients": clients, "mode": mode, **cell})
                    print(f"{workload} N={clients} {mode}: {cell['tokens_per_s']} tok/s", file=sys.stderr, flush=True)
    add_speedups(cells)
    return cells


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-new-tokens", type=int, default=128)  # as bench_core: prefill is not the whole story
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or args.requests_per_client < 1 or args.max_new_tokens < 1:
        parser.error("--clients, --requests-per-client and --max-new-tokens must be >= 1")
    # SIGTERM to the benchmark unwinds through the finally below, which stops both services.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    verifier = None
    with tempfile.TemporaryDirectory() as tmp:
        drafter = Drafter(Path(tmp))
        try:
            drafter.restart_empty()
            verifier = ServiceProcess(
                "verifier_service",
                *("--port", "0", "--metrics-port", "-1", "--http-port", "-1", "--drafter", f"127.0.0.1:{drafter.port}"),
                inherit_stderr=True,
            )
            verifier.wait_until_serving()
            cells = run_benchmark(verifier.address, verifier.process.pid, drafter, args)
        finally:
            if verifier is not None:  # the verifier first: it holds drafter sessions
                verifier.stop()
            drafter.stop()
    report = {
        "config": {
            "clients": args.clients,
            "max_new_tokens": args.max_new_tokens,
            "requests_per_client": args.requests_per_client,
            "greedy": True,
            "chat": True,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "cells": cells,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "service.json").write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(cells))


if __name__ == "__main__":
    main()
