"""Drafter replicas and the observation log: what the log costs Observe and Propose, how fast a replica applies it, its lag.

    python -m bench.bench_replication [--seconds 3] [--rounds 2] [--propose-steps 400] [--lag-seconds 8]
        [--sim-seconds 30] [--sim-step-ms 50] [--out bench/results/replication]

Everything on loopback, in one run: a nats-server with JetStream (fsync before
every acknowledgement, as ``specdec serve --drafter-replicas`` runs it), drafters
as processes of their own, the clients in this one. Drafter A writes its tables
directly (no log), B and C follow one log (``--log-url``):

* ``propose``: bench_drafter's Propose workload (4 verifiers taking turns, 32
  sessions each, K=8, ``--propose-steps`` timed calls a round) against A and B,
  both taught the same text first (B through its log), rounds alternating: round
  trip p50/p99, and whether every draft B made was A's;
* ``observe``: ``CLIENTS`` clients each Observe a finished sequence
  (``SEQUENCE_TOKENS`` tokens of the text) after another for ``--seconds``
  against A, then B, ``--rounds`` times: latency p50/p99 and tokens acknowledged
  per second (A's is today's direct-write rate);
* ``apply``: replica C starts on empty tables and applies B's whole log: messages
  and tokens per second over the observe phase's messages, against A's rate;
* ``lag``: ``CLIENTS`` clients Observe into B for ``--lag-seconds`` while C
  follows. Every ``SAMPLE_S``: the log's last sequence (read from NATS) and C's
  position (its /metrics); lag in messages, and in seconds: how long the oldest
  message C had not applied had been in the log (to within ``SAMPLE_S``). C's own
  lag gauges are kept beside;
* ``simulation``: a log of its own and ``SIM_REPLICAS`` fresh replicas;
  ``SIM_VERIFIERS`` verifiers, each on one replica (3, 3, 2), each a batch of
  ``SIM_BATCH`` sequences: a Propose every ``--sim-step-ms`` with each sequence's
  1-3 new tokens and the target's top-``SIM_TOP_K`` predictions at them; a
  finished sequence is closed and observed from a thread of the verifier's own
  (as a verifier does) and a new one opened in its place. Propose and Observe
  p50/p99, each replica's lag as above, and whether the replicas hold the same
  tables once the traffic has stopped.

Token streams are bench_drafter's (the standard library's source, one id per
distinct word). Writes ``replication.json`` under ``--out`` and prints the
ratios as a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import os
import platform
import queue
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import nats

from bench.bench_drafter import VOCABULARY, corpus_tokens, time_steps, verifier_streams, warm_requests
from bench.bench_service import percentile
from drafter_service.writer import CHUNK_TOKENS
from specdec.processes import LocalNatsServer, ServiceProcess
from specdec.v1 import drafter_pb2 as pb
from specdec.v1 import drafter_pb2_grpc as rpc

CLIENTS = 16  # verifiers observing into one drafter at once
# The paced load's share of what a drafter without a log takes at most: a load both sustain.
PACED_SHARE = 0.5
REFUSED_BACKOFF_S = 0.05  # a held-back Observe is retried after this long, as a verifier's queue does
# A finished sequence as a verifier observes it: a 256-token prompt and its 128-token answer.
SEQUENCE_TOKENS = 384
SAMPLE_S = 0.05  # between lag samples: the resolution of lag in seconds
CALL_TIMEOUT_S = 30.0  # guards against a hang; not a measure
CATCH_UP_TIMEOUT_S = 600.0
SETTLED_S = 1.5  # the log's end unchanged this long after traffic: every replica's successor messages are in
# The simulation's log: a stream of its own needs subjects of its own (JetStream refuses overlaps).
LOGS = {"main": ("SPECDEC_DRAFTER", "specdec.drafter"), "simulation": ("SPECDEC_SIM", "specdec.sim")}
SIM_VERIFIERS, SIM_REPLICAS, SIM_BATCH = 8, 3, 16
SIM_K = 8
SIM_TOP_K = 8  # the verifier's --successor-top-k
SIM_PROMPT_TOKENS = 256
SIM_OUTPUT_TOKENS = (64, 192)  # a sequence's answer length, spread over this range by its slot
CORPUS_TOKENS = 400_000
TEACH_TOKENS = CHUNK_TOKENS  # a taught sequence: what the writer commits whole
# Every drafter's: CLIENTS writes at once (the default, a quarter of 32 threads, refuses half
# of them with RESOURCE_EXHAUSTED), the same with and without the log.
DRAFTER_FLAGS = ("--max-write-calls", str(CLIENTS))
POSITION = "specdec_drafter_log_position"
REPORTED_LAG = ("specdec_drafter_log_lag_messages", "specdec_drafter_log_lag_seconds")


# -- processes ------------------------------------------------------------


class Drafter:
    """A drafter process (its log on stderr goes to a file), a stub and its /metrics port."""

    def __init__(self, db: Path, *flags: str, wait: bool = True) -> None:
        self.process = ServiceProcess("drafter_service", "--port", "0", "--metrics-port", "0", "--db", str(db), *DRAFTER_FLAGS, *flags)
        try:
            self.metrics_port = self.process.announced_port("metrics")
            if wait:  # with a log: connected, and within --log-max-serving-lag of its end
                self.process.wait_until_serving("", CATCH_UP_TIMEOUT_S)
        except BaseException:
            self.process.stop()
            raise
        self.stub = rpc.DrafterStub(self.process.channel)

    def metrics(self, *names: str) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=CALL_TIMEOUT_S).read().decode()
        values = dict(re.findall(r"^(specdec_drafter_\w+) (\S+)$", text, re.MULTILINE))  # the unlabelled series
        return {name: float(values[name]) for name in names}

    def position(self) -> int:
        return int(self.metrics(POSITION)[POSITION])

    def tables(self) -> tuple[int, int]:
        """(n-grams, successor keys) over every table."""
        stats = self.stub.Stats(pb.StatsRequest(), timeout=CALL_TIMEOUT_S)
        return stats.entries, stats.successor_entries

    def stop(self) -> None:
        self.process.stop()


def log_flags(url: str, log: str = "main") -> tuple[str, ...]:
    stream, subjects = LOGS[log]
    return ("--log-url", url, "--log-stream", stream, "--log-subject-prefix", subjects)


class LogEnd:
    """The stream's last sequence, read over a NATS connection of the benchmark's own."""

    def __init__(self, url: str, stream: str) -> None:
        self.stream = stream
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="log-end", daemon=True)
        self._thread.start()
        self._nc = self._run(nats.connect(url))
        self._js = self._nc.jetstream()

    def _run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(CALL_TIMEOUT_S)

    def last(self) -> int:
        return self._run(self._js.stream_info(self.stream)).state.last_seq

    def close(self) -> None:
        self._run(self._nc.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


# -- lag --------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    end: int  # the log's last sequence
    positions: tuple[int, ...]  # each watched replica's
    reported: tuple[tuple[float, float], ...]  # each one's own (lag messages, lag seconds)


def lag_seconds(samples: list[Sample], replica: int) -> list[float]:
    """Per sample, how long the oldest message ``replica`` had not applied had been in the log:
    the time since the first sample whose log end held it (0 when caught up). Ends 5, 9, 12 at
    0.0, 0.1, 0.2 s and positions 5, 6, 12 -> [0.0, 0.0, 0.0]; positions 5, 5, 7 -> [0.0, 0.0, 0.1]."""
    ends = [sample.end for sample in samples]
    lags = []
    for sample in samples:
        position = sample.positions[replica]
        if position >= sample.end:
            lags.append(0.0)
            continue
        first = bisect.bisect_right(ends, position)  # the first sample whose end held position + 1
        lags.append(sample.at - samples[first].at)
    return lags


def summary(values: list[float], digits: int = 3) -> dict[str, float | None]:
    """p50, p99 and max (None without values)."""
    quantiles = {"p50": 0.5, "p99": 0.99, "max": 1.0}
    return {name: round(percentile(values, q), digits) if values else None for name, q in quantiles.items()}


def lag_report(samples: list[Sample], replica: int) -> dict:
    """Lag in messages and seconds from the samples, and what the replica reported of itself."""
    return {
        "messages": summary([sample.end - sample.positions[replica] for sample in samples], 1),
        "seconds": summary(lag_seconds(samples, replica)),
        "reported_messages": summary([sample.reported[replica][0] for sample in samples], 1),
        "reported_seconds": summary([sample.reported[replica][1] for sample in samples]),
        "samples": len(samples),
    }


class Sampler:
    """Samples the log's end and ``replicas``' positions every SAMPLE_S, in a thread, until stopped."""

    def __init__(self, end: LogEnd, replicas: list[Drafter]) -> None:
        self.end, self.replicas = end, replicas
        self.samples: list[Sample] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lag-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(SAMPLE_S):
            at, end = time.monotonic(), self.end.last()
            read = [replica.metrics(POSITION, *REPORTED_LAG) for replica in self.replicas]
            positions = tuple(int(metrics[POSITION]) for metrics in read)
            reported = tuple((metrics[REPORTED_LAG[0]], metrics[REPORTED_LAG[1]]) for metrics in read)
            self.samples.append(Sample(at, end, positions, reported))


def wait_until_applied(replicas: list[Drafter], end: LogEnd, settle_s: float = 0.0) -> int:
    """Block until every replica has applied the whole log, whose end stayed put ``settle_s``; that end."""
    deadline, last, since = time.monotonic() + CATCH_UP_TIMEOUT_S, -1, time.monotonic()
    while time.monotonic() < deadline:
        now = end.last()
        if now != last:
            last, since = now, time.monotonic()
        if time.monotonic() - since >= settle_s and all(replica.position() >= now for replica in replicas):
            return now
        time.sleep(SAMPLE_S)
    raise RuntimeError(f"the replicas did not apply the log's {last} messages within {CATCH_UP_TIMEOUT_S:g} s")


# -- the Observe load ---------------------------------------------------------


@dataclass
class ObserveText:
    """Finished sequences from the text, one after another: every drafter sees the same ones, in order."""

    tokens: list[int]
    counter: Iterator[int] = field(default_factory=itertools.count)  # next() is atomic: the clients share it

    def next(self) -> tuple[int, list[int]]:
        number = next(self.counter)
        start = (number * SEQUENCE_TOKENS) % (len(self.tokens) - SEQUENCE_TOKENS)
        return number, self.tokens[start : start + SEQUENCE_TOKENS]


def observe_load(address: str, text: ObserveText, seconds: float, prefix: str, rate_per_s: float | None = None) -> dict:
    """CLIENTS clients, a channel each, each Observing one finished sequence after another for
    ``seconds`` (``rate_per_s``: in all, each client on a fixed schedule; None: each as fast as it
    is answered): every call's latency, the tokens acknowledged per second, and the calls a drafter
    held back (RESOURCE_EXHAUSTED: retried after a back-off with the same id, as a verifier does)."""
    deadline = time.monotonic() + seconds
    interval = None if rate_per_s is None else CLIENTS / rate_per_s

    def client(index: int) -> tuple[list[float], int]:
        latencies, refused = [], 0
        due = time.monotonic() + (0.0 if interval is None else interval * index / CLIENTS)  # spread over one interval
        with grpc.insecure_channel(address) as channel:
            stub = rpc.DrafterStub(channel)
            while time.monotonic() < deadline:
                if interval is not None:
                    time.sleep(max(0.0, due - time.monotonic()))
                    due += interval
                number, tokens = text.next()
                request = pb.ObserveRequest(
                    vocabulary=VOCABULARY, observe_id=f"{prefix}-{number}", sequences=[pb.TokenSequence(tokens=tokens)]
                )
                started = time.perf_counter()
                while True:
                    try:
                        stub.Observe(request, timeout=CALL_TIMEOUT_S)
                        break
                    except grpc.RpcError as error:
                        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                            raise
                        refused += 1
                        time.sleep(REFUSED_BACKOFF_S)
                latencies.append(time.perf_counter() - started)
        return latencies, refused

    started = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(client, range(CLIENTS)))
    elapsed = time.perf_counter() - started
    latencies = [latency for run, _ in results for latency in run]
    return {
        "latencies_s": latencies,
        "calls": len(latencies),
        "refused": sum(refused for _, refused in results),
        "seconds": elapsed,
        "tokens": len(latencies) * SEQUENCE_TOKENS,
    }


def observe_summary(runs: list[dict]) -> dict:
    latencies = [latency for run in runs for latency in run["latencies_s"]]
    tokens, seconds = sum(run["tokens"] for run in runs), sum(run["seconds"] for run in runs)
    return {
        "p50_ms": round(1000 * percentile(latencies, 0.5), 3),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 3),
        "calls": len(latencies),
        "tokens_per_s": round(tokens / seconds),
        "refused": sum(run["refused"] for run in runs),
        "rounds_p50_ms": [round(1000 * percentile(run["latencies_s"], 0.5), 3) for run in runs],
    }


# -- the phases ------------------------------------------------------------


def teach(drafter: Drafter, tokens: list[int]) -> None:
    """bench_drafter's warm text, the same for every drafter, as verifiers observe: one sequence
    a call, each within the writer's chunk (a call the writer splits is merged in parts, a log
    message whole, and the two can keep different continuations)."""
    for warm in warm_requests(tokens, "default"):
        text = warm.sequences[0].tokens
        for start in range(0, len(text), TEACH_TOKENS):
            sequence = pb.TokenSequence(tokens=text[start : start + TEACH_TOKENS])
            drafter.stub.Observe(
                pb.ObserveRequest(vocabulary=VOCABULARY, observe_id=f"{warm.observe_id}-{start}", sequences=[sequence]), timeout=120
            )


def propose_round(drafter: Drafter, tokens: list[int], steps: int, prefix: str) -> tuple[list[float], list[list[list[int]]]]:
    """bench_drafter's Propose workload: each timed call's round trip, and every call's drafts."""
    drafts: list[list[list[int]]] = []

    def call(request: pb.ProposeRequest) -> pb.ProposeResponse:
        response = drafter.stub.Propose(request, timeout=CALL_TIMEOUT_S)
        drafts.append([list(draft.tokens) for draft in response.drafts])
        return response

    times = time_steps(call, verifier_streams(tokens, steps, prefix, "default"))
    return times.wall_s, drafts


