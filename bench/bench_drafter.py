"""Drafter service benchmark: Propose latency, Observe throughput, cold start on a big table.

    python -m bench.bench_drafter [--table-gib 1.0] [--out bench/results]

Measures, against a real server on a loopback port with its LMDB store in a
temporary folder:

* ``Propose`` for a batch of 32 sessions (K=8, a few new tokens each, as the
  verifier sends every step): server-side time (the servicer called
  directly) and the gRPC round trip, p50 and p99;
* ``Observe`` throughput in tokens/s (64 sequences x 256 tokens per call);
* each of the above ``--repeats`` times (the median run is reported, with all runs);
* the first ``Propose`` after a restart over a table of ``--table-gib``
  (LMDB maps the file; nothing is loaded up front), and the process start.

Token streams come from real text (the standard library's source, one id per
distinct word) so contexts and the global table have realistic repeats.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

from specdec.processes import ServiceProcess
from specdec.v1 import drafter_pb2 as pb
from specdec.v1 import drafter_pb2_grpc as rpc

VOCABULARY = "0123456789abcdef"
BATCH = 32
K = 8


def corpus_tokens(limit: int) -> list[int]:
    """Word ids over the standard library's source: real, repetitive text."""
    ids: dict[str, int] = {}
    tokens: list[int] = []
    for path in sorted(Path(json.__file__).parent.parent.glob("*.py")):  # the stdlib root
        for word in re.findall(r"\w+|[^\w\s]", path.read_text(errors="replace")):
            tokens.append(ids.setdefault(word, len(ids)))
            if len(tokens) >= limit:
                return tokens
    return tokens


