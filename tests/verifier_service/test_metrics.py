"""The verifier's Prometheus metrics: what each family counts, its labels, and the GenAI
server metrics of requests served in process over HTTP (the tiny model)."""

from __future__ import annotations

import copy

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from specdec import telemetry
from tests.verifier_service.test_http_api import CAPACITY, CHAT_TEMPLATE, chat_body, completion
from verifier_service.core.engine import EngineConfig, SpeculativeEngine
from verifier_service.core.generation import GenerationRequest
from verifier_service.serving.config import VerifierConfig
from verifier_service.serving.metrics import VerifierMetrics
from verifier_service.serving.observability import ServiceObserver
from verifier_service.serving.openai_api import OpenAIApi
from verifier_service.serving.scheduler import Scheduler, SchedulerConfig
from verifier_service.serving.service import VerifierService

MODEL = "tiny-model"
GEN_AI = {"gen_ai_provider_name": "specdec", "gen_ai_request_model": MODEL, "gen_ai_response_model": MODEL}


def value(metrics: VerifierMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": metrics.model_name, **labels})


def test_acceptance_by_position_counts_from_0_as_vllm_does():
    metrics = VerifierMetrics(MODEL)
    # Three sequences: 3 drafts with 2 accepted, 1 draft with 0 accepted, no draft at all.
    metrics.record_step(0.05, [(3, 2, 3), (1, 0, 1), (0, 0, 1)])
    drafted = {position: value(metrics, "specdec_verifier_drafted_by_position_total", position=str(position)) for position in range(4)}
    accepted = {position: value(metrics, "specdec_verifier_accepted_by_position_total", position=str(position)) for position in range(4)}
    assert drafted == {0: 2, 1: 1, 2: 1, 3: None}
    assert accepted == {0: 1, 1: 1, 2: None, 3: None}  # the first sequence's positions 0 and 1
    assert value(metrics, "specdec_verifier_drafts_total") == 2  # vLLM's num_drafts: steps with a draft
    assert (value(metrics, "specdec_verifier_draft_tokens_total"), value(metrics, "specdec_verifier_accepted_tokens_total")) == (4, 2)
    assert value(metrics, "specdec_verifier_generated_tokens_total") == 5
    assert value(metrics, "specdec_verifier_forward_passes_total") == 3


def test_positions_past_the_last_label_share_it():
    metrics = VerifierMetrics(MODEL)
    metrics.record_step(0.05, [(20, 20, 21)])
    assert value(metrics, "specdec_verifier_drafted_by_position_total", position="15") == 5  # positions 15 .. 19
    assert value(metrics, "specdec_verifier_drafted_by_position_total", position="16") is None


def test_time_per_output_token_is_the_time_after_the_first_token_per_later_token():
    metrics = VerifierMetrics(MODEL)
    metrics.record_request("chat", 2.5, first_token_s=0.5, output_tokens=5)  # 2 s for 4 tokens after the first
    labels = {"gen_ai_operation_name": "chat", **GEN_AI}
    assert value(metrics, "gen_ai_server_time_per_output_token_seconds_sum", **labels) == pytest.approx(0.5)
    assert value(metrics, "gen_ai_server_time_to_first_token_seconds_sum", **labels) == pytest.approx(0.5)
    assert value(metrics, "gen_ai_server_request_duration_seconds_sum", **labels, error_type="") == pytest.approx(2.5)
    # One token: no time per output token to speak of; a failure: its duration alone, by error type.
    metrics.record_request("chat", 1.0, first_token_s=0.9, output_tokens=1)
    metrics.record_request("chat", 0.2, "RESOURCE_EXHAUSTED")
    assert value(metrics, "gen_ai_server_time_per_output_token_seconds_count", **labels) == 1
    assert value(metrics, "gen_ai_server_time_to_first_token_seconds_count", **labels) == 2
    assert value(metrics, "gen_ai_server_request_duration_seconds_count", **labels, error_type="RESOURCE_EXHAUSTED") == 1


def test_every_family_carries_the_model_name():
    metrics = VerifierMetrics(MODEL)
    metrics.watch("drafter_fallbacks", "fallbacks", lambda: 3.0)
    metrics.record_step(0.05, [(2, 1, 2)])
    metrics.record_prefill(7, 1, 0.01, 0.02)
    metrics.record_sequence("length")
    metrics.record_request("text_completion", 1.0, first_token_s=0.1, output_tokens=3)
    for gauge in (metrics.queue_depth, metrics.active_sequences):
        gauge.set_function(lambda: 0.5)
    metrics.watch_cache_usage(lambda: (0.5, 0.5))
    families = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    assert len(families) >= 20
    for family in families:
        assert family.samples, family.name
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, (family.name, sample)


def test_the_served_form_is_a_labelled_info_sample():
    metrics = VerifierMetrics(MODEL)
    metrics.describe_form({"dtype": "bfloat16", "weights": "int4", "threads": 2, "batch_invariant": True})
    form = {"dtype": "bfloat16", "weights": "int4", "threads": "2", "batch_invariant": "true"}
    assert value(metrics, "specdec_verifier_model_info", **form) == 1.0
    metrics.describe_form({"dtype": "float32", "weights": "float", "threads": 1, "batch_invariant": False})
    assert value(metrics, "specdec_verifier_model_info", **form) is None  # one form at a time


def test_a_scrape_reads_the_cache_usage_once_for_both_gauges():
    metrics = VerifierMetrics(MODEL)
    assert value(metrics, "specdec_verifier_kv_cache_usage_perc") == 0.0  # no engine yet: 0, as an unset gauge
    readings: list[tuple[float, float]] = []

    def cache_usage() -> tuple[float, float]:
        # Each reading differs from the last, as the engine's do while it steps: a gauge
        # that read again would show the next reading's share, not this one's.
        readings.append((0.125 * (len(readings) + 1), 0.25 * (len(readings) + 1)))
        return readings[-1]

    metrics.watch_cache_usage(cache_usage)
    families = {family.name: family for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    assert len(readings) == 1
    tokens, slots = families["specdec_verifier_kv_cache_usage_perc"], families["specdec_verifier_kv_cache_slot_usage_perc"]
    assert [(sample.value, sample.labels) for sample in tokens.samples + slots.samples] == [
        (0.125, {"model_name": MODEL}),  # both of the one reading
        (0.25, {"model_name": MODEL}),
    ]
    assert (tokens.type, tokens.documentation) == ("gauge", "Fraction of the KV cache's token positions held, 0 to 1")
    assert (slots.type, slots.documentation) == ("gauge", "Fraction of the KV cache's sequence slots in use, 0 to 1")
    generate_latest(metrics.registry)
    assert len(readings) == 2  # one more scrape, one more reading


@pytest.fixture(scope="module")
def observed_service(tiny_model, tiny_tokenizer):
    """The HTTP API over a scheduler whose steps report to the metrics, as the server wires it."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = VerifierConfig(model=MODEL, engine=EngineConfig(max_batch_size=2, max_sequence_tokens=CAPACITY))
    service = VerifierService(config, telemetry.Tracing("test"), VerifierMetrics(config.model))
    engine = SpeculativeEngine(tiny_model, tokenizer, None, config.engine)
    scheduler = Scheduler(engine, SchedulerConfig(), ServiceObserver(service.tracing, service.metrics))
    scheduler.start()
    service.attach(engine, scheduler)
    yield service
    scheduler.stop(1.0)


def test_http_requests_are_measured_per_operation(observed_service):
    metrics = observed_service.metrics
    client = TestClient(OpenAIApi(observed_service, MODEL).app, base_url="http://localhost")  # a name 127.0.0.1 answers to
    chat = client.post("/v1/chat/completions", json=chat_body(n=2, max_tokens=4)).json()
    text = client.post("/v1/completions", json=completion(max_tokens=3)).json()
    # A request refused once its span began (max_tokens over the cache): its duration, by HTTP status.
    refused = client.post("/v1/completions", json=completion(max_tokens=10 * CAPACITY))
    assert refused.status_code == 400, refused.text

    chat_labels, text_labels = {"gen_ai_operation_name": "chat", **GEN_AI}, {"gen_ai_operation_name": "text_completion", **GEN_AI}
    # One observation per request: the chat's two choices are one operation.
    assert value(metrics, "gen_ai_server_time_to_first_token_seconds_count", **chat_labels) == 1
    assert value(metrics, "gen_ai_server_time_per_output_token_seconds_count", **chat_labels) == 1
    assert value(metrics, "gen_ai_server_request_duration_seconds_count", **chat_labels, error_type="") == 1
    assert value(metrics, "gen_ai_server_request_duration_seconds_count", **text_labels, error_type="") == 1
    assert value(metrics, "gen_ai_server_request_duration_seconds_count", **text_labels, error_type="400") == 1
    assert value(metrics, "gen_ai_server_time_to_first_token_seconds_count", **text_labels) == 1  # the refused one has none
    # The engine's counters, per sequence: three sequences prefilled and finished.
    prompt_tokens = chat["usage"]["prompt_tokens"] * 2 + text["usage"]["prompt_tokens"]
    generated = chat["usage"]["completion_tokens"] + text["usage"]["completion_tokens"]
    assert value(metrics, "specdec_verifier_prompt_tokens_total") == prompt_tokens
    assert value(metrics, "specdec_verifier_generated_tokens_total") == generated
    assert value(metrics, "specdec_verifier_request_queue_seconds_count") == 3
    assert value(metrics, "specdec_verifier_request_prefill_seconds_count") == 3
    assert value(metrics, "specdec_verifier_requests_total", finish_reason="length") == 3


def test_kv_cache_usage_follows_the_sequences_in_slots(tiny_model, tiny_tokenizer):
    engine = SpeculativeEngine(tiny_model, tiny_tokenizer, None, EngineConfig(max_batch_size=2, max_sequence_tokens=64))
    assert engine.cache_usage() == (0.0, 0.0)
    engine.add(GenerationRequest([5, 9, 14, 20], 3, num_speculative_tokens=0))
    engine.step()  # the prompt's 4 tokens are cached; its first token is not yet
    tokens, slots = engine.cache_usage()
    assert slots == 0.5
    assert tokens == pytest.approx(4 / (2 * engine.cache.capacity))
    while engine.busy:
        engine.step()
    assert engine.cache_usage() == (0.0, 0.0)
