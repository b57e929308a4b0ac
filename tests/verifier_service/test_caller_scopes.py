"""Learning scopes from the verifier's side: each caller's requests draft from and learn in
its own scope, and the drafter is told only an unguessable id.

The last tests run the whole path in-process: a verifier with two API keys (its engine
on the tiny model), a real drafter on a loopback port with no authentication (the first
set-up a user makes), and the gRPC and HTTP front doors.
"""

from __future__ import annotations

import copy
import json
import time

import anyio
import pytest
from starlette.testclient import TestClient

from drafter_service.server import DrafterConfig, create_server
from specdec import telemetry
from specdec.v1 import verifier_pb2 as pb
from specdec.vocabulary import tokenizer_fingerprint
from tests.verifier_service.test_rejected_drafts import grpc_door
from verifier_service.core.engine import EngineConfig, SpeculativeEngine
from verifier_service.serving.config import VerifierConfig
from verifier_service.serving.drafter_client import DrafterClientConfig, RemoteDrafter
from verifier_service.serving.metrics import VerifierMetrics
from verifier_service.serving.openai_api import CERTIFICATE_STATE, OpenAIApi, _Callers, _common_name
from verifier_service.serving.scheduler import Scheduler, SchedulerConfig
from verifier_service.serving.scopes import DEFAULT_SCOPE, SECRET_FILE_NAME, KeyEntry, ScopeIds, load_secret, parse_key_line
from verifier_service.serving.service import ApiKeys, VerifierService

SECRET = "a-server-secret-of-32-characters"
# Upper bound on waiting for background work (the drafter storing an observation); never a pass/fail threshold.
DEADLINE_S = 30


def test_key_lines_name_an_optional_scope():
    assert parse_key_line("sk-1", "line 1") == KeyEntry("sk-1", None)
    assert parse_key_line("sk-1   scope=acme.prod_2", "line 1") == KeyEntry("sk-1", "acme.prod_2")
    for line, message in (
        ("sk-1 team=acme", "only scope=NAME may follow"),
        ("sk-1 scope=", "a scope's name is 1-64"),
        ("sk-1 scope=../etc", "a scope's name is 1-64"),
        ("sk-1 scope=a scope=b", "scope= is given twice"),
    ):
        with pytest.raises(ValueError, match=message) as raised:
            parse_key_line(line, "line 3 of --api-key-file")
        assert str(raised.value).startswith("line 3 of --api-key-file: ") and "sk-1" not in str(raised.value)


def test_scope_ids_are_keyed_and_an_organisations_keys_share_one():
    ids = ScopeIds(SECRET.encode())
    alice, bob = ids.of_key("alice", None), ids.of_key("bob", None)
    assert alice != bob and len(alice) == 32 and int(alice, 16) >= 0
    assert ids.of_key("alice", "acme") == ids.of_key("bob", "acme") == ids.of_name("acme") != alice
    assert ids.of_certificate("alice") != alice  # a certificate named like a key is another caller
    assert ScopeIds(b"another-secret-of-enough-length").of_key("alice", None) != alice  # nobody without the secret computes it
    assert DEFAULT_SCOPE not in (alice, bob)


def test_the_secret_is_given_or_kept_in_the_cache_folder(tmp_path):
    assert load_secret(SECRET, None, tmp_path) == SECRET.encode()
    (tmp_path / "secret").write_text(SECRET + "\nignored\n")
    assert load_secret(None, str(tmp_path / "secret"), tmp_path) == SECRET.encode()
    with pytest.raises(ValueError, match="at least 16 characters"):
        load_secret("short", None, tmp_path)
    with pytest.raises(ValueError, match="cannot read --scope-secret-file"):
        load_secret(None, str(tmp_path / "missing"), tmp_path)
    kept = load_secret(None, None, tmp_path / "cache")
    assert load_secret(None, None, tmp_path / "cache") == kept  # a restart keeps every scope's id
    assert (tmp_path / "cache" / SECRET_FILE_NAME).stat().st_mode & 0o777 == 0o600
    assert load_secret(None, None, tmp_path / "other") != kept


