"""Load benchmark: both services under steady, excess and hostile load for a fixed time; latency, errors, memory.

    python -m bench.bench_load [--seconds 60] [--clients 16] [--overload-clients 96] [--max-new-tokens 32]
        [--phases steady overload propose observe hostile] [--hostile-clients 64] [--hostile-mix KIND,KIND...]
        [--model NAME_OR_PATH] [--api-key KEY] [--verifier-arg "FLAGS"] [--drafter-arg "FLAGS"] [--out bench/results]

Starts the drafter and the verifier (``--model``, the default model unless
given; its gRPC port and its HTTP API, both on 127.0.0.1) as real processes,
warms the verifier up, then runs the ``--phases`` chosen (all by default, in
this order), ``--seconds`` each:

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
  temperature 0; ``--api-key`` as a bearer token when given), first alone
  (``baseline``), then beside ``--hostile-clients`` abusers of
  ``--hostile-mix`` (``bench.hostile``: idle streams, repeated closes, huge
  and slow bodies, ...), then ``RECOVERY_S`` with neither. Honest clients
  must not fail (any status but OK is a failure, by status and message);
  abusers may, and their outcomes are counted by kind. Both processes'
  memory is read before the baseline, at its end, every second under abuse
  (the peak) and ``RECOVERY_S`` after the abusers stopped.

Per phase: calls completed, their p50/p99 latency, errors by status (any
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
import select
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from bench import hostile
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
PHASES = ("steady", "overload", "propose", "observe", "hostile")  # the order they run in: hostile last
# An honest request in the hostile run that takes longer than this failed: at 16 clients on
# the default model p99 is ~21 s, so 120 s is several times what a healthy server needs.
HONEST_TIMEOUT_S = 120
RECOVERY_S = 10  # after the abusers stop, before the last memory reading
MEMORY_SAMPLE_S = 1.0
JOIN_SLACK_S = 30  # a phase's clients joined at most this long past their last request's deadline
FAILURE_MESSAGE_CHARS = 160


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
    per front door when ``door`` (client -> its door's name) is given."""

    def __init__(
        self,
        name: str,
        clients: int,
        seconds: float,
        work: Callable[[int, int], None],
        door: Callable[[int], str] | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.name, self.clients, self.seconds, self.work = name, clients, seconds, work
        self.door = door or (lambda client: "all")
        self.request_timeout_s = request_timeout_s
        self.latencies_s: dict[str, list[float]] = {}
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
            try:
                self.work(client, n)
                outcome, message = "OK", ""
            except (grpc.RpcError, HttpFailure, OSError, http.client.HTTPException, ValueError) as error:
                outcome, message = describe_failure(error)
            seconds = time.perf_counter() - started
            with self._lock:
                self.outcomes[outcome] += 1
                if outcome == "OK":
                    self.latencies_s.setdefault(door, []).append(seconds)
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
            "failures": [
                {"door": door, "outcome": outcome, "message": message, "count": count}
                for (door, outcome, message), count in self.failures.most_common()
            ],
            "stragglers": self.stragglers,
        }
        if len({self.door(client) for client in range(self.clients)}) > 1:
            summary["by_door"] = {
                door: {"completed": len(self.latencies_s.get(door, [])), **latency_ms(self.latencies_s.get(door, []))}
                for door in sorted({self.door(client) for client in range(self.clients)})
            }
        return summary


def latency_ms(latencies_s: list[float]) -> dict:
    ms = [1000 * s for s in latencies_s]
    return {
        "p50_ms": round(percentile(ms, 0.5), 1) if ms else None,
        "p99_ms": round(percentile(ms, 0.99), 1) if ms else None,
    }


class HonestClients:
    """The hostile run's honest clients: the first half (rounded up) greedy gRPC ``Generate`` with adaptive K
    (as ``steady``), the rest ``POST /v1/completions`` with ``max_tokens`` and temperature 0, each over a
    keep-alive connection of its own; ``api_key`` as a bearer token on both doors when given."""

    def __init__(self, stub, http_port: int, prompts, max_new_tokens: int, clients: int, api_key: str | None, timeout_s: float) -> None:
        self.stub, self.http_port, self.prompts, self.max_new_tokens = stub, http_port, prompts, max_new_tokens
        self.grpc_clients = (clients + 1) // 2
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._connections: dict[int, http.client.HTTPConnection] = {}

    def door(self, client: int) -> str:
        return "grpc" if client < self.grpc_clients else "http"

    def __call__(self, client: int, n: int) -> None:
        prompt = self.prompts[(client + n * 7) % len(self.prompts)]
        if self.door(client) == "grpc":
            request = pb.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=self.max_new_tokens, temperature=0.0)
            self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata)
        else:
            self.complete(client, prompt)

    def complete(self, client: int, prompt: str) -> dict:
        body = json.dumps({"prompt": prompt, "max_tokens": self.max_new_tokens, "temperature": 0}).encode()
        connection = self._connections.get(client)
        if connection is not None and _closed_by_server(connection):
            connection.close()  # an idle keep-alive connection the server timed out: not reused (as httpcore checks)
            connection = None
        if connection is None:
            connection = self._connections[client] = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=self.timeout_s)
        try:
            connection.request("POST", "/v1/completions", body=body, headers=self.headers)
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
        if not completion.get("choices"):
            raise HttpFailure(response.status, f"an answer without choices: {answer[:80]!r}")
        return completion

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()


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


