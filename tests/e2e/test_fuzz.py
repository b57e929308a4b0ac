"""Property-based fuzzing of both services' RPCs, as a hostile but well-typed client.

Hypothesis builds random messages over every field: extreme float32s
(subnormals, 3.4e38, inf, NaN), the whole uint32/uint64 ranges, empty and
long repeated fields, unicode strings and long prompts. Each goes to a live
service (the tiny model) while a canary thread keeps sending an ordinary
request beside it. Invariants:

* every call either succeeds or fails with a status that blames the caller
  (never INTERNAL, UNKNOWN or UNAVAILABLE), within its deadline;
* the canary's answers never change, and the service stays SERVING;
* the drafter's tables pass ``drafter_service.check`` afterwards.

The example budget is ``--fuzz-examples`` (default 60 per service in
``make test``; ``pytest tests/e2e/test_fuzz.py --fuzz-examples 5000`` runs long).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc
from verifier_service.core.engine import reference_greedy

from processes import ServiceProcess

CALL_TIMEOUT_S = 60
MAX_NEW_TOKENS_LIMIT = 40
MAX_VOCABULARIES = 3
# Statuses that say the caller asked for something it may not have.
VERIFIER_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
DRAFTER_REFUSALS = VERIFIER_REFUSALS | {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
CANARY_PROMPT = [9, 3, 3, 9, 3, 3, 9, 3]
CANARY_TOKENS = 12

# -- strategies ---------------------------------------------------------------------------

UINT32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2, 63, 64, 65, 2**16, 2**31 - 1, 2**31, 2**32 - 1]))
UINT64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]))
TOKEN = st.one_of(st.integers(0, 70), UINT32)  # mostly in the tiny vocabulary (64), sometimes far out
EXTREME_FLOATS = [
    0.0,
    -0.0,
    1e-45,
    1e-44,
    1.2e-38,
    3.3e-38,
    1e-6,
    1e-5,
    0.5,
    1.0,
    1.0000001,
    2.0,
    1e30,
    3.4e38,
    math.inf,
    -math.inf,
    math.nan,
    -1.0,
    -1e-45,
]
FLOAT32 = st.one_of(st.floats(width=32), st.sampled_from(EXTREME_FLOATS))
TEXT = st.one_of(st.text(max_size=40), st.text(alphabet="t0123456789 ", max_size=200), st.text(min_size=300, max_size=2000))


def token_lists(max_size: int) -> st.SearchStrategy:
    return st.one_of(st.lists(TOKEN, max_size=16), st.lists(TOKEN, max_size=max_size))


VALID_FLOATS = [0.0, 1e-45, 1e-44, 1.2e-38, 3.3e-38, 1e-6, 1e-5, 1.0, 1e30, 3.4e38]
PROMPT_TEXT = st.one_of(
    st.lists(st.integers(0, 63), min_size=1, max_size=300).map(lambda ids: " ".join(f"t{i}" for i in ids)),
    st.text(min_size=1, max_size=40).filter(str.strip),
    st.text(min_size=300, max_size=2000).filter(str.strip),
)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """Half are valid in every field (so generation itself is fuzzed); in the other half
    each field is anything of its type one time in two."""
    wild = draw(st.booleans())

    def pick(valid: st.SearchStrategy, anything: st.SearchStrategy):
        return draw(st.one_of(valid, anything) if wild else valid)

    fields = {
        "max_new_tokens": pick(st.integers(1, MAX_NEW_TOKENS_LIMIT), UINT32),
        "temperature": pick(st.one_of(st.floats(0, 4, width=32), st.sampled_from(VALID_FLOATS)), FLOAT32),
        "top_p": pick(st.one_of(st.floats(0, 1, width=32), st.sampled_from([1e-45, 1e-30, 0.999999])), FLOAT32),
        "top_k": draw(UINT32),
        "stop": pick(
            st.lists(
                st.one_of(
                    st.text(min_size=1, max_size=6),
                    st.text(alphabet="t0123456789 ", min_size=1, max_size=8),
                    st.text(min_size=200, max_size=256),
                ),
                max_size=4,
            ),
            st.lists(st.one_of(st.text(max_size=6), st.text(min_size=200, max_size=300)), max_size=20),
        ),
    }
    text, ids = pick(st.sampled_from([(True, False), (False, True)]), st.tuples(st.booleans(), st.booleans()))
    if text:
        fields["prompt"] = pick(PROMPT_TEXT, TEXT)
    if ids:
        fields["prompt_token_ids"] = pick(st.lists(st.integers(0, 63), min_size=1, max_size=300), token_lists(700))
    fields["chat"] = pick(st.just(False) if ids else st.booleans(), st.booleans())
    if draw(st.booleans()):
        fields["seed"] = draw(UINT64)
    if draw(st.booleans()):
        fields["num_speculative_tokens"] = pick(st.integers(0, 16), UINT32)
    return pb.GenerateRequest(**fields)


VOCABULARY = "00112233445566aa"
SESSION_IDS = st.sampled_from(["s0", "s1", "s2", "s3"])


@st.composite
def drafter_calls(draw) -> tuple[str, object]:
    """Half valid in every field (sessions open, draft and close; tables grow), half wild."""
    wild = draw(st.booleans())

    def pick(valid: st.SearchStrategy, anything: st.SearchStrategy):
        return draw(st.one_of(valid, anything) if wild else valid)

    vocabulary = pick(st.just(VOCABULARY), st.one_of(st.from_regex(r"\A[0-9a-f]{16}\Z"), st.text(max_size=40)))
    tokens = st.one_of(st.lists(st.integers(0, 40), max_size=64), st.lists(st.integers(0, 50_000), max_size=3000))
    any_tokens = token_lists(3000)
    session_id = pick(SESSION_IDS, st.one_of(st.text(max_size=30), st.text(min_size=200, max_size=400)))
    observe_id = pick(st.text(alphabet="abcdef0123456789-", min_size=1, max_size=40), st.text(max_size=300))
    method = draw(st.sampled_from(["Propose", "Observe", "CloseSessions", "Stats", "Backup", "Forget"]))
    if method == "Propose":
        updates = []
        for _ in range(draw(st.integers(0, 3 if not wild else 40))):
            verified = pick(st.integers(0, 8), UINT32)
            updates.append(
                drafter_pb2.SequenceUpdate(
                    session_id=pick(SESSION_IDS, st.text(max_size=300)),
                    new_tokens=pick(tokens, any_tokens),
                    open=draw(st.booleans()),
                    num_draft_tokens=pick(st.integers(0, 16), UINT32),
                    verified_draft_tokens=verified,
                    accepted_draft_tokens=pick(st.integers(0, verified), UINT32),
                )
            )
        return method, drafter_pb2.ProposeRequest(vocabulary=vocabulary, sequences=updates)
    if method == "Observe":
        sequences = [drafter_pb2.TokenSequence(tokens=pick(tokens, any_tokens)) for _ in range(draw(st.integers(0, 20)))]
        return method, drafter_pb2.ObserveRequest(vocabulary=vocabulary, observe_id=observe_id, sequences=sequences)
    if method == "CloseSessions":
        return method, drafter_pb2.CloseSessionsRequest(
            vocabulary=vocabulary,
            session_ids=[session_id for _ in range(draw(st.integers(0, 20)))],
            observe=draw(st.booleans()),
            observe_id=observe_id,
        )
    if method == "Stats":
        return method, drafter_pb2.StatsRequest(vocabulary=pick(st.sampled_from(["", VOCABULARY]), st.text(max_size=40)))
    if method == "Forget":  # never the default scope, which the other calls learn into
        return method, drafter_pb2.ForgetRequest(vocabulary=vocabulary, scope=pick(st.just("cd" * 16), st.text(min_size=1, max_size=80)))
    return method, drafter_pb2.BackupRequest(vocabulary=vocabulary, destination=draw(st.text(max_size=200)))


# -- the canary ---------------------------------------------------------------------------


class Canary:
    """Sends ``call()`` over and over on a thread; records every answer that is not ``expected``."""

    def __init__(self, call, expected) -> None:
        self.call, self.expected = call, expected
        self.answers, self.wrong = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                answer = self.call()
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full queue: the fuzzer's requests beside it
                    time.sleep(0.05)
                    continue
                answer = f"{error.code().name}: {error.details()}"
            self.answers += 1
            if answer != self.expected:
                self.wrong.append(answer)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT_S)


def assert_serving(service: ServiceProcess) -> None:
    assert service.process.poll() is None, f"the service died:\n{service.log()}"
    response = health_pb2_grpc.HealthStub(service.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def refusal(outcomes: Counter, error: grpc.RpcError, allowed: set, what: str) -> None:
    """Count a failed call, which must be one of the ``allowed`` refusals and say why."""
    assert error.code() in allowed, f"{error.code().name}: {error.details()} for {what}"
    assert error.details(), "a refusal must say why"
    outcomes[error.code().name] += 1


def fuzz_beside(service: ServiceProcess, canary: Canary, fuzz, outcomes: Counter) -> None:
    """Run the hypothesis test ``fuzz`` while ``canary`` runs, then check what every fuzz run must leave."""
    try:
        fuzz()
    finally:
        canary.stop()
    assert canary.wrong == [], canary.wrong[:3]
    assert canary.answers > 0
    assert_serving(service)
    assert outcomes["OK"] > 0 and outcomes["INVALID_ARGUMENT"] > 0, outcomes  # both sides were explored


def fuzz_settings(request) -> settings:
    return settings(
        max_examples=request.config.getoption("--fuzz-examples"),
        deadline=None,
        derandomize=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )


# -- services -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    db = tmp_path_factory.mktemp("fuzz-drafter") / "db"
    service = ServiceProcess(
        "drafter_service", "--port", "0", "--db", str(db), "--metrics-port", "-1", "--max-vocabularies", str(MAX_VOCABULARIES)
    )
    try:
        service.wait_until_serving("", 60)
        service.db = db
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def verifier(drafter, tiny_model_dir):
    service = ServiceProcess(
        "verifier_service",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--model",
        str(tiny_model_dir),
        "--no-calibrate",
        "--drafter",
        drafter.address,
        "--drafter-timeout-seconds",
        "5",
        "--max-new-tokens",
        str(MAX_NEW_TOKENS_LIMIT),
        env={**os.environ},
    )
    try:
        service.wait_until_serving("specdec.v1.Verifier", 120)
        yield service
    finally:
        service.stop()


# -- the tests ------------------------------------------------------------------------------


def test_fuzzed_generate_requests_never_fail_internally_nor_disturb_a_neighbour(verifier, tiny_model, request):
    stub = rpc.VerifierStub(verifier.channel)
    eos = frozenset({tiny_model.config.eos_token_id})
    expected = reference_greedy(tiny_model, CANARY_PROMPT, CANARY_TOKENS, eos)
    canary = Canary(
        lambda: list(
            stub.Generate(
                pb.GenerateRequest(prompt_token_ids=CANARY_PROMPT, max_new_tokens=CANARY_TOKENS, num_speculative_tokens=4),
                timeout=CALL_TIMEOUT_S,
            ).token_ids
        ),
        expected,
    )
    outcomes = Counter()

    @fuzz_settings(request)
    @given(generation=generate_requests(), streamed=st.booleans())
    def one(generation, streamed):
        try:
            if streamed:
                chunks = list(stub.GenerateStream(generation, timeout=CALL_TIMEOUT_S))
                tokens = [t for chunk in chunks for t in chunk.token_ids]
                finish_reason = chunks[-1].finish_reason
            else:
                response = stub.Generate(generation, timeout=CALL_TIMEOUT_S)
                tokens, finish_reason = list(response.token_ids), response.finish_reason
        except grpc.RpcError as error:
            refusal(outcomes, error, VERIFIER_REFUSALS, generation)
            return
        assert finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert 1 <= len(tokens) <= generation.max_new_tokens and all(0 <= t < 64 for t in tokens)
        outcomes["OK"] += 1

    fuzz_beside(verifier, canary, one, outcomes)


def test_fuzzed_drafter_calls_never_fail_internally_nor_disturb_a_neighbour(drafter, request):
    stub = drafter_pb2_grpc.DrafterStub(drafter.channel)
    vocabulary = VOCABULARY
    context = [5, 6, 7, 8] * 4  # its own repeats draft the next tokens from context

    def canary_call():
        session = f"canary-{time.monotonic_ns()}"  # the fuzzer cannot guess it
        opened = drafter_pb2.SequenceUpdate(session_id=session, new_tokens=context, open=True, num_draft_tokens=4)
        draft = stub.Propose(drafter_pb2.ProposeRequest(vocabulary=vocabulary, sequences=[opened]), timeout=CALL_TIMEOUT_S).drafts[0]
        stub.CloseSessions(drafter_pb2.CloseSessionsRequest(vocabulary=vocabulary, session_ids=[session]), timeout=CALL_TIMEOUT_S)
        return list(draft.tokens)

    canary = Canary(canary_call, [5, 6, 7, 8])
    outcomes = Counter()

    @fuzz_settings(request)
    @given(call=drafter_calls())
    def one(call):
        method, message = call
        try:
            getattr(stub, method)(message, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            refusal(outcomes, error, DRAFTER_REFUSALS, f"{method}({message})")
            return
        outcomes["OK"] += 1

    fuzz_beside(drafter, canary, one, outcomes)
    # What the fuzzer stored is a sound table: stop the drafter and check every one on disk.
    drafter.terminate()
    result = subprocess.run(
        [sys.executable, "-m", "drafter_service.check", "--db", str(drafter.db)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