def start(db: Path, *extra: str):
    process = ServiceProcess("drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(db), *extra, inherit_stderr=True)
    channel = grpc.insecure_channel(process.address)
    grpc.channel_ready_future(channel).result(timeout=60)
    return process, channel, rpc.DrafterStub(channel)


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(1000 * statistics.median(ordered), 3), "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 3)}


def propose_requests(tokens: list[int], steps: int, prefix: str):
    """The opening request for BATCH sessions (512-token prompts), then one
    request per decoding step carrying each session's 1-3 newly accepted tokens."""
    sessions = [f"{prefix}-{i}" for i in range(BATCH)]
    positions = [i * 2000 + 512 for i in range(BATCH)]
    yield pb.ProposeRequest(
        vocabulary=VOCABULARY,
        sequences=[
            pb.SequenceUpdate(session_id=s, new_tokens=tokens[p - 512 : p], open=True, num_draft_tokens=K)
            for s, p in zip(sessions, positions)
        ],
    )
    for step in range(steps):
        new = [tokens[p : p + 1 + step % 3] for p in positions]
        positions = [p + len(n) for p, n in zip(positions, new)]
        yield pb.ProposeRequest(
            vocabulary=VOCABULARY,
            sequences=[pb.SequenceUpdate(session_id=s, new_tokens=n, num_draft_tokens=K) for s, n in zip(sessions, new)],
        )


def time_steps(call, requests) -> tuple[list[float], Any]:
    """Seconds per step request (the opening one untimed) and the last response."""
    call(next(requests))
    times, response = [], None
    for request in requests:
        started = time.perf_counter()
        response = call(request)
        times.append(time.perf_counter() - started)
    return times, response


def bench_propose(stub, tokens: list[int], steps: int = 300) -> dict:
    times, response = time_steps(lambda r: stub.Propose(r, timeout=30), propose_requests(tokens, steps, "bench"))
    drafted = sum(len(d.tokens) for d in response.drafts)
    return {"round_trip": percentiles(times), "last_batch_draft_tokens": drafted}


class LocalContext:
    """What the servicer reads of a gRPC call's context, for calling it directly: a
    loopback caller without certificate or deadline."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def auth_context(self) -> dict:
        return {}

    def time_remaining(self) -> None:
        return None

    def add_callback(self, callback) -> bool:
        return True

    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


def bench_propose_server_side(tokens: list[int], steps: int = 300) -> dict:
    """The servicer's own time for the same batch, without gRPC and the network."""
    from drafter_service.server import DrafterConfig, create_server

    with tempfile.TemporaryDirectory() as db:
        server = create_server(DrafterConfig(port=0, db=db, metrics_port=None))
        try:
            servicer = server.servicer
            for start in range(0, 200_000, 100_000):  # within --max-tokens-per-call
                warm = [pb.TokenSequence(tokens=tokens[start : start + 100_000])]
                servicer.Observe(pb.ObserveRequest(vocabulary=VOCABULARY, observe_id=f"warm-{start}", sequences=warm), LocalContext())
            times, _ = time_steps(lambda r: servicer.Propose(r, LocalContext()), propose_requests(tokens, steps, "s"))
            return percentiles(times)
        finally:
            server.stop(grace=1)


def bench_observe(stub, tokens: list[int], calls: int = 20) -> dict:
    per_call = 64 * 256
    started = time.perf_counter()
    for call in range(calls):
        offset = (call * per_call) % max(1, len(tokens) - per_call)
        chunk = tokens[offset : offset + per_call]
        sequences = [pb.TokenSequence(tokens=chunk[i : i + 256]) for i in range(0, per_call, 256)]
        stub.Observe(pb.ObserveRequest(vocabulary=VOCABULARY, observe_id=str(uuid.uuid4()), sequences=sequences), timeout=120)
    elapsed = time.perf_counter() - started
    return {"tokens_per_s": round(calls * per_call / elapsed), "calls": calls, "tokens_per_call": per_call}


def fill_table(stub, target_bytes: int, vocabulary_size: int = 50_000) -> int:
    """Observe random token sequences until the table's tracked size reaches the target."""
    import random

    rng = random.Random(0)
    while True:
        sequences = [pb.TokenSequence(tokens=[rng.randrange(vocabulary_size) for _ in range(256)]) for _ in range(256)]
        stub.Observe(pb.ObserveRequest(vocabulary=VOCABULARY, observe_id=str(uuid.uuid4()), sequences=sequences), timeout=600)
        stats = stub.Stats(pb.StatsRequest(vocabulary=VOCABULARY), timeout=30)
        if stats.bytes >= target_bytes:
            return stats.file_bytes


def bench_cold_start(db: Path, table_bytes: int, tokens: list[int]) -> dict:
    max_bytes = int(table_bytes * 1.25)
    process, channel, stub = start(db, "--max-bytes", str(max_bytes))
    fill_started = time.perf_counter()
    file_bytes = fill_table(stub, table_bytes)
    fill_seconds = time.perf_counter() - fill_started
    process.terminate(timeout_s=60)
    started = time.perf_counter()
    process, channel, stub = start(db, "--max-bytes", str(max_bytes))
    ready = time.perf_counter() - started
    request = pb.ProposeRequest(
        vocabulary=VOCABULARY, sequences=[pb.SequenceUpdate(session_id="cold", new_tokens=tokens[:64], open=True, num_draft_tokens=K)]
    )
    started = time.perf_counter()
    stub.Propose(request, timeout=30)
    first = time.perf_counter() - started
    process.terminate(timeout_s=60)
    return {
        "table_file_bytes": file_bytes,
        "fill_seconds": round(fill_seconds, 1),
        "restart_to_ready_s": round(ready, 3),
        "first_propose_ms": round(1000 * first, 3),
    }


def median_run(runs: list[dict], measure) -> dict:
    """The run whose measure is the median, with every run's measure beside it."""
    ordered = sorted(runs, key=measure)
    return {**ordered[len(ordered) // 2], "all_runs": [measure(run) for run in runs]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=1.0, help="table size for the cold-start measurement")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each latency/throughput measurement (the median is reported)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    tokens = corpus_tokens(400_000)
    report = {"propose_batch": BATCH, "k": K, "repeats": args.repeats}
    # This machine is shared: each measurement runs --repeats times (on fresh
    # tables), the median run is reported and every run is kept.
    server_side, observe, grpc_round_trip = [], [], []
    for _ in range(args.repeats):
        server_side.append(bench_propose_server_side(tokens))
        with tempfile.TemporaryDirectory() as tmp:
            process, channel, stub = start(Path(tmp) / "db")
            observe.append(bench_observe(stub, tokens))
            grpc_round_trip.append(bench_propose(stub, tokens))
            process.terminate(timeout_s=60)
    report["propose_server_side"] = median_run(server_side, lambda run: run["p50_ms"])
    report["observe"] = median_run(observe, lambda run: run["tokens_per_s"])
    report["propose_grpc"] = median_run(grpc_round_trip, lambda run: run["round_trip"]["p50_ms"])
    with tempfile.TemporaryDirectory() as tmp:
        report["cold_start"] = bench_cold_start(Path(tmp) / "big", int(args.table_gib * (1 << 30)), tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
