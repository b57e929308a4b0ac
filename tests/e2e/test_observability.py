"""Traces and metrics from both services as processes: a real OTLP/gRPC receiver
in this test, a hanging one, and a real Prometheus server scraping both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc
from tests.metrics_reference import documented_metrics, exposed_metrics

from processes import free_port, running

DEADLINE_S = 60  # upper bound on waiting for exports and scrapes; never a pass/fail threshold
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector: keeps every span it is sent, with its service name."""

    def __init__(self, hang: bool = False) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.hang = threading.Event() if hang else None

    def Export(self, request, context):
        if self.hang is not None:  # a collector that accepts the call and never answers
            self.hang.wait()
        with self.lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append((attributes.get("service.name"), span))
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list:
        with self.lock:
            return [span for _, span in self.spans if span.name == name]


@contextmanager
def receiver(hang: bool = False):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    collector = Receiver(hang)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, port
    finally:
        if collector.hang is not None:
            collector.hang.set()
        server.stop(0)


def otel_env(port: int, service: str) -> dict[str, str]:
    return {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export every 0.1 s: the test waits less
    }


@contextmanager
def pair(model_dir, env_drafter=None, env_verifier=None, metrics=False):
    """Drafter and verifier (tiny model) as processes, both SERVING; yields (drafter, verifier, metrics ports)."""
    ports = (free_port(), free_port()) if metrics else (-1, -1)
    with running(
        "drafter_service",
        "--port",
        "0",
        "--db",
        str(model_dir.parent / f"db-{time.monotonic_ns()}"),
        "--metrics-port",
        str(ports[0]),
        env=env_drafter,
    ) as drafter:
        with running(
            "verifier_service",
            "--port",
            "0",
            "--drafter",
            drafter.address,
            "--model",
            str(model_dir),
            "--no-calibrate",
            "--metrics-port",
            str(ports[1]),
            env=env_verifier,
        ) as verifier:
            verifier.wait_until_serving("", timeout_s=120)
            yield drafter, verifier, ports