def bench_propose(direct: Drafter, logged: Drafter, tokens: list[int], steps: int, rounds: int) -> dict:
    """The same Propose calls against each, rounds alternating (a busy spell hits both)."""
    times: dict[str, list[float]] = {"without_log": [], "with_log": []}
    same = True
    for round_index in range(rounds):
        wall_direct, drafts_direct = propose_round(direct, tokens, steps, f"r{round_index}")
        wall_logged, drafts_logged = propose_round(logged, tokens, steps, f"r{round_index}")
        times["without_log"] += wall_direct
        times["with_log"] += wall_logged
        same = same and drafts_direct == drafts_logged
    report: dict[str, Any] = {
        side: {"p50_ms": round(1000 * percentile(wall, 0.5), 3), "p99_ms": round(1000 * percentile(wall, 0.99), 3), "calls": len(wall)}
        for side, wall in times.items()
    }
    report["p50_ratio"] = round(report["with_log"]["p50_ms"] / report["without_log"]["p50_ms"], 3)
    report["drafts_equal"] = same  # the same tables, one written directly and one through the log
    return report


def bench_observe(
    direct: Drafter, logged: Drafter, tokens: list[int], seconds: float, rounds: int, rate_per_s: float | None = None, name: str = "observe"
) -> dict:
    """Observe against ``direct`` and ``logged`` in turn, ``rounds`` times: as fast as answered
    (what each takes at most), or at ``rate_per_s`` in all (the latency at a load both sustain)."""
    texts = {"without_log": ObserveText(tokens), "with_log": ObserveText(tokens)}
    runs: dict[str, list[dict]] = {"without_log": [], "with_log": []}
    for round_index in range(rounds):
        for side, drafter in (("without_log", direct), ("with_log", logged)):
            runs[side].append(observe_load(drafter.process.address, texts[side], seconds, f"{name}-{round_index}", rate_per_s))
    report: dict[str, Any] = {side: observe_summary(side_runs) for side, side_runs in runs.items()}
    if rate_per_s is not None:
        report["rate_per_s"] = round(rate_per_s, 1)
    report["p50_ratio"] = round(report["with_log"]["p50_ms"] / report["without_log"]["p50_ms"], 3)
    report["p99_ratio"] = round(report["with_log"]["p99_ms"] / report["without_log"]["p99_ms"], 3)
    return report


