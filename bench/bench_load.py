"""Load benchmark: both services under steady, excess and hostile load for a fixed time; latency, errors, memory.

    python -m bench.bench_load [--seconds 60] [--clients 16] [--overload-clients 96] [--max-new-tokens 32]
        [--phases steady overload propose observe hostile] [--hostile-clients 64] [--hostile-mix [N:]KIND,KIND... ...]
        [--hostile-prompts 8] [--honest-keys 2] [--open-drafter] [--model NAME_OR_PATH] [--api-key KEY]
        [--verifier-arg "FLAGS"] [--drafter-arg "FLAGS"] [--out bench/results]

Starts the drafter and the verifier (``--model``, the default model unless
given; its gRPC port and its HTTP API, both on 127.0.0.1) as real processes,
warms the verifier up, then runs the ``--phases`` chosen (all by default, in
this order), ``--seconds`` each. Unless ``--api-key`` is given, the verifier
requires ``--honest-keys`` API keys made for the run (0: none), which its
callers' requests learn and draft in a scope each; and unless
``--open-drafter``, the drafter takes declared scopes only from the
verifier (a ``--client-token`` made for the run, given to the verifier as
its ``--drafter-token``), so a client that reaches it directly learns in a
scope of its own:

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
  sequence under a new ``observe_id`` (acknowledged once stored: the table grows);
* ``hostile``: ``--clients`` honest clients, half greedy ``Generate`` over
  gRPC as in ``steady``, half ``POST /v1/completions`` (``max_tokens``,
  temperature 0; client i sends API key i mod ``--honest-keys``, or
  ``--api-key``), asking ``--hostile-prompts`` of the prompts (0: all; few,
  so that answers recur and what the drafter learned of them counts). Each
  door and key asks each prompt once first (its scope learns the answers), then the
  clients run alone (``baseline``), then beside each ``--hostile-mix`` in
  turn (``bench.hostile``; ``N:`` abusers of its kinds, else
  ``--hostile-clients``; by default the connection abusers together, 64 of
  idle streams, repeated closes, huge and slow bodies, then
  ``TENANT_ABUSERS`` of each tenant abuser alone: prediction flood,
  successor fill, Observe flood, poisoning with n-grams of the honest gRPC
  answers), then alone again (``again``, when a tenant abuser ran: what it
  left in the drafter's tables outlives it), then ``RECOVERY_S`` with
  neither. Per run: the honest requests' tokens per forward pass (their
  response stats: generated tokens over target passes, prefill included),
  latency p50/p95/p99, failures (any status but OK, by status and message);
  the abusers' outcomes by kind and the tokens the drafter took from them;
  and the drafter's Stats before and after (entries, successor keys,
  evictions, scopes). Both processes' memory is read before the baseline,
  at its end, every second under abuse (the peak) and ``RECOVERY_S`` after
  the abusers stopped.

Per phase: calls completed, their p50/p95/p99 latency, errors by status (any
status but RESOURCE_EXHAUSTED is an error), and both processes' memory
before and after: resident (VmRSS), anonymous (heap; must not grow with the
work done) and file-backed (the drafter's mapped table, which grows as it
learns). ``--verifier-arg`` and ``--drafter-arg`` (each split like a shell
line, repeatable) add flags to the services for the whole run: limits and
timeouts under test, ``--api-key``. Writes ``load.json`` under ``--out``
(the hostile run under its "hostile" key) and prints Markdown tables.

A cheap trial on the tiny test model (built as tests/conftest.py does, with
a 64k context and a chat template, saved to a folder):

    python -m bench.bench_load --model /tmp/tiny-chat --verifier-arg=--no-calibrate --phases hostile \\
        --seconds 10 --clients 4 --hostile-clients 8 --max-new-tokens 8 --out /tmp/load
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import platform
import random
import re
import resource
import secrets
import select
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from bench import hostile
from bench.bench_service import percentile
from bench.workloads import service_prompts
from drafter_service.ngram import NGramConfig
from specdec.processes import ServiceProcess
from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc
from specdec.vocabulary import tokenizer_fingerprint
from verifier_service.core.model_loading import DEFAULT_MODEL, resolve_model_path

REQUEST_TIMEOUT_S = 600
REFUSED = grpc.StatusCode.RESOURCE_EXHAUSTED  # the queue is full: allowed, and counted apart
PHASES = ("steady", "overload", "propose", "observe", "hostile")  # the order they run in: hostile last
# An honest request in the hostile run that takes longer than this failed: at 16 clients on
# the default model p99 is ~21 s, so 120 s is several times what a healthy server needs.
HONEST_TIMEOUT_S = 120
RECOVERY_S = 10  # after the abusers stop, before the last memory reading
MEMORY_SAMPLE_S = 1.0
JOIN_SLACK_S = 30  # a phase's clients joined at most this long past their last request's deadline
FAILURE_MESSAGE_CHARS = 160
# A tenant abuser's calls are big (up to --max-predictions-per-call or half of --max-tokens-per-call
# each): a few of them, paced as every abuser is, offer the drafter many times what it can store.
TENANT_ABUSERS = 4
DEFAULT_HOSTILE_MIXES = (hostile.Mix(hostile.DEFAULT_MIX), *(hostile.Mix((kind,), TENANT_ABUSERS) for kind in hostile.TENANT_KINDS))
# A few prompts, so honest answers recur within a run, as a service's popular requests do.
HOSTILE_PROMPTS = 8
HONEST_KEYS = 2
STATS_FIELDS = ("entries", "bytes", "evictions", "successor_entries", "scopes", "observed_tokens")


def memory_mb(pid: int) -> dict[str, int]:
    """Resident memory: in all (VmRSS), anonymous (heap, tensors) and file-backed (mapped files: the model, the LMDB table)."""
    names = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in names:
                fields[names[name]] = round(int(value.split()[0]) / 1024)
    return fields


def memory_of(processes: dict[str, ServiceProcess]) -> dict[str, dict[str, int] | None]:
    """``memory_mb`` of each process; None for one that has exited (a crash under abuse is a result, not a bench error)."""
    readings: dict[str, dict[str, int] | None] = {}
    for name, service in processes.items():
        try:
            readings[name] = memory_mb(service.process.pid) if service.process.poll() is None else None
        except OSError:
            readings[name] = None
    return readings


def cpu_seconds(processes: dict[str, ServiceProcess]) -> dict[str, float]:
    """CPU time (user + system) each service and this benchmark (its clients, abusers included) used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = {}
    for name, service in processes.items():
        try:
            fields = Path(f"/proc/{service.process.pid}/stat").read_text().rpartition(")")[2].split()
            used[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime: fields 14 and 15 of stat(5)
        except OSError:
            used[name] = float("nan")
    own = resource.getrusage(resource.RUSAGE_SELF)
    used["bench"] = own.ru_utime + own.ru_stime
    return used


class HttpFailure(Exception):
    """A non-200 answer from the HTTP API: its status and OpenAI-shaped error message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def describe_failure(error: BaseException) -> tuple[str, str]:
    """(outcome, message) of a failed call: a gRPC status name, ``HTTP <code>``, or the exception's type."""
    if isinstance(error, grpc.RpcError):
        return error.code().name, error.details() or ""
    if isinstance(error, HttpFailure):
        return f"HTTP {error.status}", str(error)
    return type(error).__name__, str(error)


class Phase:
    """``clients`` threads each calling ``work(client, n)`` until ``seconds`` pass; latencies and outcomes,
    per front door when ``door`` (client -> its door's name) is given, and the counts each completed
    call's ``work`` returned, summed per door (``GENERATED``/``PASSES``: tokens per forward pass)."""

    def __init__(
        self,
        name: str,
        clients: int,
        seconds: float,
        work: Callable[[int, int], Mapping[str, int] | None],
        door: Callable[[int], str] | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.name, self.clients, self.seconds, self.work = name, clients, seconds, work
        self.door = door or (lambda client: "all")
        self.request_timeout_s = request_timeout_s
        self.latencies_s: dict[str, list[float]] = {}
        self.counts: dict[str, Counter] = {}  # per door
        self.outcomes: Counter = Counter()
        self.failures: Counter = Counter()  # (door, outcome, message)
        self.stragglers = 0  # clients still in a call when the join gave up
        self._lock = threading.Lock()

    def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        threads = [threading.Thread(target=self._client, args=(client, deadline), daemon=True) for client in range(self.clients)]
        for thread in threads:
            thread.start()
        give_up = deadline + self.request_timeout_s + JOIN_SLACK_S
        for thread in threads:
            thread.join(max(0.0, give_up - time.monotonic()))
        self.stragglers = sum(thread.is_alive() for thread in threads)

    def _client(self, client: int, deadline: float) -> None:
        door = self.door(client)
        for n in itertools.count():
            if time.monotonic() >= deadline:
                return
            started = time.perf_counter()
            counts: Mapping[str, int] | None = None
            try:
                counts = self.work(client, n)
                outcome, message = "OK", ""
            except (grpc.RpcError, HttpFailure, OSError, http.client.HTTPException, ValueError) as error:
                outcome, message = describe_failure(error)
            seconds = time.perf_counter() - started
            with self._lock:
                self.outcomes[outcome] += 1
                if outcome == "OK":
                    self.latencies_s.setdefault(door, []).append(seconds)
                    self.counts.setdefault(door, Counter()).update(counts or {})
                else:
                    self.failures[door, outcome, message[:FAILURE_MESSAGE_CHARS]] += 1
            if outcome in (REFUSED.name, "HTTP 429"):
                time.sleep(0.05)  # a refused client backs off, as the message tells it to
            elif outcome != "OK":
                time.sleep(0.01)  # a failing server is not hammered by a tight loop of failures

    def summary(self) -> dict:
        every = [s for latencies in self.latencies_s.values() for s in latencies]
        errors = {name: count for name, count in self.outcomes.items() if name not in ("OK", REFUSED.name)}
        summary = {
            "phase": self.name,
            "clients": self.clients,
            "seconds": self.seconds,
            "completed": self.outcomes["OK"],
            "refused": self.outcomes[REFUSED.name],
            "errors": errors,
            **latency_ms(every),
            **tokens_per_pass(sum(self.counts.values(), Counter())),
            "failures": [
                {"door": door, "outcome": outcome, "message": message, "count": count}
                for (door, outcome, message), count in self.failures.most_common()
            ],
            "stragglers": self.stragglers,
        }
        if len({self.door(client) for client in range(self.clients)}) > 1:
            summary["by_door"] = {
                door: {
                    "completed": len(self.latencies_s.get(door, [])),
                    **latency_ms(self.latencies_s.get(door, [])),
                    **tokens_per_pass(self.counts.get(door, Counter())),
                }
                for door in sorted({self.door(client) for client in range(self.clients)})
            }
        return summary


def latency_ms(latencies_s: list[float]) -> dict:
    ms = [1000 * s for s in latencies_s]
    return {f"p{share}_ms": round(percentile(ms, share / 100), 1) if ms else None for share in (50, 95, 99)}


GENERATED, PASSES = "generated_tokens", "target_forward_passes"  # a response's stats, as gRPC and HTTP name them


def tokens_per_pass(counts: Mapping[str, int]) -> dict:
    """Generated tokens over target forward passes (prefill included) of the requests counted, as
    each response's own ``tokens_per_forward_pass`` is: {generated 30, passes 12} -> 2.5; nothing without passes."""
    if not counts.get(PASSES):
        return {}
    return {"tokens_per_pass": round(counts[GENERATED] / counts[PASSES], 3), GENERATED: counts[GENERATED], PASSES: counts[PASSES]}


class HonestClients:
    """The hostile run's honest clients: the first half (rounded up) greedy gRPC ``Generate`` with adaptive K
    (as ``steady``), the rest ``POST /v1/completions`` with ``max_tokens`` and temperature 0, each over a
    keep-alive connection of its own; client i sends ``api_keys[i mod len]`` as a bearer token on either
    door (none without keys). Each call returns its response's stats (``GENERATED``, ``PASSES``); the gRPC
    answers are kept per prompt, for the n-grams a poisoner would copy."""

    def __init__(self, stub, http_port: int, prompts, max_new_tokens: int, clients: int, api_keys: Sequence[str], timeout_s: float) -> None:
        self.stub, self.http_port, self.prompts, self.max_new_tokens = stub, http_port, prompts, max_new_tokens
        self.grpc_clients = (clients + 1) // 2
        self.timeout_s = timeout_s
        self.api_keys = tuple(api_keys)
        self.answers: dict[str, tuple[int, ...]] = {}  # prompt -> its greedy answer's token ids (the same every time)
        self._connections: dict[int, http.client.HTTPConnection] = {}

    def door(self, client: int) -> str:
        return "grpc" if client < self.grpc_clients else "http"

    def key(self, client: int) -> str | None:
        return self.api_keys[client % len(self.api_keys)] if self.api_keys else None

    def __call__(self, client: int, n: int) -> dict[str, int]:
        return self.ask(client, self.prompts[(client + n * 7) % len(self.prompts)])

    def ask(self, client: int, prompt: str) -> dict[str, int]:
        """``prompt`` at ``client``'s door with its key: the response's stats' counts."""
        if self.door(client) == "grpc":
            return self.generate(client, prompt)
        return self.complete(client, prompt)["specdec"]

    def generate(self, client: int, prompt: str) -> dict[str, int]:
        """One greedy gRPC ``Generate`` with ``client``'s key: its stats' counts."""
        key = self.key(client)
        request = pb.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=self.max_new_tokens, temperature=0.0)
        response = self.stub.Generate(request, timeout=self.timeout_s, metadata=(("authorization", f"Bearer {key}"),) if key else ())
        self.answers[prompt] = tuple(response.token_ids)
        return {GENERATED: response.stats.generated_tokens, PASSES: response.stats.target_forward_passes}

    def complete(self, client: int, prompt: str) -> dict:
        body = json.dumps({"prompt": prompt, "max_tokens": self.max_new_tokens, "temperature": 0}).encode()
        key = self.key(client)
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        connection = self._connections.get(client)
        if connection is not None and _closed_by_server(connection):
            connection.close()  # an idle keep-alive connection the server timed out: not reused (as httpcore checks)
            connection = None
        if connection is None:
            connection = self._connections[client] = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=self.timeout_s)
        try:
            connection.request("POST", "/v1/completions", body=body, headers=headers)
            response = connection.getresponse()
            answer = response.read()
        except BaseException:
            connection.close()  # a broken connection is not reused: the next request opens a new one
            del self._connections[client]
            raise
        if response.status != 200:
            try:
                message = json.loads(answer)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = answer[:FAILURE_MESSAGE_CHARS].decode(errors="replace")
            raise HttpFailure(response.status, message)
        completion = json.loads(answer)
        if not completion.get("choices") or not isinstance(completion.get("specdec"), dict):
            raise HttpFailure(response.status, f"an answer without choices or specdec stats: {answer[:80]!r}")
        return completion

    def learn(self, clients: int) -> Counter:
        """Each (door, key) that ``clients`` use asks each prompt once, side by side (the doors' answers
        differ: gRPC applies the chat template, /v1/completions does not): every honest scope has learned
        every answer its clients will ask for before anything is measured. Its failures by status."""
        first_of: dict[tuple[str, str | None], int] = {}
        for client in range(clients):
            first_of.setdefault((self.door(client), self.key(client)), client)

        def ask_each_prompt(client: int) -> Counter:
            failures: Counter = Counter()
            for prompt in self.prompts:
                try:
                    self.ask(client, prompt)
                except (grpc.RpcError, HttpFailure, OSError, http.client.HTTPException, ValueError) as error:
                    failures[describe_failure(error)[0]] += 1  # that answer is not learned; the run goes on
            return failures

        with ThreadPoolExecutor(len(first_of)) as pool:
            return sum(pool.map(ask_each_prompt, first_of.values()), Counter())

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()


