"""The agentic benchmark's turns through both services: a real drafter and verifier on loopback,
each turn of N agent loops sent as N concurrent ``Generate`` calls.

``ServicePair`` starts ``bench.bench_spec_service.Pair``: a drafter on an empty table (a
folder of its own, a free port) and a verifier using it with the defaults, so learning is on
(the verifier observes every finished speculative request into the drafter's global table,
in the background; a plain request, ``num_speculative_tokens`` 0, never touches the
drafter). Its /metrics port is the one addition: the verifier counts its steps there, and a
client sees no other trace of which forward passes its requests shared.

A turn's prompts go as token ids (``prompt_token_ids``), already chat-templated by the
caller, greedy, so the verifier decodes exactly the prompts the in-process methods get.
``generate_together`` sends them from one thread each and times them as a client would:
each request from its call to its response, the batch from the first call to the last
response. ``steps`` is how many steps the verifier's scheduler ran in between (every forward
pass, prefill chunks included, each once however many requests it carried), read from
``specdec_verifier_step_seconds_count`` before and after; the verifier records a step just
after it hands out that step's results, so the count can lag by the batch's last step.
"""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.bench_spec_service import Pair
from specdec.processes import free_port
from specdec.v1 import verifier_pb2 as pb

# A 2,000-token prompt and 128 tokens behind 15 others take seconds on a 2-core CPU, not
# minutes: the deadline only keeps a wedged verifier from hanging the benchmark.
REQUEST_TIMEOUT_S = 600
METRICS_TIMEOUT_S = 10
# The verifier's histogram of step times: its count is the steps it ran (metrics.VerifierMetrics).
STEPS_METRIC = "specdec_verifier_step_seconds_count"
FORM_METRIC = "specdec_verifier_model_info"
# The drafter applies what the verifier observed in the background; between phases it gets
# this long, as bench_spec_service gives its writer before a kill.
OBSERVE_SETTLE_S = 1.0


@dataclass(frozen=True)
class Answer:
    token_ids: list[int]
    seconds: float  # from the call to its response
    stats: pb.GenerationStats  # the verifier's, for this request alone


@dataclass(frozen=True)
class Together:
    answers: list[Answer]  # in prompt order
    seconds: float  # from the first call to the last response
    steps: int | None  # the verifier's steps in between (None: not read)


def generate_request(prompt_ids: list[int], max_new_tokens: int, k: int | None) -> pb.GenerateRequest:
    """Greedy, the ids sent as they are (no template: they have it); K 0 is plain, unset the default (adaptive)."""
    request = pb.GenerateRequest(prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens, temperature=0.0)
    if k is not None:
        request.num_speculative_tokens = k
    return request


def metric_value(text: str, name: str) -> float | None:
    """The first sample of ``name`` in a Prometheus exposition, labels or not (None: absent).
    'x_count{model_name="m"} 12.0' -> 12.0."""
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def metric_labels(text: str, name: str) -> dict[str, str]:
    """The labels of ``name``'s first sample: 'x_info{dtype="bfloat16",threads="2"} 1.0' -> {dtype: bfloat16, threads: 2}."""
    match = re.search(rf"^{re.escape(name)}\{{([^}}]*)\}}", text, re.MULTILINE)
    return dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) if match else {}


class ServicePair:
    """A drafter on an empty table under ``folder`` and a verifier using it, its /metrics on a free port."""

    def __init__(self, folder: Path, verifier_flags: tuple[str, ...] = ()) -> None:
        # Pair turns the verifier's metrics off; a later flag wins, so this turns them on again.
        self.pair = Pair(folder / "drafter-db", free_port(), (*verifier_flags, "--metrics-port", "0"))
        try:
            assert self.pair.verifier is not None  # Pair raised otherwise
            self.metrics_port = self.pair.verifier.announced_port("metrics")
        except BaseException:
            self.pair.stop()
            raise

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S).read().decode()

    def steps(self) -> int | None:
        value = metric_value(self.metrics(), STEPS_METRIC)
        return None if value is None else int(value)

    def form(self) -> dict[str, str]:
        """The form the verifier serves the model in (its dtype, weights, threads, passes)."""
        return metric_labels(self.metrics(), FORM_METRIC)

    def generate_together(self, prompts: list[list[int]], max_new_tokens: int, k: int | None) -> Together:
        requests = [generate_request(ids, max_new_tokens, k) for ids in prompts]
        before = self.steps()
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            started = time.perf_counter()
            answers = list(pool.map(self._answer, requests))  # re-raises a call's RpcError
            seconds = time.perf_counter() - started
        after = self.steps()
        return Together(answers, seconds, None if before is None or after is None else after - before)

    def _answer(self, request: pb.GenerateRequest) -> Answer:
        started = time.perf_counter()
        response = self.pair.stub.Generate(request, timeout=REQUEST_TIMEOUT_S)
        return Answer(list(response.token_ids), time.perf_counter() - started, response.stats)

    def settle(self) -> None:
        """Give the drafter time to apply what the verifier observed (between phases)."""
        time.sleep(OBSERVE_SETTLE_S)

    def stop(self) -> None:
        self.pair.stop()