def bench_apply(replica: Drafter, end: LogEnd, started: float, observed_from: int, direct_tokens_per_s: float) -> dict:
    """``replica``, started on empty tables at ``started``, applies the whole log: its rate over the
    Observe messages (after ``observed_from``, each SEQUENCE_TOKENS tokens) against the direct-write rate."""
    last = end.last()
    trace = [(time.monotonic(), replica.position())]
    while trace[-1][1] < last:
        if time.monotonic() - started > CATCH_UP_TIMEOUT_S:
            raise RuntimeError(f"a fresh replica did not apply {last} log messages within {CATCH_UP_TIMEOUT_S:g} s")
        time.sleep(SAMPLE_S)
        trace.append((time.monotonic(), replica.position()))
    # From the first sample past the warm text to the end, whatever batch boundaries fell between.
    first = next((index for index, (_, position) in enumerate(trace) if position > observed_from), len(trace) - 1)
    (begun, position), (done, _) = trace[first], trace[-1]
    messages, seconds = last - position, done - begun
    report: dict[str, Any] = {"log_messages": last, "measured_messages": messages, "seconds": round(seconds, 3)}
    report["start_to_caught_up_s"] = round(done - started, 3)
    if messages > 0 and seconds > 0:
        report["messages_per_s"] = round(messages / seconds, 1)
        report["tokens_per_s"] = round(messages * SEQUENCE_TOKENS / seconds)
        report["direct_write_tokens_per_s"] = direct_tokens_per_s
        report["ratio"] = round(report["tokens_per_s"] / direct_tokens_per_s, 3)
    return report


