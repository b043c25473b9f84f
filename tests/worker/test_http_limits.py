"""The engine's and the router's HTTP connections are bounded (worker/http_limits.py): a real
uvicorn server on a real socket, with the limits made small."""

import asyncio
import socket
import threading
import time
import urllib.request

import pytest
import uvicorn

from worker import http_limits


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":  # answers after the request timeout: the connection must wait for it
        await asyncio.sleep(1.0)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(http_limits, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(http_limits, "REQUEST_TIMEOUT_S", 0.5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http=http_limits.BoundedH11))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield listener.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def closed_by_server(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        return conn.recv(1) == b""
    except (TimeoutError, ConnectionResetError) as e:
        return isinstance(e, ConnectionResetError)


def get(port: int) -> bytes:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()


def test_connections_past_the_cap_are_closed_and_idle_ones_time_out(server):
    idle = [socket.create_connection(("127.0.0.1", server)) for _ in range(4)]
    time.sleep(0.1)
    extra = socket.create_connection(("127.0.0.1", server))
    extra.settimeout(2)
    assert extra.recv(100).startswith(b"HTTP/1.1 503 "), "a connection past the cap was served"
    assert closed_by_server(extra, 2), "a connection past the cap stayed open"
    assert not closed_by_server(idle[0], 0.1)  # within its time, an idle connection stays
    idle[1].sendall(b"GET / HTTP/1.1\r\n")  # a head that never ends
    idle[2].sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nab")  # nor does this body
    assert all(closed_by_server(conn, 5) for conn in idle), "idle connections were never closed"
    assert get(server) == b"ok"


def test_a_keep_alive_connection_serves_requests_in_turn(server):
    """A request that is in waits for its answer however long the app takes, and the connection
    serves the next one; between requests uvicorn's keep-alive timer (5 s) is the bound."""
    conn = socket.create_connection(("127.0.0.1", server))
    conn.settimeout(10)
    for path in ("/slow", "/", "/slow"):
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        answer = b""
        while not answer.endswith(b"ok"):  # the head and the body may come apart
            answer += conn.recv(4096) or pytest.fail(f"closed after {answer!r}")
        time.sleep(0.7)  # longer than the request timeout, between requests
