"""specdec.processes: waiting for a service to serve outlives the service cutting a silent health Watch;
a service that outlives its SIGTERM is killed with its stacks shown; a SIGTERM any thread takes stops it."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest

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


STUCK_SERVICE = """
import signal, time
from specdec.serving import stop_on_signals
stop_on_signals()
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a service stuck in its shutdown, as far as its supervisor sees
print("stuck listening on 127.0.0.1:1 (never stops)", flush=True)
while True:
    time.sleep(1)
"""


def test_a_service_that_outlives_its_sigterm_is_killed_and_its_threads_stacks_reported(tmp_path):
    (tmp_path / "stuck_service.py").write_text(STUCK_SERVICE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    process = ServiceProcess("stuck_service", env=env)
    try:
        with pytest.raises(RuntimeError, match="did not exit within 1 s of SIGTERM") as raised:
            process.terminate(timeout_s=1)
        assert process.process.returncode == -signal.SIGKILL
        assert "(most recent call first)" in str(raised.value) and "stuck_service.py" in str(raised.value)  # SIGUSR1's stacks
    finally:
        process.kill()
    process = ServiceProcess("stuck_service", env=env)
    with pytest.warns(RuntimeWarning, match="did not exit"):
        process.terminate = functools.partial(ServiceProcess.terminate, process, timeout_s=1)  # type: ignore[method-assign]
        process.stop()
    assert process.process.returncode == -signal.SIGKILL


# A service's main thread waiting for SIGTERM while another thread takes the signal (the
# kernel may hand a signal sent to a process to any of its threads).
SIGNALLED_ELSEWHERE = """
import signal, threading, time
from specdec.serving import stop_on_signals, wait_for_stop

stopping = stop_on_signals()

def take_the_signal():
    time.sleep(0.2)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # this thread, not the main one
    time.sleep(120)

threading.Thread(target=take_the_signal, daemon=True).start()
wait_for_stop(stopping)
print("stopped", flush=True)
"""


def test_a_service_stops_on_a_sigterm_that_another_of_its_threads_took():
    """With a plain ``Event.wait()`` the main thread slept on until some later signal reached it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    finished = subprocess.run([sys.executable, "-c", SIGNALLED_ELSEWHERE], env=env, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0 and finished.stdout == "stopped\n", finished.stderr