def bench_lag(
    logged: Drafter, follower: Drafter, end: LogEnd, tokens: list[int], seconds: float, rate_per_s: float | None, name: str
) -> dict:
    """The follower's lag while CLIENTS clients Observe into ``logged`` (at ``rate_per_s`` in all, or
    as fast as answered: then ``logged``'s own backpressure, --log-max-publish-lag-seconds, bounds it)."""
    with Sampler(end, [follower]) as sampler:
        load = observe_load(logged.process.address, ObserveText(tokens), seconds, name, rate_per_s)
    last = sampler.samples[-1]
    return lag_report(sampler.samples, 0) | {
        "rate_per_s": None if rate_per_s is None else round(rate_per_s, 1),
        "observe_calls": load["calls"],
        "observe_refused": load["refused"],
        "observe_p99_ms": round(1000 * percentile(load["latencies_s"], 0.99), 3),
        "observe_tokens_per_s": round(load["tokens"] / load["seconds"]),
        "behind_at_end_messages": last.end - last.positions[0],
    }


# -- the simulation ---------------------------------------------------------


@dataclass
class Slot:
    """One of a simulated verifier's batch: a session over a stretch of the text."""

    session_id: str
    start: int  # its prompt's first token in the text
    position: int  # the next token to generate
    stop: int  # its answer's end: finished there
    opened: bool = False