def run_hostile(args: argparse.Namespace, processes: dict[str, ServiceProcess], honest: HonestClients, targets: hostile.Targets) -> dict:
    """The baseline (honest clients alone), the same clients beside the abusers, then RECOVERY_S with neither."""
    before_baseline = memory_of(processes)
    cpu = cpu_seconds(processes)
    baseline = Phase("baseline", args.clients, args.seconds, honest, honest.door, HONEST_TIMEOUT_S)
    baseline.run()
    end_of_baseline, cpu_after_baseline = memory_of(processes), cpu_seconds(processes)
    print(json.dumps(baseline.summary()), flush=True)

    sampler, stop, tally = MemorySampler(processes), threading.Event(), hostile.Tally()
    sampler.start()
    abusers = hostile.start_abusers(targets, args.hostile_mix, args.hostile_clients, stop, tally)
    under_abuse = Phase("hostile", args.clients, args.seconds, honest, honest.door, HONEST_TIMEOUT_S)
    try:
        under_abuse.run()  # the abusers go on until the last honest request ends: every one measured ran under abuse
    finally:
        abuse_s = sampler.now()
        stopping = time.monotonic()
        still_running = hostile.stop_abusers(abusers, stop)
        stop_s = time.monotonic() - stopping
    cpu_after_abuse = cpu_seconds(processes)
    print(json.dumps(under_abuse.summary() | {"abusers": tally.summary()["outcomes"]}), flush=True)
    time.sleep(RECOVERY_S)
    after_recovery = memory_of(processes)
    sampler.stop()
    return {
        "honest_clients": {"grpc": honest.grpc_clients, "http": args.clients - honest.grpc_clients},
        "abusers": args.hostile_clients,
        "mix": list(args.hostile_mix),
        "seconds": args.seconds,
        "abuse_s": round(abuse_s, 1),
        "baseline": baseline.summary() | {"cpu_s": cpu_used(cpu, cpu_after_baseline)},
        "hostile": under_abuse.summary() | {"cpu_s": cpu_used(cpu_after_baseline, cpu_after_abuse)},
        "abuser_outcomes": tally.summary(),
        "abusers_stop_s": round(stop_s, 1),
        "abusers_still_running": still_running,
        "memory_mb": {
            "before_baseline": before_baseline,
            "end_of_baseline": end_of_baseline,
            "peak_under_abuse": sampler.peak(abuse_s + stop_s),
            f"{RECOVERY_S}_s_after": after_recovery,
        },
        "memory_series": sampler.series(),
        "after": probe(processes, honest),
    }