def answer_ngrams(answers: Sequence[Sequence[int]], n: int) -> tuple[tuple[int, ...], ...]:
    """Every distinct ``n``-token run of the answers, in order: [[1, 2, 3, 1, 2]], 2 -> (1, 2), (2, 3), (3, 1)."""
    runs = (tuple(answer[start : start + n]) for answer in answers for start in range(len(answer) - n + 1))
    return tuple(dict.fromkeys(runs))


def _closed_by_server(connection: http.client.HTTPConnection) -> bool:
    """Whether an idle keep-alive connection has something to read: between requests that can only be its end."""
    return connection.sock is not None and bool(select.select([connection.sock], [], [], 0)[0])


class MemorySampler:
    """Both services' memory every MEMORY_SAMPLE_S on a thread of its own, from ``start`` to ``stop``."""

    def __init__(self, processes: dict[str, ServiceProcess]) -> None:
        self.processes = processes
        self.samples: list[tuple[float, dict]] = []  # (seconds since start, memory_of)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    def _sample(self) -> None:
        while True:
            self.samples.append((time.monotonic() - self.started, memory_of(self.processes)))
            if self._stop.wait(MEMORY_SAMPLE_S):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def now(self) -> float:
        return time.monotonic() - self.started

    def peak(self, until_s: float) -> dict[str, dict[str, int] | None]:
        """Per process, the largest of each field over the samples up to ``until_s`` (None: it never answered)."""
        peaks: dict[str, dict[str, int] | None] = {}
        for name in self.processes:
            readings = [memory[name] for at, memory in self.samples if at <= until_s and memory[name] is not None]
            peaks[name] = {field: max(reading[field] for reading in readings) for field in readings[0]} if readings else None
        return peaks

    def series(self) -> list[list]:
        """[seconds, verifier rss, verifier anon, drafter rss, drafter anon] per sample (None for a process gone)."""
        rows = []
        for at, memory in self.samples:
            row: list = [round(at, 1)]
            for name in self.processes:
                row += [memory[name]["rss"], memory[name]["anon"]] if memory[name] else [None, None]
            rows.append(row)
        return rows


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before[name], 1) for name in before}