class SimulatedVerifier:
    """A verifier's calls to its drafter replica (see the module docstring)."""

    def __init__(self, index: int, address: str, tokens: list[int], step_s: float) -> None:
        self.index, self.tokens, self.step_s = index, tokens, step_s
        self.channel = grpc.insecure_channel(address)
        self.stub = rpc.DrafterStub(self.channel)
        self.sequences = itertools.count()
        self.slots = [self._slot(slot) for slot in range(SIM_BATCH)]
        self.propose_s: list[float] = []
        self.observe_s: list[float] = []
        self.finished: queue.Queue[Slot | None] = queue.Queue()

    def _slot(self, slot: int) -> Slot:
        number = next(self.sequences)
        span = SIM_PROMPT_TOKENS + SIM_OUTPUT_TOKENS[1]
        start = ((self.index * 7919 + number) * span) % (len(self.tokens) - span - SIM_TOP_K - 1) + 1
        low, high = SIM_OUTPUT_TOKENS
        answer = low + (slot * 37 + number * 11) % (high - low)
        return Slot(f"v{self.index}-{number}", start, start + SIM_PROMPT_TOKENS, start + SIM_PROMPT_TOKENS + answer)

    def _update(self, slot: Slot, step: int) -> pb.SequenceUpdate:
        """Its prompt (opening), else its 1-3 new tokens and the target's predictions at them."""
        if not slot.opened:
            slot.opened = True
            prompt = self.tokens[slot.start : slot.position]
            return pb.SequenceUpdate(session_id=slot.session_id, new_tokens=prompt, open=True, num_draft_tokens=SIM_K)
        new = range(slot.position, min(slot.stop, slot.position + 1 + step % 3))
        slot.position = new.stop
        text = self.tokens
        predictions = pb.Predictions(
            k=SIM_TOP_K,
            previous=[text[at - 1] for at in new],
            current=[text[at] for at in new],
            tokens=[token for at in new for token in text[at + 1 : at + 1 + SIM_TOP_K]],
        )
        return pb.SequenceUpdate(
            session_id=slot.session_id, new_tokens=text[new.start : new.stop], num_draft_tokens=SIM_K, predictions=predictions
        )

    def run(self, deadline: float) -> None:
        observer = threading.Thread(target=self._observe_finished, name=f"observer-{self.index}")
        observer.start()
        try:
            next_step = time.monotonic()
            for step in itertools.count():
                if time.monotonic() >= deadline:
                    break
                request = pb.ProposeRequest(vocabulary=VOCABULARY, sequences=[self._update(slot, step) for slot in self.slots])
                started = time.perf_counter()
                self.stub.Propose(request, timeout=CALL_TIMEOUT_S)
                self.propose_s.append(time.perf_counter() - started)
                self._replace_finished()
                next_step += self.step_s
                time.sleep(max(0.0, next_step - time.monotonic()))
        finally:
            self.finished.put(None)
            observer.join()
            self.channel.close()

    def _replace_finished(self) -> None:
        for index, slot in enumerate(self.slots):
            if slot.position >= slot.stop:
                self.finished.put(slot)
                self.slots[index] = self._slot(index)

    def _observe_finished(self) -> None:
        """Off the decoding path, as a verifier does: close each finished session and observe its text."""
        while (slot := self.finished.get()) is not None:
            self.stub.CloseSessions(pb.CloseSessionsRequest(vocabulary=VOCABULARY, session_ids=[slot.session_id]), timeout=CALL_TIMEOUT_S)
            request = pb.ObserveRequest(
                vocabulary=VOCABULARY,
                observe_id=slot.session_id,
                sequences=[pb.TokenSequence(tokens=self.tokens[slot.start : slot.stop])],
            )
            started = time.perf_counter()
            self.stub.Observe(request, timeout=CALL_TIMEOUT_S)
            self.observe_s.append(time.perf_counter() - started)