def test_the_key_file_puts_keys_into_scopes_and_names_the_shared_one(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team a\nk-alice scope=acme\nk-bob scope=acme\nk-carol\nk-docs scope=docs\n")
    config = VerifierConfig(api_key="k-flag", api_key_file=str(keys), shared_scope="docs", scope_secret=SECRET)
    assert config.key_entries() == (
        KeyEntry("k-flag", None),
        KeyEntry("k-alice", "acme"),
        KeyEntry("k-bob", "acme"),
        KeyEntry("k-carol", None),
        KeyEntry("k-docs", "docs"),
    )
    assert config.api_keys() == ("k-flag", "k-alice", "k-bob", "k-carol", "k-docs")
    with pytest.raises(ValueError, match="--shared-scope 'nobody' is no scope of --api-key-file"):
        VerifierConfig(api_key_file=str(keys), shared_scope="nobody")


def test_each_caller_gets_its_keys_scope_and_an_open_server_the_default(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k-alice scope=acme\nk-bob scope=acme\nk-carol\nk-docs scope=docs\n")
    config = VerifierConfig(api_key_file=str(keys), shared_scope="docs", scope_secret=SECRET)
    service = VerifierService(config, telemetry.Tracing("test"), VerifierMetrics(config.model))
    ids = ScopeIds(SECRET.encode())
    callers = [service.keys.caller(key) for key in ("k-alice", "k-bob", "k-carol")]
    assert [service.scope_of(caller) for caller in callers] == [ids.of_name("acme"), ids.of_name("acme"), ids.of_key("k-carol", None)]
    assert service.shared_scope == ids.of_name("docs")
    open_config = VerifierConfig()
    open_service = VerifierService(open_config, telemetry.Tracing("test"), VerifierMetrics(open_config.model))
    assert open_service.scope_of("10.0.0.7") == DEFAULT_SCOPE and open_service.shared_scope == DEFAULT_SCOPE


def test_under_mutual_tls_a_certificate_is_a_scope(tmp_path):
    pem = tmp_path / "any.pem"
    pem.write_text("not read here")
    config = VerifierConfig(tls_cert=str(pem), tls_key=str(pem), tls_client_ca=str(pem), scope_secret=SECRET)
    service = VerifierService(config, telemetry.Tracing("test"), VerifierMetrics(config.model))
    assert service.scope_of("certificate team-a") == ScopeIds(SECRET.encode()).of_certificate("team-a")
    assert service.scope_of("certificate team-a") != service.scope_of("certificate team-b")


# -- the whole path: two API keys, one plain local drafter

PREFIX = [10, 11, 12, 13, 14, 15]
HIDDEN = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]  # alice's secret (the tiny model's vocabulary is 64)


class TwoKeys:
    """A started verifier service (keys "alice" and "bob", each its own scope) over the tiny
    model, whose drafter link reaches a real drafter on loopback with no authentication."""

    def __init__(self, model, tokenizer, tmp_path) -> None:
        self.drafter = create_server(DrafterConfig(port=0, db=str(tmp_path / "db"), grace_s=0, metrics_port=None))
        config = VerifierConfig(api_key="alice,bob", scope_secret=SECRET, engine=EngineConfig(max_batch_size=2, max_sequence_tokens=128))
        self.service = VerifierService(config, telemetry.Tracing("test"), VerifierMetrics(config.model))
        self.link = RemoteDrafter(
            DrafterClientConfig(target=f"127.0.0.1:{self.drafter.port}", vocabulary=tokenizer_fingerprint(tokenizer), timeout_s=5.0)
        )
        engine = SpeculativeEngine(model, copy.deepcopy(tokenizer), self.link, config.engine)
        engine.eos_token_ids = frozenset()
        self.scheduler = Scheduler(engine, SchedulerConfig())
        self.scheduler.start()
        self.service.attach(engine, self.scheduler)

    def wait_for_observed(self, tokens: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while self.drafter.servicer.metrics.stats()["observed_tokens"] < tokens:
            assert time.monotonic() < deadline, "the drafter never stored the finished request"
            time.sleep(0.02)

    def close(self) -> None:
        self.scheduler.stop(1.0)
        self.link.stop(timeout_s=2)
        self.drafter.stop(0)


@pytest.fixture
def two_keys(tiny_model, tiny_tokenizer, tmp_path):
    stack = TwoKeys(tiny_model, tiny_tokenizer, tmp_path)
    yield stack
    stack.close()


def grpc_stream(service, key: str, prompt: list[int]) -> list[pb.GenerateChunk]:
    with grpc_door(service) as stub:
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=8, num_speculative_tokens=8)
        return list(stub.GenerateStream(request, timeout=120, metadata=(("authorization", f"Bearer {key}"),)))


def test_another_keys_grpc_stream_never_carries_a_keys_text(two_keys):
    # Was: bob received 16 of alice's secret tokens in rejected_token_ids, from the one table every key shared.
    alice = grpc_stream(two_keys.service, "alice", PREFIX + HIDDEN)
    answer = [token for chunk in alice for token in chunk.token_ids]
    two_keys.wait_for_observed(len(PREFIX + HIDDEN + answer))
    # A prompt that runs into alice's answer: her table would draft the rest of it.
    retold = PREFIX + HIDDEN + answer[:2]
    bob = grpc_stream(two_keys.service, "bob", retold)
    # Bob's scope has learned nothing yet: no draft of his, accepted or turned down, comes from a learned table.
    assert global_sources(bob) == 0
    # Alice's own scope drafts her text back: the sharing inside a scope still works.
    assert global_sources(grpc_stream(two_keys.service, "alice", retold)) > 0


def global_sources(chunks: list[pb.GenerateChunk]) -> int:
    """Draft tokens, accepted or turned down, that came from the learned n-gram table."""
    sources = [source for chunk in chunks for source in [*chunk.token_sources, *chunk.rejected_token_sources]]
    return sources.count(pb.TOKEN_SOURCE_GLOBAL)


def test_another_keys_http_stream_never_carries_a_keys_text(two_keys):
    client = TestClient(OpenAIApi(two_keys.service, two_keys.service.config.model).app, base_url="http://localhost")

    def stream(key: str, prompt: list[int]) -> list[dict]:
        body = {
            "model": two_keys.service.config.model,
            "prompt": prompt,
            "num_speculative_tokens": 8,
            "max_tokens": 8,
            "stream": True,
            "temperature": 0,
        }
        with client.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as response:
            assert response.status_code == 200
            lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: {")]
        return [chunk.get("specdec", {}) for chunk in map(json.loads, lines)]

    answer = [token for step in stream("alice", PREFIX + HIDDEN) for token in step.get("token_ids", [])]
    two_keys.wait_for_observed(len(PREFIX + HIDDEN + answer))
    retold = PREFIX + HIDDEN + answer[:2]

    def global_drafts(steps: list[dict]) -> int:
        return [source for step in steps for source in [*step.get("sources", []), *step.get("rejected_sources", [])]].count("global")

    assert global_drafts(stream("bob", retold)) == 0
    assert global_drafts(stream("alice", retold)) > 0  # her own scope still drafts it


# -- HTTP under mutual TLS: the certificate names the caller, as on gRPC


class PeerCertificate:
    """What ``ssl.SSLObject.getpeercert()`` returns for a verified client certificate."""

    def __init__(self, subject) -> None:
        self.subject = subject

    def getpeercert(self):
        return {"subject": self.subject} if self.subject is not None else None


def test_an_http_connections_client_certificate_names_its_caller():
    subject = ((("countryName", "NL"),), (("commonName", "team-a"),))
    assert _common_name(PeerCertificate(subject)) == "team-a"
    assert _common_name(PeerCertificate(None)) is None  # TLS without a client certificate
    assert _common_name(None) is None  # plain HTTP


@pytest.mark.parametrize(
    ("state", "client", "caller"),
    [({CERTIFICATE_STATE: "team-a"}, ("10.0.0.7", 5), "certificate team-a"), ({}, ("10.0.0.7", 5), "10.0.0.7")],
)
def test_http_callers_without_keys_are_their_certificate_else_their_host(state, client, caller):
    seen = {}

    async def app(scope, receive, send):
        seen["caller"] = scope["state"]["caller"]

    scope = {"type": "http", "path": "/v1/completions", "client": client, "state": dict(state), "headers": []}
    anyio.run(_Callers(app, ApiKeys([])), scope, None, None)
    assert seen["caller"] == caller
    config = VerifierConfig(scope_secret=SECRET, tls_cert="c", tls_key="k", tls_client_ca="ca")
    service = VerifierService(config, telemetry.Tracing("test"), VerifierMetrics(config.model))
    assert (service.scope_of(seen["caller"]) != DEFAULT_SCOPE) == bool(state)
