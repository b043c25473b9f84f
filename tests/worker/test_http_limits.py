"""The engine's and the router's HTTP connections are bounded (worker/http_limits.py): a real
uvicorn server on a real socket, with the limits made small."""

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
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(http_limits, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(http_limits, "HEAD_TIMEOUT_S", 0.5)
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
    assert closed_by_server(extra, 2), "a connection past the cap stayed open"
    assert not closed_by_server(idle[0], 0.1)  # within its time, an idle connection stays
    trickle = idle[1]
    trickle.sendall(b"GET / HTTP/1.1\r\n")  # a head that never ends
    assert all(closed_by_server(conn, 5) for conn in idle), "idle connections were never closed"
    assert get(server) == b"ok"


def test_a_keep_alive_connection_serves_requests_in_turn(server):
    conn = socket.create_connection(("127.0.0.1", server))
    for _ in range(3):
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.7)  # longer than the head timeout, between requests: the keep-alive timer's turn
        assert conn.recv(4096).endswith(b"ok")
