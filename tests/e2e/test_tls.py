"""TLS on both services and on the verifier's channel to the drafter, with a self-signed certificate."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import grpc
import pytest

from processes import running
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (its own CA): (cert path, key path)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed: apt-get install -y openssl"
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


def test_generate_over_tls_end_to_end(tiny_model_dir, tmp_path, certificate):
    cert, key = (str(path) for path in certificate)
    tls = ["--tls-cert", cert, "--tls-key", key]
    with running("drafter_service", "--port", "0", "--metrics-port", "-1", "--db", str(tmp_path / "db"), *tls) as drafter:
        with running("verifier_service", "--port", "0", "--metrics-port", "-1", "--model", str(tiny_model_dir), "--no-calibrate",
                     "--drafter", drafter.address, "--drafter-tls-ca", cert, *tls) as verifier:
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
                [sys.executable, "-m", "verifier_service.client", "--target", verifier.address, "--tls-ca", cert,
                 "--no-chat", "--max-new-tokens", "4", "--json", "t5 t6 t7"],
                capture_output=True, text=True, timeout=120,
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
