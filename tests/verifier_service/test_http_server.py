"""The HTTP server's own limits (``HttpServer``: uvicorn with ``_LimitedH11``), in process over
real sockets with a small ASGI app: header and body deadlines, the connection cap, and
OpenAI's error shape for what h11 cannot parse.

Deadlines are configured at 1 s and the tests allow 30 s for the close, so a loaded
machine slows them but cannot fail them.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from verifier_service.serving.openai_api import HttpLimits, HttpServer

CLOSE_WITHIN_S = 30  # a 1 s deadline, with room for a busy machine


async def echo(request: Request) -> JSONResponse:
    """The body's length, or how the read ended."""
    received = 0
    try:
        async for part in request.stream():
            received += len(part)
    except ClientDisconnect:
        request.app.state.disconnects += 1
        return JSONResponse({"disconnected": received})
    return JSONResponse({"received": received})


def serve(limits: HttpLimits) -> HttpServer:
    app = Starlette(routes=[Route("/echo", echo, methods=["GET", "POST"])])
    app.state.disconnects = 0
    server = HttpServer(app, "127.0.0.1", 0, limits)
    server.start()
    return server


@pytest.fixture
def quick():
    """Deadlines of 1 s, connections capped at 3."""
    server = serve(HttpLimits(max_connections=3, header_timeout_s=1.0, body_timeout_s=1.0))
    yield server
    server.stop()


def connect(server: HttpServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=CLOSE_WITHIN_S)


def read_until_closed(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    received = b""
    try:
        while part := connection.recv(65536):
            received += part
    except ConnectionResetError:
        pass
    return received


def read_response(connection: socket.socket) -> bytes:
    """One whole response (headers, and the body its Content-Length gives), the connection left open."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += connection.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
    while len(body) < length:
        body += connection.recv(65536)
    return head + b"\r\n\r\n" + body


def response_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + CLOSE_WITHIN_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def test_half_a_request_line_is_answered_408_and_closed(quick):
    with connect(quick) as connection:
        connection.sendall(b"POST /echo HT")
        status, body = response_of(read_until_closed(connection))
    assert (status, body["error"]["code"]) == (408, "request_timeout")
    assert "headers took over 1 s (--http-header-timeout-seconds)" in body["error"]["message"]


def test_headers_trickled_a_byte_at_a_time_are_cut_off_too(quick):
    """Each byte would restart a per-read idle timer; the deadline is for the whole headers."""
    with connect(quick) as connection:
        connection.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        deadline = time.monotonic() + CLOSE_WITHIN_S
        while time.monotonic() < deadline:
            try:
                connection.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                return  # closed
            time.sleep(0.05)
        pytest.fail(f"still open after {CLOSE_WITHIN_S} s of one byte every 50 ms")


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(quick):
    with connect(quick) as connection:
        assert read_until_closed(connection) == b""


def test_a_trickled_body_is_answered_408_and_the_route_sees_the_client_gone(quick):
    with connect(quick) as connection:
        connection.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        status, body = response_of(read_until_closed(connection))
    assert status == 408 and "body took over 1 s (--http-body-timeout-seconds)" in body["error"]["message"]
    wait_for(lambda: quick.server.config.app.state.disconnects == 1, "the route saw the disconnect")


def test_after_an_answer_the_next_requests_headers_have_a_deadline_too(quick):
    """Keep-alive: uvicorn's keep-alive timer stops at the next byte; the header deadline does not."""
    with connect(quick) as connection:
        connection.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(connection).startswith(b"HTTP/1.1 200")
        connection.sendall(b"GET /ec")
        status, _ = response_of(read_until_closed(connection))
    assert status == 408


def test_an_answered_request_whose_body_never_ends_is_closed(quick):
    """A route that answers before reading the body (a 413, a 401): the rest is drained, within the body deadline."""
    with connect(quick) as connection:
        connection.sendall(b"GET /nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        answer = read_until_closed(connection)
    assert answer.startswith(b"HTTP/1.1 404")


def test_a_request_sent_at_once_is_unaffected(quick):
    body = b"x" * 200_000
    with connect(quick) as connection:
        connection.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert response_of(read_response(connection)) == (200, {"received": 200_000})


def test_connections_past_the_cap_get_503_and_are_closed_until_one_closes():
    server = serve(HttpLimits(max_connections=3, header_timeout_s=120.0, body_timeout_s=120.0))
    held = []
    try:
        for _ in range(3):
            held.append(connect(server))
            held[-1].sendall(b"GET /echo HTTP/1.1\r\n")  # headers begun, never finished
        wait_for(lambda: len(server.server.server_state.connections) == 3, "the server holds 3 connections")
        with connect(server) as refused:
            status, body = response_of(read_until_closed(refused))
        assert (status, body["error"]["code"]) == (503, "too_many_connections")
        assert "--max-http-connections" in body["error"]["message"]
        held.pop().close()
        wait_for(lambda: len(server.server.server_state.connections) == 2, "the server let one go")
        with connect(server) as admitted:
            admitted.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert response_of(read_response(admitted)) == (200, {"received": 0})
    finally:
        for connection in held:
            connection.close()
        server.stop()


def test_what_h11_cannot_parse_is_a_400_in_openais_shape(quick):
    with connect(quick) as connection:
        connection.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, body = response_of(read_until_closed(connection))
    assert (status, body["error"]["type"], body["error"]["code"]) == (400, "invalid_request_error", "invalid_http")
