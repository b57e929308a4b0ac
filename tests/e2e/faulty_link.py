"""A TCP proxy that can be made slow or unreachable, for chaos tests.

``FaultyLink(target_port)`` listens on a free port of 127.0.0.1 and forwards
every connection to ``target_port``. Its ``mode``, changeable at any time:

* ``"pass"``: bytes flow as they arrive;
* ``"slow"``: each chunk, either way, is held ``delay_s`` before it is sent;
* ``"blackhole"``: connections stay open but nothing is forwarded (a network
  partition without resets: the peer sees only silence);
* ``"refuse"``: open connections are closed and new ones closed at once.
"""

from __future__ import annotations

import select
import socket
import threading
import time

CHUNK_BYTES = 1 << 16


class FaultyLink:
    def __init__(self, target_port: int, delay_s: float = 1.0) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        self.mode = "pass"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "slow", "blackhole", "refuse"), mode
        self.mode = mode
        if mode == "refuse":
            self._drop_all()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._drop_all()

    def _drop_all(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            connection.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "refuse":
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:  # the target is down: the client sees its connection closed
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._connections |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        held: list[bytes] = []
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select([source], [], [], 0.05)
                if readable:
                    data = source.recv(CHUNK_BYTES)
                    if not data:
                        break
                    held.append(data)
                if self.mode == "blackhole" or not held:
                    continue
                if self.mode == "slow":
                    time.sleep(self.delay_s)
                sink.sendall(b"".join(held))
                held = []
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