def wait_for(condition, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


def test_one_generate_is_one_trace_across_both_services(tiny_model_dir):
    with receiver() as (collector, port):
        with pair(tiny_model_dir, otel_env(port, "specdec-drafter"), otel_env(port, "specdec-verifier")) as (_, verifier, _):
            traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"  # W3C: the client's own span
            request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=12)
            rpc.VerifierStub(verifier.channel).Generate(request, timeout=60, metadata=[("traceparent", traceparent)])
            # Named as OpenTelemetry's GenAI conventions name it: "{operation} {model}".
            generate = f"text_completion {tiny_model_dir}"
            [root] = wait_for(lambda: collector.named(generate), "the verifier's root span")
            wait_for(lambda: collector.named("specdec.drafter.propose"), "the drafter's propose span")
            wait_for(lambda: len(collector.named("specdec.step")) == root_steps(root), "every step span")

    with collector.lock:
        # Observations are committed after the request, off its path: traces of their own.
        spans = [(service, span) for service, span in collector.spans if span.name != "specdec.drafter.observe"]
    # One trace: every other span both services sent carries the client's trace id.
    assert {span.trace_id.hex() for _, span in spans} == {TRACE_ID}
    assert {service for service, _ in spans} == {"specdec-drafter", "specdec-verifier"}
    by_id = {span.span_id: span for _, span in spans}
    parent = {span.name: set() for _, span in spans}
    for _, span in spans:
        parent[span.name].add(by_id[span.parent_span_id].name if span.parent_span_id in by_id else span.parent_span_id.hex())
    assert parent[generate] == {CLIENT_SPAN_ID}
    assert parent["specdec.batch_step"] == {generate}
    assert parent["specdec.step"] == {generate}
    # Where the time before the first token went: queueing for a slot, then the prefill.
    assert parent["specdec.queue"] == parent["specdec.prefill"] == {generate}
    [queue] = [span for _, span in spans if span.name == "specdec.queue"]
    [prefill] = [span for _, span in spans if span.name == "specdec.prefill"]
    [request_span] = [span for _, span in spans if span.name == generate]
    assert request_span.start_time_unix_nano <= queue.start_time_unix_nano <= queue.end_time_unix_nano <= prefill.start_time_unix_nano
    assert prefill.start_time_unix_nano < prefill.end_time_unix_nano <= request_span.end_time_unix_nano
    assert parent["specdec.propose"] == parent["specdec.score"] == parent["specdec.accept"] == {"specdec.batch_step"}
    assert parent["specdec.drafter.propose"] == {"specdec.propose"}  # across the process boundary
    # Each request step span links to its batch step; attributes are namespaced scalars, no text.
    batch_ids = {span.span_id for _, span in spans if span.name == "specdec.batch_step"}
    for _, span in spans:
        if span.name == "specdec.step":
            assert [link.span_id for link in span.links] and all(link.span_id in batch_ids for link in span.links)
        for attribute in span.attributes:
            assert attribute.key.startswith(("specdec.", "exception.", "gen_ai.")), attribute.key
            kinds = ("int_value", "string_value", "bool_value", "double_value")
            if attribute.key == "gen_ai.response.finish_reasons":
                kinds = ("array_value",)
            assert attribute.value.WhichOneof("value") in kinds, attribute.key
    [root] = [span for _, span in spans if span.name == generate]
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["specdec.generated_tokens"].int_value == 12
    # The GenAI conventions' attributes, beside ours.
    assert attributes["gen_ai.operation.name"].string_value == "text_completion"
    assert attributes["gen_ai.request.model"].string_value == attributes["gen_ai.response.model"].string_value == str(tiny_model_dir)
    assert attributes["gen_ai.request.max_tokens"].int_value == 12
    assert attributes["gen_ai.request.temperature"].double_value == 0.0
    assert (attributes["gen_ai.usage.input_tokens"].int_value, attributes["gen_ai.usage.output_tokens"].int_value) == (8, 12)
    assert [value.string_value for value in attributes["gen_ai.response.finish_reasons"].array_value.values] == ["length"]
    assert attributes["gen_ai.response.id"].string_value


def root_steps(root) -> int:
    """Steps a request took: its forward passes minus the prefill."""
    return {a.key: a.value.int_value for a in root.attributes}["specdec.forward_passes"] - 1


def test_a_hanging_collector_neither_blocks_generation_nor_shutdown(tiny_model_dir):
    with receiver(hang=True) as (collector, port):
        env = otel_env(port, "specdec-verifier")
        with pair(tiny_model_dir, env_verifier=env) as (_, verifier, _):
            stub = rpc.VerifierStub(verifier.channel)
            # Export calls hang in the collector; requests must not wait for them.
            responses = [stub.Generate(pb.GenerateRequest(prompt_token_ids=[9, 3, 9, 3], max_new_tokens=16), timeout=60) for _ in range(3)]
            assert all(len(r.token_ids) == 16 for r in responses)
            assert len({tuple(r.token_ids) for r in responses}) == 1
            # SIGTERM: the tracer gives the collector a bounded time, then the process exits 0.
            assert verifier.terminate(timeout_s=30) == 0


PROMETHEUS = shutil.which("prometheus")


