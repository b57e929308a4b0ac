"""TLS on both services and on the verifier's channel to the drafter, with a self-signed certificate."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time

import grpc
import httpx2 as httpx
import pytest

from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

from processes import free_port, running, running_tiny_verifier


def self_signed(directory, name: str, subject_alt_name: str):
    """A self-signed certificate (its own CA): (cert path, key path)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed: apt-get install -y openssl"
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            f"/CN={name}",
            "-addext",
            f"subjectAltName={subject_alt_name}",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """The services' certificate, for 127.0.0.1."""
    return self_signed(tmp_path_factory.mktemp("tls"), "server", "IP:127.0.0.1")


@pytest.fixture(scope="module")
def client_certificate(tmp_path_factory):
    """A client's certificate: a server given it as --tls-client-ca accepts this client."""
    return self_signed(tmp_path_factory.mktemp("tls-client"), "verifier", "DNS:verifier")


def test_generate_over_tls_end_to_end(tiny_model_dir, tmp_path, certificate):
    cert, key = (str(path) for path in certificate)
    tls = ["--tls-cert", cert, "--tls-key", key]
    with running("drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(tmp_path / "db"), *tls) as drafter:
        with running_tiny_verifier(
            tiny_model_dir,
            "--drafter",
            drafter.address,
            "--drafter-tls-ca",
            cert,
            *tls,
        ) as verifier:
            credentials = grpc.ssl_channel_credentials(root_certificates=certificate[0].read_bytes())
            with grpc.secure_channel(verifier.address, credentials) as channel:
                grpc.channel_ready_future(channel).result(timeout=60)
                stub = rpc.VerifierStub(channel)
                request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6, 7, 5], max_new_tokens=16, num_speculative_tokens=4)
                response = call_when_serving(stub, request)
                assert len(response.token_ids) == 16
                # Drafts came back over the verifier's TLS channel to the drafter.
                assert response.stats.draft_tokens > 0

            # A plaintext client gets no answer from a TLS port.
            with grpc.insecure_channel(verifier.address) as plain:
                with pytest.raises(grpc.RpcError) as raised:
                    rpc.VerifierStub(plain).Generate(request, timeout=10)
                assert raised.value.code() == grpc.StatusCode.UNAVAILABLE

            # The CLI client with --tls-ca.
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "verifier_service.client",
                    "--target",
                    verifier.address,
                    "--tls-ca",
                    cert,
                    "--no-chat",
                    "--max-new-tokens",
                    "4",
                    "--json",
                    "t5 t6 t7",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert result.returncode == 0, result.stderr
            assert '"finish_reason": "length"' in result.stdout


