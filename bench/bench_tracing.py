"""What tracing costs a request: off, exporting to a live collector, and exporting to a dead one.

    python -m bench.bench_tracing [--requests 8] [--max-new-tokens 64] [--out bench/results]

Starts, once per configuration, the drafter (on an empty table) and the verifier (default model),
with OpenTelemetry export ``off`` (no endpoint), to a ``live`` collector (an
OTLP/gRPC receiver in this process that accepts every span) and to a ``dead``
one (an endpoint where nothing listens). Each configuration serves the same
greedy requests one after another (K=4, so every step proposes, scores and
accepts); we report p50 latency and its ratio to ``off``, plus the verifier's
own count of dropped spans. The configurations alternate twice so that machine
noise hits all three.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.workloads import service_prompts
from specdec.processes import ServiceProcess, free_port
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

CONFIGS = ("off", "live", "dead")


class AcceptAll(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def dropped_spans(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("specdec_verifier_dropped_spans_total"))


def run_config(name: str, endpoint: str | None, db: Path, prompts, args) -> dict:
    """One verifier with this tracing configuration, and a drafter on an empty table
    (the same prompts run under every configuration: none may be drafted from an earlier answer)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    if endpoint:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_SERVICE_NAME="specdec-verifier")
    metrics_port = free_port()
    drafter = ServiceProcess("drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(db), inherit_stderr=True)
    try:
        process = ServiceProcess(
            "verifier_service",
            *("--port", "0", "--metrics-port", str(metrics_port), "--http-port", "-1", "--drafter", drafter.address),
            env=env,
            inherit_stderr=True,
        )
    except BaseException:
        drafter.stop()
        raise
    try:
        process.wait_until_serving()
        latencies = []
        with grpc.insecure_channel(process.address) as channel:
            stub = rpc.VerifierStub(channel)
            for prompt in prompts:
                request = pb.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=args.max_new_tokens, num_speculative_tokens=4)
                started = time.perf_counter()
                stub.Generate(request, timeout=600)
                latencies.append(time.perf_counter() - started)
        dropped = dropped_spans(metrics_port)
    finally:
        process.stop()
        drafter.stop()
    return {"config": name, "latencies_s": latencies, "dropped_spans": dropped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    prompts = service_prompts("grounded")[: args.requests]
    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    receiver = AcceptAll()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    live_port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    endpoints = {"off": None, "live": f"http://127.0.0.1:{live_port}", "dead": f"http://127.0.0.1:{free_port()}"}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for round_ in range(2):
                for name in CONFIGS:
                    runs.append(run_config(name, endpoints[name], Path(tmp) / f"db-{name}-{round_}", prompts, args))
        finally:
            collector.stop(0)
    report = {
        "requests_per_run": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "spans_received_live": receiver.spans,
        "configs": {},
    }
    for name in CONFIGS:
        latencies = [s for run in runs if run["config"] == name for s in run["latencies_s"]]
        report["configs"][name] = {
            "p50_ms": round(1000 * statistics.median(latencies), 1),
            "dropped_spans": sum(run["dropped_spans"] for run in runs if run["config"] == name),
        }
    base = report["configs"]["off"]["p50_ms"]
    for name in CONFIGS:
        report["configs"][name]["p50_vs_off"] = round(report["configs"][name]["p50_ms"] / base, 3)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tracing.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