def test_prometheus_scrapes_both_services(tiny_model_dir, tmp_path):
    assert PROMETHEUS, "Prometheus is needed: apt-get install -y prometheus (Debian)"
    with pair(tiny_model_dir, metrics=True) as (_, verifier, (drafter_metrics, verifier_metrics)):
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - {{job_name: specdec-drafter, static_configs: [{{targets: ['127.0.0.1:{drafter_metrics}']}}]}}\n"
            f"  - {{job_name: specdec-verifier, static_configs: [{{targets: ['127.0.0.1:{verifier_metrics}']}}]}}\n"
        )
        web = free_port()
        server = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            stub = rpc.VerifierStub(verifier.channel)
            for prompt in ([5, 6, 7, 5, 6, 7, 5], [9, 9, 9, 9], [1, 2, 3]):
                stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=10, num_speculative_tokens=4), timeout=60)
            with pytest.raises(grpc.RpcError) as refused:  # a token outside the vocabulary
                stub.Generate(pb.GenerateRequest(prompt_token_ids=[10**6], max_new_tokens=10), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            def query(expression: str) -> float | None:
                url = f"http://127.0.0.1:{web}/api/v1/query?query={urllib.parse.quote(expression)}"
                try:
                    result = json.load(urllib.request.urlopen(url, timeout=5))["data"]["result"]
                except OSError:
                    return None  # Prometheus still starting
                return float(result[0]["value"][1]) if result else None

            # The counters as Prometheus scraped them, once a scrape after the requests came in.
            wait_for(lambda: query("sum(specdec_verifier_requests_total)") == 3, "3 requests in Prometheus")
            # The refused request came last: once a scrape holds it, it holds everything before.
            refused_duration = 'sum(gen_ai_server_request_duration_seconds_count{error_type="INVALID_ARGUMENT"})'
            wait_for(lambda: query(refused_duration) == 1, "the refused request's duration in Prometheus")
            assert query("sum(specdec_verifier_generated_tokens_total)") == 30
            assert query('specdec_verifier_requests_total{finish_reason="length"}') == 3
            drafted = query("specdec_verifier_draft_tokens_total")
            accepted = query("specdec_verifier_accepted_tokens_total")
            assert drafted is not None and accepted is not None and 0 <= accepted <= drafted
            # Every verifier series names its model; the prompts' 14 tokens were prefilled.
            assert query(f'sum(specdec_verifier_generated_tokens_total{{model_name="{tiny_model_dir}"}})') == 30
            assert query(f'sum(specdec_verifier_prompt_tokens_total{{model_name="{tiny_model_dir}"}})') == 14
            # vLLM's acceptance by position counts from 0: position 0 is scored once per draft.
            assert query('sum(specdec_verifier_drafted_by_position_total{position="0"})') == query("sum(specdec_verifier_drafts_total)")
            # The GenAI server metrics: three answered requests and one refused, by its status.
            answered = '{gen_ai_operation_name="text_completion", error_type=""}'
            assert query(f"sum(gen_ai_server_request_duration_seconds_count{answered})") == 3
            assert query(f"sum(gen_ai_server_time_to_first_token_seconds_count{answered})") == 3
            assert query(f"sum(gen_ai_server_time_per_output_token_seconds_count{answered})") == 3
            assert query("sum(specdec_verifier_kv_cache_usage_perc)") == 0  # nothing running
            # Targets are scraped at staggered offsets: the drafter's first scrape may come later.
            wait_for(lambda: query('up{job="specdec-drafter"}') == 1, "a scrape of the drafter")
            wait_for(lambda: query("specdec_drafter_propose_calls_total"), "the drafter's propose calls")
            # The three finished requests reach the drafter's table in the background.
            wait_for(lambda: query("sum(specdec_drafter_table_entries)"), "observed n-grams in the drafter's table")
            assert query("sum(specdec_drafter_table_successor_entries)") is not None
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_the_metrics_reference_lists_every_metric_each_service_exposes(tiny_model_dir):
    with pair(tiny_model_dir, metrics=True) as (_, verifier, (drafter_metrics, verifier_metrics)):
        stub = rpc.VerifierStub(verifier.channel)
        stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 5, 6, 7], max_new_tokens=4, num_speculative_tokens=2), timeout=60)
        assert exposed_metrics(verifier_metrics) == documented_metrics("Verifier")
        assert exposed_metrics(drafter_metrics) == documented_metrics("Drafter")
