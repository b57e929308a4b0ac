"""specdec.processes: waiting for a service to serve outlives the service cutting a silent health Watch."""

from __future__ import annotations

import threading

import grpc

from specdec import serving
from specdec.limits import ConnectionLimits
from specdec.processes import ServiceProcess

SERVICE = "specdec.v1.Test"


class Running:
    """What wait_until_serving asks of the child process: that it still runs."""

    def poll(self):
        return None


def test_waiting_for_serving_watches_again_when_the_service_cuts_a_silent_watch():
    # Was: a verifier whose model took longer to load than --auxiliary-stream-idle-seconds (60 s) was
    # reported as never serving (CANCELLED), though it served a moment later.
    server, guard = serving.grpc_server(ConnectionLimits(auxiliary_stream_idle_s=0.2), 2, 2, serving.MAX_MESSAGE_BYTES)
    health = serving.add_health_and_reflection(server, SERVICE)  # NOT_SERVING until set
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    waiting = ServiceProcess.__new__(ServiceProcess)  # the waiting logic alone, over this in-process server
    waiting.channel, waiting.process, waiting.command, waiting.log_file = grpc.insecure_channel(f"127.0.0.1:{port}"), Running(), ["t"], None
    serving_later = threading.Timer(1.0, serving.set_serving, (health, SERVICE, True))  # after several cut Watches
    serving_later.start()
    try:
        waiting.wait_until_serving(SERVICE, timeout_s=30)
        assert guard.ended_idle >= 2  # the service cut the silent Watch, more than once
    finally:
        serving_later.cancel()
        waiting.channel.close()
        guard.stop()
        server.stop(0).wait()
