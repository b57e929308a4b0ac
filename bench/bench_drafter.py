"""Drafter service benchmark: Propose latency (default scope and learning scopes), Observe throughput, cold start on a big table.

    python -m bench.bench_drafter [--table-gib 1.0] [--repeats 3] [--steps 300] [--layouts default scoped]
        [--propose-only] [--out bench/results]

Measures, against a real server on a loopback port with its LMDB store in a
temporary folder:

* ``Propose`` from ``VERIFIERS`` simulated verifiers taking turns, each a batch
  of 32 sessions (K=8, a few new tokens each, as a verifier sends every step),
  ``--steps`` timed calls in all: server-side time (the servicer called
  directly, on a table warmed with ``WARM_TOKENS``; wall and this thread's CPU
  time) and the gRPC round trip, p50, p95 and p99; for each of ``--layouts``:

  - ``default``: every session in the default scope, no shared scope (what a
    verifier without API keys sends, and all a drafter before scopes knew);
  - ``scoped``: session i of verifier v opened in tenant scope (v + i) mod
    ``TENANTS`` (each batch mixes every tenant, and each tenant is served by
    every verifier), every call reading ``SHARED_SCOPE`` too; each tenant's
    table learned the first half of the warm text and the shared one the
    second half, so a lookup that misses its own table reads the shared one;

* ``Observe`` throughput in tokens/s (64 sequences x 256 tokens per call);
* each of the above ``--repeats`` times (the median run is reported, with all runs);
* the first ``Propose`` after a restart over a table of ``--table-gib``
  (LMDB maps the file; nothing is loaded up front), and the process start.

``--propose-only`` skips Observe and the cold start. Against a checkout
whose drafter predates scopes (its ``SequenceUpdate`` has no ``scope``), the
``scoped`` layout is skipped and says so, so the same file measures both
sides of a change (run it with ``PYTHONPATH`` at the other checkout).

Token streams come from real text (the standard library's source, one id per
distinct word) so contexts and the global table have realistic repeats.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from specdec.processes import ServiceProcess
from specdec.v1 import drafter_pb2 as pb
from specdec.v1 import drafter_pb2_grpc as rpc

VOCABULARY = "0123456789abcdef"
BATCH = 32
K = 8
# Verifiers sharing one drafter, each calling with its own batch in turn: with scopes,
# enough that tenants span verifiers and every batch spans tenants.
VERIFIERS = 4
TENANTS = 3
TENANT_SCOPES = tuple(f"{tenant + 1:032x}" for tenant in range(TENANTS))  # ids as a verifier's keyed hash looks: 32 hex digits
SHARED_SCOPE = "5" * 32
# Session (v, i)'s prompt starts here in the corpus: VERIFIERS x BATCH x this must fit in it with the steps' tokens.
SESSION_STRIDE = 2000
PROMPT_TOKENS = 512
WARM_TOKENS = 200_000  # learned before Propose is timed, in calls within --max-tokens-per-call
WARM_CALL_TOKENS = 100_000
LAYOUTS = ("default", "scoped")
# A drafter before learning scopes has no SequenceUpdate.scope: only the default layout runs there.
SCOPES_SUPPORTED = "scope" in pb.SequenceUpdate.DESCRIPTOR.fields_by_name


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

    def at(share: float) -> float:
        return round(1000 * ordered[int(share * (len(ordered) - 1))], 3)

    return {"p50_ms": round(1000 * statistics.median(ordered), 3), "p95_ms": at(0.95), "p99_ms": at(0.99)}


def session_scopes(layout: str, verifier: int) -> list[str] | None:
    """Each of a verifier's BATCH sessions' scope in ``layout`` (None: the default scope, the field
    left unset). "scoped", verifier 1 -> tenants 1, 2, 0, 1, 2, 0, ... (TENANT_SCOPES' ids)."""
    if layout == "default":
        return None
    return [TENANT_SCOPES[(verifier + i) % TENANTS] for i in range(BATCH)]


def propose_requests(tokens: list[int], steps: int, prefix: str, verifier: int = 0, layout: str = "default") -> Iterator[pb.ProposeRequest]:
    """One verifier's opening request for its BATCH sessions (PROMPT_TOKENS-token prompts, each
    in its scope of ``layout``), then one request per decoding step carrying each session's 1-3
    newly accepted tokens (and, "scoped", the shared scope)."""
    sessions = [f"{prefix}-{verifier}-{i}" for i in range(BATCH)]
    positions = [(verifier * BATCH + i) * SESSION_STRIDE + PROMPT_TOKENS for i in range(BATCH)]
    scopes = session_scopes(layout, verifier)
    shared = {} if scopes is None else {"shared_scope": SHARED_SCOPE}
    opening = [
        pb.SequenceUpdate(session_id=s, new_tokens=tokens[p - PROMPT_TOKENS : p], open=True, num_draft_tokens=K)
        for s, p in zip(sessions, positions)
    ]
    for update, scope in zip(opening, scopes or ()):
        update.scope = scope
    yield pb.ProposeRequest(vocabulary=VOCABULARY, sequences=opening, **shared)
    for step in range(steps):
        new = [tokens[p : p + 1 + step % 3] for p in positions]
        positions = [p + len(n) for p, n in zip(positions, new)]
        yield pb.ProposeRequest(
            vocabulary=VOCABULARY,
            sequences=[pb.SequenceUpdate(session_id=s, new_tokens=n, num_draft_tokens=K) for s, n in zip(sessions, new)],
            **shared,
        )


def verifier_streams(tokens: list[int], steps: int, prefix: str, layout: str) -> list[Iterator[pb.ProposeRequest]]:
    """VERIFIERS request streams, ``steps`` step requests in all after their openings."""
    return [propose_requests(tokens, steps // VERIFIERS, prefix, verifier, layout) for verifier in range(VERIFIERS)]


class StepTimes(NamedTuple):
    wall_s: list[float]  # per step request
    # This thread's CPU per step request: the servicer's own work when it is called in this
    # thread, whatever else the machine runs meanwhile (a shared machine's wall times are not).
    cpu_s: list[float]
    last_response: Any


def time_steps(call: Callable[[pb.ProposeRequest], Any], streams: list[Iterator[pb.ProposeRequest]]) -> StepTimes:
    """Times per step request, the streams taking turns (their opening requests first, untimed)."""
    for stream in streams:
        call(next(stream))
    times = StepTimes([], [], None)
    for request in (request for turn in itertools.zip_longest(*streams) for request in turn if request is not None):
        started, cpu_started = time.perf_counter(), time.thread_time()
        response = call(request)
        times.wall_s.append(time.perf_counter() - started)
        times.cpu_s.append(time.thread_time() - cpu_started)
    return times._replace(last_response=response)


def warm_requests(tokens: list[int], layout: str) -> Iterator[pb.ObserveRequest]:
    """What the tables learn before Propose is timed: WARM_TOKENS of the stream into the default
    scope's table ("default"); or its first half into each tenant's table and its second half
    into the shared scope's ("scoped")."""
    if layout == "default":
        plan = [("", tokens[:WARM_TOKENS])]
    else:
        half = WARM_TOKENS // 2
        plan = [(scope, tokens[:half]) for scope in TENANT_SCOPES] + [(SHARED_SCOPE, tokens[half:WARM_TOKENS])]
    for scope, text in plan:
        for start in range(0, len(text), WARM_CALL_TOKENS):
            request = pb.ObserveRequest(
                vocabulary=VOCABULARY,
                observe_id=f"warm-{scope or 'default'}-{start}",
                sequences=[pb.TokenSequence(tokens=text[start : start + WARM_CALL_TOKENS])],
            )
            if scope:
                request.scope = scope
            yield request


def bench_propose(stub, tokens: list[int], steps: int = 300, layout: str = "default") -> dict:
    """The gRPC round trip of ``steps`` Propose calls on a warmed table."""
    for request in warm_requests(tokens, layout):
        stub.Observe(request, timeout=120)
    times = time_steps(lambda r: stub.Propose(r, timeout=30), verifier_streams(tokens, steps, "bench", layout))
    drafted = sum(len(d.tokens) for d in times.last_response.drafts)
    return {"round_trip": percentiles(times.wall_s), "last_batch_draft_tokens": drafted}


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


def bench_propose_server_side(tokens: list[int], steps: int = 300, layout: str = "default") -> dict:
    """The servicer's own time for the same calls, without gRPC and the network."""
    from drafter_service.server import DrafterConfig, create_server

    with tempfile.TemporaryDirectory() as db:
        server = create_server(DrafterConfig(port=0, db=db, metrics_port=None))
        try:
            servicer = server.servicer
            for request in warm_requests(tokens, layout):
                servicer.Observe(request, LocalContext())
            times = time_steps(lambda r: servicer.Propose(r, LocalContext()), verifier_streams(tokens, steps, "s", layout))
            return percentiles(times.wall_s) | {
                "cpu": percentiles(times.cpu_s),
                "last_batch_draft_tokens": sum(len(d.tokens) for d in times.last_response.drafts),
            }
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


def layout_key(measure: str, layout: str) -> str:
    """Where a layout's measure goes in drafter.json: the default scope's under the plain name."""
    return measure if layout == "default" else f"{measure}_{layout}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=1.0, help="table size for the cold-start measurement")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each latency/throughput measurement (the median is reported)")
    parser.add_argument("--steps", type=int, default=300, help=f"timed Propose calls per run, spread over {VERIFIERS} verifiers")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="scopes of the Propose calls")
    parser.add_argument("--propose-only", action="store_true", help="measure Propose only (no Observe throughput, no cold start)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < VERIFIERS:
        parser.error(f"--repeats must be positive and --steps at least {VERIFIERS}")
    layouts = [layout for layout in LAYOUTS if layout in args.layouts and (layout == "default" or SCOPES_SUPPORTED)]
    tokens = corpus_tokens(400_000)
    assert VERIFIERS * BATCH * SESSION_STRIDE + 3 * args.steps < len(tokens), "the sessions' streams must fit in the corpus"
    report: dict[str, Any] = {"propose_batch": BATCH, "k": K, "verifiers": VERIFIERS, "steps": args.steps, "repeats": args.repeats}
    report["layouts"] = layouts
    if len(layouts) < len(args.layouts):
        report["skipped_layouts"] = "this drafter predates learning scopes (SequenceUpdate has no scope): default scope only"
    # This machine is shared: each measurement runs --repeats times (on fresh
    # tables), the median run is reported and every run is kept.
    server_side: dict[str, list[dict]] = {layout: [] for layout in layouts}
    grpc_round_trip: dict[str, list[dict]] = {layout: [] for layout in layouts}
    observe = []
    for _ in range(args.repeats):
        for layout in layouts:  # the layouts in turn within each repeat, so a busy spell hits both
            server_side[layout].append(bench_propose_server_side(tokens, args.steps, layout))
            with tempfile.TemporaryDirectory() as tmp:
                process, channel, stub = start(Path(tmp) / "db")
                grpc_round_trip[layout].append(bench_propose(stub, tokens, args.steps, layout))
                process.terminate(timeout_s=60)
        if not args.propose_only:
            with tempfile.TemporaryDirectory() as tmp:
                process, channel, stub = start(Path(tmp) / "db")
                observe.append(bench_observe(stub, tokens))
                process.terminate(timeout_s=60)
    for layout in layouts:
        report[layout_key("propose_server_side", layout)] = median_run(server_side[layout], lambda run: run["p50_ms"])
        report[layout_key("propose_grpc", layout)] = median_run(grpc_round_trip[layout], lambda run: run["round_trip"]["p50_ms"])
    if not args.propose_only:
        report["observe"] = median_run(observe, lambda run: run["tokens_per_s"])
        with tempfile.TemporaryDirectory() as tmp:
            report["cold_start"] = bench_cold_start(Path(tmp) / "big", int(args.table_gib * (1 << 30)), tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