def bench_simulation(root: Path, url: str, tokens: list[int], seconds: float, step_s: float) -> dict:
    replicas: list[Drafter] = []
    end = LogEnd(url, LOGS["simulation"][0])
    try:
        for index in range(SIM_REPLICAS):
            replicas.append(Drafter(root / f"sim-{index}", *log_flags(url, "simulation")))
        verifiers = [SimulatedVerifier(v, replicas[v % SIM_REPLICAS].process.address, tokens, step_s) for v in range(SIM_VERIFIERS)]
        deadline = time.monotonic() + seconds
        with Sampler(end, replicas) as sampler, ThreadPoolExecutor(SIM_VERIFIERS) as pool:
            for done in [pool.submit(verifier.run, deadline) for verifier in verifiers]:
                done.result()
        last = wait_until_applied(replicas, end, SETTLED_S)
        tables = [replica.tables() for replica in replicas]
        positions = [replica.position() for replica in replicas]
    finally:
        for replica in replicas:
            replica.stop()
        end.close()
    propose = [latency for verifier in verifiers for latency in verifier.propose_s]
    observe = [latency for verifier in verifiers for latency in verifier.observe_s]
    return {
        "verifiers_per_replica": [sum(v % SIM_REPLICAS == r for v in range(SIM_VERIFIERS)) for r in range(SIM_REPLICAS)],
        "propose_ms": summary([1000 * latency for latency in propose]) | {"calls": len(propose)},
        "observe_ms": summary([1000 * latency for latency in observe]) | {"calls": len(observe)},
        "lag": [lag_report(sampler.samples, replica) for replica in range(SIM_REPLICAS)],
        "log_messages": last,
        "positions_after": positions,
        "tables_after": [{"entries": entries, "successor_entries": successors} for entries, successors in tables],
        "converged": len(set(positions)) == 1 and positions[0] == last and len(set(tables)) == 1,
    }


