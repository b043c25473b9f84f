"""The engine's and the router's HTTP connections and request bodies are bounded
(worker/http_limits.py): a real uvicorn server on a real socket, with the limits made small."""

import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

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


def test_request_bodies_are_bounded_each_and_all_together(monkeypatch):
    """Bodies past MAX_BODY_BYTES get 413; bodies past the budget while others are held get 503 and
    may be sent again once those are answered; every byte is given back, refused or not."""
    monkeypatch.setattr(http_limits, "MAX_BODY_BYTES", 1 << 20)
    budget = http_limits.BodyBudget(limit=2 << 20)

    async def hold(request):
        try:
            body = await budget.read(request)
        except http_limits.BodyRefused as e:
            return PlainTextResponse(str(e), status_code=e.status)
        await asyncio.sleep(float(request.query_params.get("hold", 0)))
        budget.release(len(body))
        return PlainTextResponse(str(len(body)))

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    app = Starlette(routes=[Route("/", hold, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http=http_limits.BoundedH11))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/"

    def post(size: int, hold: float = 0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{url}?hold={hold}", b"x" * size), timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        held = [threading.Thread(target=post, args=(1 << 20, 2.0)) for _ in range(2)]
        for t in held:
            t.start()
        deadline = time.monotonic() + 5
        while budget.held < 2 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.held == 2 << 20
        status, message = post(1000)
        assert status == 503 and "holds 2 MiB of request bodies already; retry shortly" in message
        for t in held:
            t.join(10)
        assert budget.held == 0
        assert post(1000) == (200, "1000")
        status, message = post((1 << 20) + 1)
        assert status == 413 and "over 1 MiB; send a shorter prompt" in message
        assert budget.held == 0
        with socket.create_connection(listener.getsockname(), timeout=10) as conn:  # said, not sent: refused at
            started = time.monotonic()  # once, not after the request's deadline (h11 refuses longer numbers)
            conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\nxyz")
            answer = b""
            while b"prompt" not in answer:  # the head and the body may come apart
                answer += conn.recv(4096) or pytest.fail(f"closed after {answer!r}")
        assert answer.startswith(b"HTTP/1.1 413") and b"over 1 MiB; send a shorter prompt" in answer
        assert time.monotonic() - started < http_limits.REQUEST_TIMEOUT_S
        assert budget.held == 0
    finally:
        server.should_exit = True
        thread.join(10)