def probe(processes: dict[str, ServiceProcess], honest: HonestClients) -> dict:
    """After the recovery: is each service SERVING on health, and does one honest request per door succeed (and how fast)?"""
    result: dict = {"exit_codes": {name: service.process.poll() for name, service in processes.items()}}
    for name, service in processes.items():
        try:
            status = health_pb2_grpc.HealthStub(service.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            result[f"{name}_health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
        except grpc.RpcError as error:
            result[f"{name}_health"] = error.code().name
    for door, client in (("grpc", 0), ("http", honest.grpc_clients)):
        started = time.perf_counter()
        try:
            honest(client, 0)
            result[f"{door}_request"] = f"OK in {1000 * (time.perf_counter() - started):.0f} ms"
        except (grpc.RpcError, HttpFailure, OSError, http.client.HTTPException, ValueError) as error:
            outcome, message = describe_failure(error)
            result[f"{door}_request"] = f"{outcome}: {message[:FAILURE_MESSAGE_CHARS]}"
    return result


def drafter_stats(drafter: ServiceProcess, vocabulary: str) -> dict[str, int] | None:
    """The drafter's Stats for the vocabulary (summed over its scopes): STATS_FIELDS; None if it does not answer."""
    try:
        stats = drafter_pb2_grpc.DrafterStub(drafter.channel).Stats(drafter_pb2.StatsRequest(vocabulary=vocabulary), timeout=10)
    except grpc.RpcError:
        return None
    return {name: getattr(stats, name) for name in STATS_FIELDS}


def stats_change(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """After less before, per field: {"entries": 5} -> {"entries": 9} is {"entries": 4}."""
    if before is None or after is None:
        return None
    return {name: after[name] - before[name] for name in before}


def run_beside(
    args: argparse.Namespace, mix: hostile.Mix, processes: dict[str, ServiceProcess], honest: HonestClients, targets: hostile.Targets
) -> dict:
    """The honest clients for ``--seconds`` beside ``mix``'s abusers, who go on until the last honest
    request ends (every one measured ran under abuse); what each side met, and what the drafter took."""
    cpu, stats = cpu_seconds(processes), drafter_stats(processes["drafter"], targets.vocabulary)
    stop, tally = threading.Event(), hostile.Tally()
    clients = mix.clients if mix.clients is not None else args.hostile_clients
    abusers = hostile.start_abusers(targets, mix.kinds, clients, stop, tally)
    under_abuse = Phase(str(mix), args.clients, args.seconds, honest, honest.door, HONEST_TIMEOUT_S)
    started = time.monotonic()
    try:
        under_abuse.run()
    finally:
        abuse_s = time.monotonic() - started
        stopping = time.monotonic()
        still_running = hostile.stop_abusers(abusers, stop)
        stop_s = time.monotonic() - stopping
    summary = under_abuse.summary() | {"cpu_s": cpu_used(cpu, cpu_seconds(processes))}
    print(json.dumps(summary | {"abusers": tally.summary()}), flush=True)
    return {
        "mix": str(mix),
        "kinds": list(mix.kinds),
        "abusers": clients,
        "abuse_s": round(abuse_s, 1),
        "honest": summary,
        "abuser_outcomes": tally.summary(),
        "abusers_stop_s": round(stop_s, 1),
        "abusers_still_running": still_running,
        "drafter_stats_change": stats_change(stats, drafter_stats(processes["drafter"], targets.vocabulary)),
    }


def run_alone(name: str, args: argparse.Namespace, processes: dict[str, ServiceProcess], honest: HonestClients) -> dict:
    cpu = cpu_seconds(processes)
    alone = Phase(name, args.clients, args.seconds, honest, honest.door, HONEST_TIMEOUT_S)
    alone.run()
    summary = alone.summary() | {"cpu_s": cpu_used(cpu, cpu_seconds(processes))}
    print(json.dumps(summary), flush=True)
    return summary


def run_hostile(args: argparse.Namespace, processes: dict[str, ServiceProcess], honest: HonestClients, targets: hostile.Targets) -> dict:
    """Every honest key learns every prompt's answer; the honest clients alone (baseline), beside each
    mix of abusers in turn, alone again when a tenant abuser ran; then RECOVERY_S with neither."""
    learning_started = time.monotonic()
    learning_failures = honest.learn(args.clients)
    learning_s = time.monotonic() - learning_started
    # The poisoner copies n-grams of the honest gRPC answers, as long as the drafter's longest lookups.
    targets = replace(targets, honest_ngrams=answer_ngrams(list(honest.answers.values()), NGramConfig().n_max))
    before_baseline = memory_of(processes)
    baseline = run_alone("baseline", args, processes, honest)
    end_of_baseline = memory_of(processes)

    sampler = MemorySampler(processes)
    sampler.start()
    runs = [run_beside(args, mix, processes, honest, targets) for mix in args.hostile_mix]
    abuse_s = sampler.now()
    tenants = any(kind in hostile.TENANT_KINDS for mix in args.hostile_mix for kind in mix.kinds)
    again = run_alone("again", args, processes, honest) if tenants else None
    time.sleep(RECOVERY_S)
    after_recovery = memory_of(processes)
    sampler.stop()
    return {
        "honest_clients": {"grpc": honest.grpc_clients, "http": args.clients - honest.grpc_clients},
        "honest_keys": len(honest.api_keys),
        "prompts": len(honest.prompts),
        "learning_s": round(learning_s, 1),
        "learning_failures": dict(learning_failures),
        "poison_ngrams": len(targets.honest_ngrams),
        "seconds": args.seconds,
        "baseline": baseline,
        "runs": runs,
        **({"again": again} if again is not None else {}),
        "memory_mb": {
            "before_baseline": before_baseline,
            "end_of_baseline": end_of_baseline,
            "peak_under_abuse": sampler.peak(abuse_s),
            f"{RECOVERY_S}_s_after": after_recovery,
        },
        "memory_series": sampler.series(),
        "after": probe(processes, honest),
    }


def settings(args: argparse.Namespace) -> dict:
    """The run's flags for load.json, API keys left out: "--api-key k --x 1" -> "--api-key *** --x 1"."""
    return vars(args) | {
        "out": str(args.out),
        "hostile_mix": [str(mix) for mix in args.hostile_mix],
        "api_key": "***" if args.api_key else None,
        "verifier_arg": [re.sub(r"(--api-key[= ]\s*)\S+", r"\1***", line) for line in args.verifier_arg],
    }


class Credentials:
    """What the run makes up for the services (never written to load.json): ``honest_keys`` API keys the
    verifier requires (none when the run was given --api-key, which the user configures), and unless
    ``open_drafter`` the drafter's client token, which the verifier alone is given. Handed over in the
    services' variables, not on their command lines."""

    def __init__(self, args: argparse.Namespace) -> None:
        made = [] if args.api_key else [secrets.token_urlsafe(18) for _ in range(args.honest_keys)]
        self.api_keys: tuple[str, ...] = (args.api_key,) if args.api_key else tuple(made)
        self._verifier_keys = ",".join(made)
        self._drafter_token = None if args.open_drafter else secrets.token_urlsafe(24)

    def drafter_env(self) -> dict[str, str]:
        return os.environ | ({"SPECDEC_DRAFTER_CLIENT_TOKEN": self._drafter_token} if self._drafter_token else {})

    def verifier_env(self) -> dict[str, str]:
        made = {"SPECDEC_VERIFIER_API_KEY": self._verifier_keys} if self._verifier_keys else {}
        token = {"SPECDEC_VERIFIER_DRAFTER_TOKEN": self._drafter_token} if self._drafter_token else {}
        return os.environ | made | token

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The first key as gRPC metadata, for the phases' clients but the hostile run's."""
        return (("authorization", f"Bearer {self.api_keys[0]}"),) if self.api_keys else ()


def stop_timed(service: ServiceProcess) -> dict:
    """Stop a service (``ServiceProcess.stop``): how long it took and its exit status (-9: it had to be killed)."""
    started = time.monotonic()
    service.stop()
    return {"s": round(time.monotonic() - started, 1), "exit": service.process.returncode}


def service_flags(extra: list[str]) -> list[str]:
    """``--verifier-arg``/``--drafter-arg`` values, each split like a shell line: ["--api-key k --x 1"] -> [--api-key, k, --x, 1]."""
    return [flag for line in extra for flag in shlex.split(line)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--overload-clients", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--phases", nargs="+", choices=PHASES, default=list(PHASES), help="run in the order of PHASES whatever the order given"
    )
    parser.add_argument("--hostile-clients", type=int, default=64, help="abusers of a --hostile-mix that does not say how many")
    parser.add_argument(
        "--hostile-mix",
        type=hostile.parse_mix,
        action="append",
        default=None,
        help="a run beside the honest clients: [N:]KIND,KIND..., N abusers spread evenly over the kinds; repeat for runs in turn "
        f"(default {' '.join(str(mix) for mix in DEFAULT_HOSTILE_MIXES)}; kinds: {','.join(hostile.KINDS)})",
    )
    parser.add_argument(
        "--hostile-prompts",
        type=int,
        default=HOSTILE_PROMPTS,
        help="prompts the hostile run's honest clients ask, spread over all (0: all)",
    )
    parser.add_argument(
        "--honest-keys", type=int, default=HONEST_KEYS, help="API keys made for the run and required by the verifier (0: none)"
    )
    parser.add_argument(
        "--open-drafter",
        action="store_true",
        help="no --client-token: any client may declare a scope, and one that does not learns in the default",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the verifier's --model (and the vocabulary the drafter calls name)")
    parser.add_argument(
        "--api-key", default=None, help="bearer token honest clients send instead of made keys (start the verifier with it: --verifier-arg)"
    )
    parser.add_argument("--verifier-arg", action="append", default=[], help='extra verifier flags, e.g. --verifier-arg="--api-key k"')
    parser.add_argument("--drafter-arg", action="append", default=[], help="extra drafter flags, split like a shell line")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if min(args.clients, args.overload_clients, args.max_new_tokens) < 1 or args.seconds <= 0:
        parser.error("--clients, --overload-clients, --max-new-tokens and --seconds must be positive")
    if min(args.hostile_clients, args.hostile_prompts, args.honest_keys) < 0:
        parser.error("--hostile-clients, --hostile-prompts and --honest-keys must be >= 0")
    args.phases = [phase for phase in PHASES if phase in args.phases]
    args.hostile_mix = args.hostile_mix or list(DEFAULT_HOSTILE_MIXES)
    return args


def spread(items: Sequence[str], count: int) -> list[str]:
    """``count`` of ``items`` spread evenly over them (0 or more than there are: all): "abcdef", 3 -> a, c, e."""
    if count == 0 or count >= len(items):
        return list(items)
    return [items[index * len(items) // count] for index in range(count)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM to the benchmark unwinds through the finally below, which stops both services.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    prompts = service_prompts("grounded") + service_prompts("open_ended")
    credentials = Credentials(args)
    results: list[dict] = []
    hostile_result: dict | None = None
    shutdown: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-load-") as scratch:
        drafter = ServiceProcess(
            "drafter_service",
            *("--port", "0", "--metrics-port", "-1", "--db", str(Path(scratch) / "db"), *service_flags(args.drafter_arg)),
            env=credentials.drafter_env(),
            inherit_stderr=True,
        )
        verifier = None
        try:
            drafter.wait_until_serving()
            verifier = ServiceProcess(
                "verifier_service",
                *("--port", "0", "--metrics-port", "-1", "--http-port", "0", "--drafter", drafter.address, "--model", args.model),
                *service_flags(args.verifier_arg),
                env=credentials.verifier_env(),
                inherit_stderr=True,
            )
            http_port = verifier.announced_port("http")
            verifier.wait_until_serving()
            processes = {"verifier": verifier, "drafter": drafter}
            results, hostile_result = run_phases(args, prompts, processes, http_port, credentials)
        finally:
            if verifier is not None:  # the verifier first: it holds drafter sessions
                shutdown["verifier"] = stop_timed(verifier)
            shutdown["drafter"] = stop_timed(drafter)

    report = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": settings(args),
        "phases": results,
        "shutdown": shutdown,
    }
    if hostile_result is not None:
        report["hostile"] = hostile_result
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps(report, indent=2) + "\n")
    if results:
        print(phases_table(results))
    if hostile_result is not None:
        print(hostile_tables(hostile_result))
    print(
        "Shutdown (SIGTERM, SIGKILL after 60 s): "
        + ", ".join(f"{name} exit {stopped['exit']} in {stopped['s']} s" for name, stopped in shutdown.items())
    )


def run_phases(
    args: argparse.Namespace, prompts, processes: dict[str, ServiceProcess], http_port: int, credentials: Credentials
) -> tuple[list[dict], dict | None]:
    verifier, drafter = processes["verifier"], processes["drafter"]
    verifier_stub, drafter_stub = rpc.VerifierStub(verifier.channel), drafter_pb2_grpc.DrafterStub(drafter.channel)
    metadata = credentials.metadata()

    def generate(client: int, n: int) -> None:
        prompt = prompts[(client + n * 7) % len(prompts)]
        verifier_stub.Generate(
            pb.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=args.max_new_tokens), timeout=REQUEST_TIMEOUT_S, metadata=metadata
        )

    # The model's tokenizer names the drafter's table, as the verifier's does.
    vocabulary = tokenizer_fingerprint(AutoTokenizer.from_pretrained(resolve_model_path(args.model)))
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
    phases = {
        "steady": Phase("steady", args.clients, args.seconds, generate),
        "overload": Phase("overload", args.overload_clients, args.seconds, generate),
        "propose": Phase("propose", args.clients, args.seconds, propose),
        "observe": Phase("observe", args.clients, args.seconds, observe),
    }
    results = []
    for name in args.phases:
        if name == "hostile":
            continue
        phase = phases[name]
        before = {"verifier": memory_mb(verifier.process.pid), "drafter": memory_mb(drafter.process.pid)}
        phase.run()
        after = {"verifier": memory_mb(verifier.process.pid), "drafter": memory_mb(drafter.process.pid)}
        summary = phase.summary() | {"memory_mb_before": before, "memory_mb_after": after}
        results.append(summary)
        print(json.dumps(summary), flush=True)
    if "hostile" not in args.phases:
        return results, None
    asked = spread(prompts, args.hostile_prompts)
    honest = HonestClients(verifier_stub, http_port, asked, args.max_new_tokens, args.clients, credentials.api_keys, HONEST_TIMEOUT_S)
    try:
        honest.complete(honest.grpc_clients, asked[0])  # warm-up of the HTTP door
        limits = hostile.DrafterLimits.of(hostile.drafter_config(service_flags(args.drafter_arg)))
        targets = hostile.Targets(verifier.address, drafter.address, http_port, vocabulary, limits)
        return results, run_hostile(args, processes, honest, targets)
    finally:
        honest.close()


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def phases_table(results: list[dict]) -> str:
    lines = [
        "| phase | clients | completed | refused | errors | p50 ms | p99 ms | verifier heap MB | drafter heap MB | drafter mapped MB |",
        "|---|---:|---:|---:|---|---:|---:|---|---|---|",
    ]
    for r in results:
        before, after = r["memory_mb_before"], r["memory_mb_after"]
        lines.append(
            f"| {r['phase']} | {r['clients']} | {r['completed']} | {r['refused']} | {r['errors'] or 0} | {_ms(r['p50_ms'])} "
            f"| {_ms(r['p99_ms'])} | {before['verifier']['anon']} → {after['verifier']['anon']} "
            f"| {before['drafter']['anon']} → {after['drafter']['anon']} | {before['drafter']['file']} → {after['drafter']['file']} |"
        )
    return "\n".join(lines)


def _memory_cell(reading: dict | None) -> str:
    return "gone" if reading is None else f"{reading['rss']:,} ({reading['anon']:,})"


def _tokens_per_pass(summary: dict) -> str:
    return f"{summary['tokens_per_pass']:.2f}" if "tokens_per_pass" in summary else "–"


def honest_runs(h: dict) -> list[tuple[str, int, dict]]:
    """(name, abusers, honest summary) of each run of the hostile result, in the order they ran."""
    runs = [("baseline", 0, h["baseline"])] + [(run["mix"], run["abusers"], run["honest"]) for run in h["runs"]]
    return runs + ([("again", 0, h["again"])] if "again" in h else [])


def honest_table(h: dict) -> list[str]:
    """The honest clients alone and beside each mix, one row each, the baseline's figures beside every row's."""
    base = h["baseline"]
    lines = [
        "| run | abusers | completed | failures | tokens/pass (baseline) | p50 ms (baseline) | p95 ms (baseline) | p99 ms "
        "| gRPC p50 / p95 ms | HTTP p50 / p95 ms | CPU s verifier / drafter / bench |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for name, abusers, r in honest_runs(h):
        doors = r.get("by_door", {})
        door = {name: f"{_ms(doors[name]['p50_ms'])} / {_ms(doors[name]['p95_ms'])}" if name in doors else "" for name in ("grpc", "http")}
        failed = sum(f["count"] for f in r["failures"])
        cpu = r["cpu_s"]
        lines.append(
            f"| {name} | {abusers} | {r['completed']} | {failed} | {_tokens_per_pass(r)} ({_tokens_per_pass(base)}) "
            f"| {_ms(r['p50_ms'])} ({_ms(base['p50_ms'])}) | {_ms(r['p95_ms'])} ({_ms(base['p95_ms'])}) | {_ms(r['p99_ms'])} "
            f"| {door['grpc']} | {door['http']} | {cpu['verifier']} / {cpu['drafter']} / {cpu['bench']} |"
        )
    return lines


def abusers_table(h: dict) -> list[str]:
    """Per run and kind: what the abusers met, the tokens the drafter took from them, and the drafter's Stats change."""
    lines = ["| run | kind | outcomes | tokens taken | drafter Stats change |", "|---|---|---|---:|---|"]
    for run in h["runs"]:
        change = run["drafter_stats_change"]
        changed = "no answer" if change is None else ", ".join(f"{name} {value:+,}" for name, value in change.items() if value)
        tally = run["abuser_outcomes"]
        for index, (kind, outcomes) in enumerate(tally["outcomes"].items()):
            taken = tally["tokens_taken"].get(kind)
            described = "; ".join(f"{outcome.replace('|', '/')}: {count:,}" for outcome, count in outcomes.items())
            lines.append(
                f"| {run['mix'] if index == 0 else ''} | {kind} | {described} | {'' if taken is None else f'{taken:,}'} "
                f"| {(changed or 'none') if index == 0 else ''} |"
            )
        if tally["longest_held_s"]:
            lines.append(
                "| | longest held | " + "; ".join(f"{what} {seconds} s" for what, seconds in tally["longest_held_s"].items()) + " | | |"
            )
        if run["abusers_still_running"]:
            lines.append(f"| | still running after the bound | {', '.join(run['abusers_still_running'])} | | |")
    return lines


def learning_failed(h: dict) -> str:
    failures = h.get("learning_failures") or {}
    return "".join(f", {count} {status}" for status, count in failures.items())


def hostile_tables(h: dict) -> str:
    """The honest clients without and with each mix of abusers, their failures, both services' memory, and what the abusers met."""
    lines = [
        f"Honest clients: {h['honest_clients']['grpc']} gRPC + {h['honest_clients']['http']} HTTP, {h['honest_keys']} API keys, "
        f"{h['prompts']} prompts (learned in {h['learning_s']} s{learning_failed(h)}), {h['seconds']} s a run",
        "",
        *honest_table(h),
    ]
    failures = [(name, f) for name, _, r in honest_runs(h) for f in r["failures"]]
    if failures:
        lines += ["", "| honest failures | door | status | message | count |", "|---|---|---|---|---:|"]
        lines += [f"| {run} | {f['door']} | {f['outcome']} | {f['message'].replace('|', '/')} | {f['count']} |" for run, f in failures]
    memory = h["memory_mb"]
    lines += ["", "| RSS MB (anon) | " + " | ".join(name.replace("_", " ") for name in memory) + " |", "|---|" + "---:|" * len(memory)]
    for process in ("verifier", "drafter"):
        lines.append(f"| {process} | " + " | ".join(_memory_cell(readings[process]) for readings in memory.values()) + " |")
    lines += ["", *abusers_table(h)]
    after = h["after"]
    lines += ["", f"After {RECOVERY_S} s: " + ", ".join(f"{key} {value}" for key, value in after.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