def call_when_serving(stub, request):
    """Generate, retrying UNAVAILABLE while the model loads (health cannot be checked over
    the plaintext helper channel of a TLS server)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return stub.Generate(request, timeout=60)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.healthcheck", *args], capture_output=True, text=True, timeout=60)


def test_mutual_tls_drafter_serves_only_clients_with_a_certificate(tiny_model_dir, tmp_path, certificate, client_certificate):
    cert, key = (str(path) for path in certificate)
    client_cert, client_key = (str(path) for path in client_certificate)
    with running(
        "drafter_service",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--db",
        str(tmp_path / "db"),
        "--tls-cert",
        cert,
        "--tls-key",
        key,
        "--tls-client-ca",
        client_cert,
    ) as drafter:
        # The container health check, over mutual TLS: with the client certificate only.
        assert healthcheck("--tls-ca", cert, "--tls-cert", client_cert, "--tls-key", client_key, drafter.address).returncode == 0
        refused = healthcheck("--tls-ca", cert, drafter.address)
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
        assert healthcheck(drafter.address).returncode == 1  # plaintext
        env_configured = subprocess.run(
            [sys.executable, "-m", "specdec.healthcheck", drafter.address],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                "SPECDEC_HEALTHCHECK_TLS_CA": cert,
                "SPECDEC_HEALTHCHECK_TLS_CERT": client_cert,
                "SPECDEC_HEALTHCHECK_TLS_KEY": client_key,
            },
        )
        assert env_configured.returncode == 0, env_configured.stderr
        # A verifier presenting its certificate gets drafts.
        with running_tiny_verifier(
            tiny_model_dir,
            "--drafter",
            drafter.address,
            "--drafter-tls-ca",
            cert,
            "--drafter-tls-cert",
            client_cert,
            "--drafter-tls-key",
            client_key,
        ) as verifier:
            with grpc.insecure_channel(verifier.address) as channel:
                request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6, 7, 5], max_new_tokens=16, num_speculative_tokens=4)
                response = call_when_serving(rpc.VerifierStub(channel), request)
                assert response.stats.draft_tokens > 0


def test_mutual_tls_end_to_end_with_the_cli_client_and_a_plaintext_health_port(tiny_model_dir, tmp_path, certificate, client_certificate):
    """The README's set-up: the drafter serves only verifiers, the verifier only clients,
    each with a certificate; the probes ask the plaintext health port."""
    cert, key = (str(path) for path in certificate)
    client_cert, client_key = (str(path) for path in client_certificate)
    mutual = ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", client_cert]
    health_port = free_port()
    with running("drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(tmp_path / "db"), *mutual) as drafter:
        with running_tiny_verifier(
            tiny_model_dir,
            "--drafter",
            drafter.address,
            "--drafter-tls-ca",
            cert,
            "--drafter-tls-cert",
            client_cert,
            "--drafter-tls-key",
            client_key,
            "--health-port",
            str(health_port),
            *mutual,
        ) as verifier:
            deadline = time.monotonic() + 120
            while healthcheck(f"127.0.0.1:{health_port}").returncode != 0:  # plaintext, no certificate: SERVING once loaded
                assert time.monotonic() < deadline, "the health port never said SERVING"
                time.sleep(0.5)

            def cli(*tls: str) -> subprocess.CompletedProcess:
                return subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "verifier_service.client",
                        "--target",
                        verifier.address,
                        *tls,
                        "--no-chat",
                        "--max-new-tokens",
                        "8",
                        "--k",
                        "4",
                        "--json",
                        "t5 t6 t7 t5 t6 t7 t5 t6 t7",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )

            answered = cli("--tls-ca", cert, "--tls-cert", client_cert, "--tls-key", client_key)
            assert answered.returncode == 0, answered.stderr
            assert '"finish_reason": "length"' in answered.stdout
            refused = cli("--tls-ca", cert)  # TLS, but no client certificate
            assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr


def test_healthcheck_of_a_tls_server_checks_over_tls(tmp_path):
    # The certificate names the service, as in a compose network or a cluster; the
    # container checks itself at 127.0.0.1 and overrides the name it expects.
    cert, key = (str(path) for path in self_signed(tmp_path, "drafter", "DNS:drafter.internal"))
    with running(
        "drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(tmp_path / "db"), "--tls-cert", cert, "--tls-key", key
    ) as drafter:
        assert healthcheck("--tls-ca", cert, "--tls-server-name", "drafter.internal", drafter.address).returncode == 0
        assert healthcheck("--tls-ca", cert, drafter.address).returncode == 1  # 127.0.0.1 is not the certificate's name
        assert healthcheck(drafter.address).returncode == 1  # plaintext against TLS fails, and says so


def test_client_ca_without_a_server_certificate_is_a_usage_error(tmp_path, client_certificate):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "drafter_service",
            "--port",
            "0",
            "--db",
            str(tmp_path / "db"),
            "--tls-client-ca",
            str(client_certificate[0]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--tls-client-ca needs --tls-cert" in result.stderr


def https_when_serving(base: str, context: ssl.SSLContext) -> httpx.Response:
    """GET /health over HTTPS until the model has loaded (503 before)."""
    deadline = time.monotonic() + 120
    while (answer := httpx.get(base + "/health", verify=context, timeout=10)).status_code == 503:
        assert time.monotonic() < deadline, "the verifier never loaded"
        time.sleep(0.2)
    return answer


def test_the_http_api_uses_the_services_tls_and_client_certificates(tiny_model_dir, certificate, client_certificate):
    cert, key = (str(path) for path in certificate)
    client_cert, client_key = (str(path) for path in client_certificate)
    tls = ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", client_cert]
    with running_tiny_verifier(tiny_model_dir, "--http-port", "0", *tls) as verifier:
        port = verifier.announced_port("http")
        trusting = ssl.create_default_context(cafile=cert)
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP to a TLS port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        with pytest.raises((httpx.HTTPError, ssl.SSLError)):  # TLS without a client certificate
            httpx.get(f"https://127.0.0.1:{port}/health", verify=trusting, timeout=10)
        trusting.load_cert_chain(client_cert, client_key)
        assert https_when_serving(f"https://127.0.0.1:{port}", trusting).json()["status"] == "ok"
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"https://127.0.0.1:{port}/v1/completions", json=body, verify=trusting, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