# -- the run ---------------------------------------------------------------


def progress(message: str) -> None:
    print(f"bench_replication: {message}", file=sys.stderr, flush=True)


def machine() -> dict:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), ""
    )
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version()}


def bench_shared_log(args: argparse.Namespace, root: Path, url: str, tokens: list[int]) -> dict:
    """Every phase but the simulation: drafters A (no log), B and C (the log at ``url``)."""
    drafters: list[Drafter] = []
    end = LogEnd(url, LOGS["main"][0])
    try:
        direct, logged = Drafter(root / "a"), Drafter(root / "b", *log_flags(url))
        drafters += [direct, logged]
        teach(direct, tokens)
        teach(logged, tokens)
        taught = wait_until_applied([logged], end)
        progress("Propose with and without the log")
        report: dict[str, Any] = {"propose": bench_propose(direct, logged, tokens, args.propose_steps, args.rounds)}
        progress(f"Observe from {CLIENTS} clients with and without the log, as fast as answered")
        report["observe_saturated"] = bench_observe(direct, logged, tokens, args.seconds, args.rounds, name="saturated")
        wait_until_applied([logged], end)
        # The latency at a load both sustain: half of what the drafter without a log takes at most.
        rate = PACED_SHARE * report["observe_saturated"]["without_log"]["tokens_per_s"] / SEQUENCE_TOKENS
        progress(f"Observe from {CLIENTS} clients with and without the log, {rate:.0f} calls/s in all")
        report["observe"] = bench_observe(direct, logged, tokens, args.seconds, args.rounds, rate, name="paced")
        wait_until_applied([logged], end)
        direct.stop()  # its part is done: its CPU goes to the replicas
        progress("a fresh replica applies the log")
        started = time.monotonic()
        follower = Drafter(root / "c", *log_flags(url), wait=False)  # watched from its start, not from SERVING
        drafters.append(follower)
        direct_rate = report["observe_saturated"]["without_log"]["tokens_per_s"]
        report["apply"] = bench_apply(follower, end, started, taught, direct_rate)
        progress(f"the replica's lag under {CLIENTS} Observe clients, {rate:.0f} calls/s in all")
        report["lag"] = bench_lag(logged, follower, end, tokens, args.lag_seconds, rate, "lag-paced")
        progress(f"the replica's lag under {CLIENTS} Observe clients as fast as answered")
        report["lag_saturated"] = bench_lag(logged, follower, end, tokens, args.lag_seconds, None, "lag-saturated")
        return report
    finally:
        for drafter in drafters:
            drafter.stop()
        end.close()


def run(args: argparse.Namespace, root: Path) -> dict:
    tokens = corpus_tokens(CORPUS_TOKENS)
    log = LocalNatsServer(root / "nats")
    try:
        report = bench_shared_log(args, root, log.url, tokens)
        progress(f"{SIM_VERIFIERS} simulated verifiers on {SIM_REPLICAS} replicas")
        report["simulation"] = bench_simulation(root, log.url, tokens, args.sim_seconds, args.sim_step_ms / 1000)
        return report
    finally:
        log.stop()