def settings(args: argparse.Namespace) -> dict:
    """The run's flags for load.json, API keys left out: "--api-key k --x 1" -> "--api-key *** --x 1"."""
    return vars(args) | {
        "out": str(args.out),
        "hostile_mix": list(args.hostile_mix),
        "api_key": "***" if args.api_key else None,
        "verifier_arg": [re.sub(r"(--api-key[= ]\s*)\S+", r"\1***", line) for line in args.verifier_arg],
    }


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
    parser.add_argument("--hostile-clients", type=int, default=64)
    parser.add_argument(
        "--hostile-mix",
        type=hostile.parse_mix,
        default=hostile.DEFAULT_MIX,
        help=f"abuser kinds, comma-separated, spread evenly (default {','.join(hostile.DEFAULT_MIX)}; all: {','.join(hostile.KINDS)})",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the verifier's --model (and the vocabulary the drafter calls name)")
    parser.add_argument("--api-key", default=None, help="bearer token honest clients send (start the verifier with it: --verifier-arg)")
    parser.add_argument("--verifier-arg", action="append", default=[], help='extra verifier flags, e.g. --verifier-arg="--api-key k"')
    parser.add_argument("--drafter-arg", action="append", default=[], help="extra drafter flags, split like a shell line")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if min(args.clients, args.overload_clients, args.max_new_tokens) < 1 or args.hostile_clients < 0 or args.seconds <= 0:
        parser.error("--clients, --overload-clients, --max-new-tokens and --seconds must be positive, --hostile-clients >= 0")
    args.phases = [phase for phase in PHASES if phase in args.phases]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM to the benchmark unwinds through the finally below, which stops both services.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    prompts = service_prompts("grounded") + service_prompts("open_ended")
    results: list[dict] = []
    hostile_result: dict | None = None
    shutdown: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-load-") as scratch:
        drafter = ServiceProcess(
            "drafter_service",
            *("--port", "0", "--metrics-port", "-1", "--db", str(Path(scratch) / "db"), *service_flags(args.drafter_arg)),
            inherit_stderr=True,
        )
        verifier = None
        try:
            drafter.wait_until_serving()
            verifier = ServiceProcess(
                "verifier_service",
                *("--port", "0", "--metrics-port", "-1", "--http-port", "0", "--drafter", drafter.address, "--model", args.model),
                *service_flags(args.verifier_arg),
                inherit_stderr=True,
            )
            http_port = verifier.announced_port("http")
            verifier.wait_until_serving()
            processes = {"verifier": verifier, "drafter": drafter}
            results, hostile_result = run_phases(args, prompts, processes, http_port)
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


def run_phases(args: argparse.Namespace, prompts, processes: dict[str, ServiceProcess], http_port: int) -> tuple[list[dict], dict | None]:
    verifier, drafter = processes["verifier"], processes["drafter"]
    verifier_stub, drafter_stub = rpc.VerifierStub(verifier.channel), drafter_pb2_grpc.DrafterStub(drafter.channel)
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()

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
    honest = HonestClients(verifier_stub, http_port, prompts, args.max_new_tokens, args.clients, args.api_key, HONEST_TIMEOUT_S)
    try:
        honest.complete(honest.grpc_clients, prompts[0])  # warm-up of the HTTP door
        targets = hostile.Targets(verifier.address, drafter.address, http_port, vocabulary)
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


def hostile_tables(h: dict) -> str:
    """The honest clients without and with abusers, their failures, both services' memory, and what the abusers met."""
    honest = f"{h['honest_clients']['grpc']} + {h['honest_clients']['http']}"
    lines = [
        "| run | honest clients (gRPC + HTTP) | abusers | completed | failures | p50 ms | p99 ms "
        "| gRPC p50 / p99 ms | HTTP p50 / p99 ms | CPU s verifier / drafter / bench |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for run, abusers in (("baseline", 0), ("hostile", h["abusers"])):
        r = h[run]
        doors = r.get("by_door", {})
        door = {name: f"{_ms(doors[name]['p50_ms'])} / {_ms(doors[name]['p99_ms'])}" if name in doors else "" for name in ("grpc", "http")}
        failed = sum(f["count"] for f in r["failures"])
        cpu = r["cpu_s"]
        lines.append(
            f"| {run} | {honest} | {abusers} | {r['completed']} | {failed} | {_ms(r['p50_ms'])} | {_ms(r['p99_ms'])} "
            f"| {door['grpc']} | {door['http']} | {cpu['verifier']} / {cpu['drafter']} / {cpu['bench']} |"
        )
    failures = [(run, f) for run in ("baseline", "hostile") for f in h[run]["failures"]]
    if failures:
        lines += ["", "| honest failures | door | status | message | count |", "|---|---|---|---|---:|"]
        lines += [f"| {run} | {f['door']} | {f['outcome']} | {f['message'].replace('|', '/')} | {f['count']} |" for run, f in failures]
    memory = h["memory_mb"]
    lines += ["", "| RSS MB (anon) | " + " | ".join(name.replace("_", " ") for name in memory) + " |", "|---|" + "---:|" * len(memory)]
    for process in ("verifier", "drafter"):
        lines.append(f"| {process} | " + " | ".join(_memory_cell(readings[process]) for readings in memory.values()) + " |")
    held = h["abuser_outcomes"]["longest_held_s"]
    lines += ["", f"| abusers ({h['abuse_s']} s, stopped in {h['abusers_stop_s']} s) | outcomes |", "|---|---|"]
    for kind, outcomes in h["abuser_outcomes"]["outcomes"].items():
        lines.append(f"| {kind} | " + "; ".join(f"{outcome.replace('|', '/')}: {count}" for outcome, count in outcomes.items()) + " |")
    if held:
        lines.append("| longest held | " + "; ".join(f"{what} {seconds} s" for what, seconds in held.items()) + " |")
    if h["abusers_still_running"]:
        lines.append(f"| still running after the bound | {', '.join(h['abusers_still_running'])} |")
    after = h["after"]
    lines += ["", f"After {RECOVERY_S} s: " + ", ".join(f"{key} {value}" for key, value in after.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
