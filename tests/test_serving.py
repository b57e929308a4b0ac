"""The reflection and health Watch guard (specdec.serving.AuxiliaryStreamGuard) on an
in-process server: its streams run on threads of their own, wait for one instead of being
refused, give it up when quiet while another waits, and are refused only beyond the waiting room."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec import serving
from specdec.limits import ConnectionLimits

CALL_TIMEOUT_S = 30
SERVICE = "specdec.v1.Test"


@pytest.fixture
def server_for():
    """``server_for(limits, workers)``: a started server with health (SERVING) and reflection; its address."""
    started = []

    def start(limits: ConnectionLimits, workers: int):
        server, guard = serving.grpc_server(limits, workers, workers, serving.MAX_MESSAGE_BYTES)
        health = serving.add_health_and_reflection(server, SERVICE)
        serving.set_serving(health, SERVICE, True)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append((server, guard))
        return f"127.0.0.1:{port}", guard

    yield start
    for server, guard in started:
        guard.stop()
        server.stop(0).wait()


class IdleStreams:
    """Reflection streams, each on its own connection (as separate clients), that ask
    ListServices once and then stay silent until ``release``; outcome per stream:
    "answered" then a status code name, in order."""

    def __init__(self, address: str, count: int) -> None:
        self.release = threading.Event()
        self.answered = threading.Semaphore(0)
        self.outcomes: list[str] = []
        self.channels = [grpc.insecure_channel(address) for _ in range(count)]
        self.threads = [threading.Thread(target=self._hold, args=(channel,)) for channel in self.channels]
        for thread in self.threads:
            thread.start()

    def _requests(self):
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        self.release.wait(CALL_TIMEOUT_S)

    def _hold(self, channel: grpc.Channel) -> None:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        try:
            for _ in stub.ServerReflectionInfo(self._requests(), timeout=CALL_TIMEOUT_S):
                self.answered.release()
            self.outcomes.append("OK")
        except grpc.RpcError as error:
            self.outcomes.append(error.code().name)

    def wait_answered(self, count: int) -> None:
        for _ in range(count):
            assert self.answered.acquire(timeout=CALL_TIMEOUT_S), "a stream was never answered"

    def wait_ended(self, count: int) -> None:
        """Until ``count`` streams have ended, without releasing any."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while len(self.outcomes) < count:
            assert time.monotonic() < deadline, f"only {len(self.outcomes)} of {count} streams ended"
            time.sleep(0.01)

    def finish(self) -> list[str]:
        self.release.set()
        for thread in self.threads:
            thread.join(CALL_TIMEOUT_S)
        for channel in self.channels:
            channel.close()
        return sorted(self.outcomes)


def health_check(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status


def test_idle_streams_hold_neither_the_service_threads_nor_are_held_past_their_idle_limit(server_for):
    # One service thread only: were the streams on it, the Check would wait past its deadline.
    limits = ConnectionLimits(max_auxiliary_streams=2, max_waiting_auxiliary_streams=0, auxiliary_stream_idle_s=1.0)
    address, guard = server_for(limits, 1)
    streams = IdleStreams(address, 2)
    streams.wait_answered(2)
    assert guard.open_streams == 2
    assert health_check(address) == health_pb2.HealthCheckResponse.SERVING
    streams.wait_ended(2)  # cut for silence, never released by the test
    assert streams.finish() == ["CANCELLED", "CANCELLED"]
    assert guard.ended_idle == 2 and guard.refused == 0


def test_a_stream_beyond_the_threads_waits_and_a_quiet_one_gives_it_its_thread(server_for):
    limits = ConnectionLimits(max_auxiliary_streams=2, max_waiting_auxiliary_streams=4, auxiliary_stream_quiet_s=0.5)
    address, guard = server_for(limits, 1)
    streams = IdleStreams(address, 6)
    # 2 run at once; each of the other 4 runs when a quiet one is cut for it (idle limit 60 s).
    streams.wait_answered(6)
    streams.wait_ended(4)
    assert streams.finish() == ["CANCELLED"] * 4 + ["OK"] * 2  # the last two: released by the test
    assert guard.refused == 0 and guard.ended_idle == 4


def test_beyond_the_waiting_room_a_stream_is_refused_with_the_flags_named(server_for):
    limits = ConnectionLimits(max_auxiliary_streams=1, max_waiting_auxiliary_streams=1, auxiliary_stream_quiet_s=60.0)
    address, guard = server_for(limits, 1)
    streams = IdleStreams(address, 2)  # one runs, one waits (no quiet cut for a minute)
    streams.wait_answered(1)
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while guard.pool.waiting < 1:  # bounded: the second stream reaches the server within the deadline
        assert time.monotonic() < deadline, "the second stream never arrived"
        time.sleep(0.01)
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        next(watch)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.details() == (
        "2 reflection or health Watch streams are open or waiting already "
        "(--max-auxiliary-streams, --max-waiting-auxiliary-streams); retry later, or use health Check"
    )
    assert guard.refused == 1
    assert streams.finish() == ["OK", "OK"]  # the waiting one ran once the first was released


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_silent_streams_cuts_the_idle_then_the_longest_quiet_for_each_waiting_stream():
    # Idle 60 s, quiet 1 s, 2 waiting; open streams silent for 0.2, 3, 5 and 70 s:
    # the 70 s one is idle, and frees one thread; the 5 s one is the longest quiet.
    guard = serving.AuxiliaryStreamGuard(ConnectionLimits(max_auxiliary_streams=4, auxiliary_stream_quiet_s=1.0))
    guard.stop()  # no sweeper: this test calls silent_streams itself
    held = [threading.Event() for _ in range(7)]
    try:
        for event in held[:6]:  # the pool's 4 threads held, 2 waiting
            guard.pool.submit(event.wait, CALL_TIMEOUT_S)
        wait_until(lambda: guard.pool.waiting == 2, "two never waited")
        now = time.monotonic()
        for stream_id, silent_for in enumerate((0.2, 3.0, 5.0, 70.0)):
            guard._open[stream_id] = serving._Stream(context=f"silent {silent_for}", heard=now - silent_for)
        assert sorted(guard.silent_streams(now)) == ["silent 5.0", "silent 70.0"]
        assert guard.silent_streams(now + 0.25) == []  # the two cut ones' threads are owed to the two waiting
        held[0].set()  # a cut one ends: its thread goes to a waiting one, and one is still owed
        wait_until(lambda: guard.pool.waiting == 1, "the freed thread never went to a waiting one")
        del guard._open[3]
        assert guard.silent_streams(now + 0.5) == []
        guard.pool.submit(held[6].wait, CALL_TIMEOUT_S)  # one more waits: the 3 s one, the longest quiet left, is cut for it
        assert guard.silent_streams(now + 0.75) == ["silent 3.0"]
    finally:
        for event in held:
            event.set()
        guard.pool.shutdown(wait=True)


def test_a_second_server_on_a_taken_port_fails_to_bind_instead_of_sharing_it():
    first, first_guard = serving.grpc_server(ConnectionLimits(), 2, 4, 1 << 20)
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    second, second_guard = serving.grpc_server(ConnectionLimits(), 2, 4, 1 << 20)
    try:
        # grpcio reports a failed bind as port 0 or as RuntimeError, by version; SO_REUSEPORT would bind it.
        try:
            bound = second.add_insecure_port(f"127.0.0.1:{port}")
        except RuntimeError:
            bound = 0
        assert bound == 0
    finally:
        first.stop(0).wait()
        for guard in (first_guard, second_guard):
            guard.stop()