def ratios_table(report: dict) -> str:
    """The measures beside their targets, as a Markdown table."""
    propose, observe, apply, lag, sim = (report[key] for key in ("propose", "observe", "apply", "lag", "simulation"))
    saturated, saturated_lag = report["observe_saturated"], report["lag_saturated"]
    sim_lag_s = max(replica["seconds"]["p99"] for replica in sim["lag"])
    sim_lag_messages = max(replica["messages"]["p99"] for replica in sim["lag"])
    rows = [
        (
            f"Observe p50, 16 clients, {observe['rate_per_s']:g} calls/s in all",
            f"{observe['without_log']['p50_ms']} ms",
            f"{observe['with_log']['p50_ms']} ms",
            observe["p50_ratio"],
            "",
        ),
        (
            f"Observe p99, 16 clients, {observe['rate_per_s']:g} calls/s in all",
            f"{observe['without_log']['p99_ms']} ms",
            f"{observe['with_log']['p99_ms']} ms",
            observe["p99_ratio"],
            "<= 20 ms",
        ),
        (
            "Observe, 16 clients as fast as answered: tokens/s acknowledged",
            f"{saturated['without_log']['tokens_per_s']:,}",
            f"{saturated['with_log']['tokens_per_s']:,}",
            round(saturated["with_log"]["tokens_per_s"] / saturated["without_log"]["tokens_per_s"], 3),
            "",
        ),
        (
            "Propose p50, batch of 32",
            f"{propose['without_log']['p50_ms']} ms",
            f"{propose['with_log']['p50_ms']} ms",
            propose["p50_ratio"],
            "<= 1.05",
        ),
        (
            "tokens/s: direct write vs a replica applying the log",
            f"{apply['direct_write_tokens_per_s']:,}" if "ratio" in apply else "-",
            f"{apply['tokens_per_s']:,}" if "ratio" in apply else "-",
            apply.get("ratio", "-"),
            ">= 0.8",
        ),
        (
            f"replica lag under 16 Observe clients, {lag['rate_per_s']:g} calls/s in all, p99",
            "",
            f"{lag['messages']['p99']:g} messages, {lag['seconds']['p99']} s",
            "",
            "< 1 s",
        ),
        (
            "replica lag under 16 Observe clients as fast as answered, p99",
            "",
            f"{saturated_lag['messages']['p99']:g} messages, {saturated_lag['seconds']['p99']} s",
            "",
            "",
        ),
        ("8 verifiers on 3 replicas: Propose p50 / p99", "", f"{sim['propose_ms']['p50']} / {sim['propose_ms']['p99']} ms", "", ""),
        ("8 verifiers on 3 replicas: worst replica's lag p99", "", f"{sim_lag_messages:g} messages, {sim_lag_s} s", "", "< 1 s"),
    ]
    lines = ["| measure | without log | with log | ratio | target |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(str(cell) for cell in row)} |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of Observe load against each drafter a round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the Propose and Observe comparisons, drafters alternating")
    parser.add_argument("--propose-steps", type=int, default=400, help="timed Propose calls against each drafter a round")
    parser.add_argument("--lag-seconds", type=float, default=8.0, help="seconds of Observe load while the follower's lag is sampled")
    parser.add_argument("--sim-seconds", type=float, default=30.0, help="seconds of the 8 simulated verifiers' traffic")
    parser.add_argument("--sim-step-ms", type=float, default=50.0, help="a simulated verifier's step: one Propose this often")
    parser.add_argument("--out", type=Path, default=Path("bench/results/replication"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.seconds, args.lag_seconds, args.sim_seconds, args.sim_step_ms) <= 0 or args.propose_steps < 4:
        parser.error("--rounds must be positive, the durations above 0 and --propose-steps at least 4")
    # SIGTERM (a timeout, a CI job cancelled) unwinds as an exception: every process started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory(prefix="bench-replication-") as folder:
        report = {
            "machine": machine(),
            "settings": vars(args) | {"out": str(args.out), "clients": CLIENTS, "drafter_flags": list(DRAFTER_FLAGS)},
        } | run(args, Path(folder))
    report["table"] = ratios_table(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replication.json").write_text(json.dumps(report, indent=2) + "\n")
    print(report["table"])
    return report


if __name__ == "__main__":
    main()
