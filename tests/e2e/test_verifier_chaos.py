"""Chaos: 16 streams run while the drafter is killed with SIGKILL, restarted, made slow,
cut off without a reset and refused. Every stream finishes with the tokens of plain decoding."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

from faulty_link import FaultyLink
from processes import ServiceProcess, free_port

STREAMS = 16
TOKENS = 2500  # long enough that every stream outlives the six faults, however soon drafts resume after each
CONTEXT = 4096
CALL_TIMEOUT_S = 600
PHASE_S = 1.0  # how long each fault lasts
# Prompts whose continuations repeat themselves, so a live drafter has drafts to give.
PROMPTS = [[3 + i, 9, 3 + i, 9, 3 + i, 9, 20 + i] for i in range(STREAMS)]


def drafter_process(db, port: int) -> ServiceProcess:
    drafter = ServiceProcess("drafter_service", "--port", str(port), "--db", str(db), "--metrics-port", "-1")
    try:
        drafter.wait_until_serving("", 60)
    except BaseException:
        drafter.stop()
        raise
    return drafter


class Stream:
    """One GenerateStream read on its own thread."""

    def __init__(self, stub, prompt: list[int], k: int | None) -> None:
        fields = {"num_speculative_tokens": k} if k is not None else {}
        self.call = stub.GenerateStream(
            pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=TOKENS, **fields), timeout=CALL_TIMEOUT_S
        )
        self.tokens: list[int] = []
        self.finish_reason = None
        self.stats = None
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for chunk in self.call:
                self.tokens += chunk.token_ids
                if chunk.finish_reason:
                    self.finish_reason, self.stats = chunk.finish_reason, chunk.stats
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.done.set()


def test_streams_keep_exact_tokens_through_kill_restart_slow_and_unreachable_drafter(tmp_path, long_tiny_model_dir):
    db, drafter_port = tmp_path / "db", free_port()
    drafter = drafter_process(db, drafter_port)
    link = FaultyLink(drafter_port, delay_s=1.0)
    verifier = None
    try:
        verifier = ServiceProcess(
            "verifier_service",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--model",
            str(long_tiny_model_dir),
            "--no-calibrate",
            "--drafter",
            f"127.0.0.1:{link.port}",
            "--drafter-timeout-seconds",
            "0.3",
            "--max-new-tokens",
            str(TOKENS),
            "--max-sequence-tokens",
            str(CONTEXT),
            env={**os.environ},
        )
        verifier.wait_until_serving("specdec.v1.Verifier", 120)
        stub = rpc.VerifierStub(verifier.channel)
        # Plain decoding (K=0 never calls the drafter) is the reference.
        with ThreadPoolExecutor(STREAMS) as pool:
            plain = list(
                pool.map(
                    lambda prompt: stub.Generate(
                        pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=TOKENS, num_speculative_tokens=0), timeout=CALL_TIMEOUT_S
                    ),
                    PROMPTS,
                )
            )

        streams = [Stream(stub, prompt, None if i % 2 else 4) for i, prompt in enumerate(PROMPTS)]
        faults = []

        def phase(name: str, action) -> None:
            time.sleep(PHASE_S)
            action()
            faults.append((name, sum(stream.done.is_set() for stream in streams)))

        nonlocal_drafter = {"process": drafter}

        def kill() -> None:
            nonlocal_drafter["process"].kill()

        def restart() -> None:
            nonlocal_drafter["process"] = drafter_process(db, drafter_port)

        phase("kill -9", kill)
        phase("restart", restart)
        phase("slow", lambda: link.set_mode("slow"))
        phase("blackhole", lambda: link.set_mode("blackhole"))
        phase("refuse", lambda: link.set_mode("refuse"))
        phase("heal", lambda: link.set_mode("pass"))
        drafter = nonlocal_drafter["process"]
        # Every fault struck while streams were still running (else TOKENS is too small for this machine).
        assert all(finished < STREAMS for _, finished in faults), faults

        for i, stream in enumerate(streams):
            assert stream.done.wait(CALL_TIMEOUT_S), f"stream {i} never ended"
            assert stream.error is None, f"stream {i}: {stream.error.code().name}: {stream.error.details()}"
            assert stream.tokens == list(plain[i].token_ids), f"stream {i} differs from plain decoding"
            assert stream.finish_reason == plain[i].finish_reason
        # The drafter was really in play: drafts were accepted between the faults.
        assert sum(stream.stats.accepted_tokens for stream in streams) > 0
        # The verifier is still whole: a new request is answered exactly.
        again = stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPTS[0], max_new_tokens=64), timeout=CALL_TIMEOUT_S)
        assert list(again.token_ids) == list(plain[0].token_ids)[:64]
    finally:
        link.close()
        if verifier is not None:
            verifier.stop()
        drafter.stop()
