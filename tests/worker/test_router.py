"""The data-parallel router's supervision (worker/router.py) against stand-in replica processes:
real processes that say ready and die, or fail at start, as an engine replica would."""

import http.client
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import REPO, wait_until
from worker import replica as replica_module
from worker.router import Router, merge_metrics

REPLICA_SCRIPT = pathlib.Path(__file__).with_name("router_replica.py")

# A replica that is ready and then dies at its first start, and fails at every start after (as when
# the daemon no longer holds its model): each start appends its time to the file argv[1].
REPLICA = """
import json, sys, time
with open(sys.argv[1], "a") as f:
    f.write(f"{time.monotonic()}\\n")
starts = len(open(sys.argv[1]).read().split())
if starts == 1:
    print(json.dumps({"event": "ready", "load_format": "ipc_cache"}), flush=True)
    time.sleep(0.3)
else:
    print(json.dumps({"event": "failed", "error": "FallbackRefusedError: not loaded on cpu:0"}), flush=True)
sys.exit(1)
"""


def test_a_replica_whose_restarts_fail_is_restarted_ever_later_and_says_why(tmp_path, monkeypatch):
    """Before: restarted every second for ever (each a whole engine process), its error in no answer."""
    monkeypatch.setattr(replica_module, "RESTART_DELAY_S", 0.5)
    script, starts = tmp_path / "replica.py", tmp_path / "starts"
    script.write_text(REPLICA)
    router = Router(1, tmp_path, [sys.executable, str(script), str(starts)])
    router.start()
    try:
        deadline = time.monotonic() + 30
        while len(starts.read_text().split()) < 4 if starts.exists() else True:
            assert time.monotonic() < deadline, "the replica was not restarted"
            time.sleep(0.05)
        time.sleep(0.3)
        replica = router.readiness()["replicas"][0]
    finally:
        router.stop()
    times = [float(t) for t in starts.read_text().split()]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert 0.5 + 0.3 <= gaps[0] < 0.5 + 2, gaps  # it ran 0.3 s, then the first delay
    assert 1.0 <= gaps[1] < 1.0 + 2 and 2.0 <= gaps[2] < 2.0 + 2, gaps  # doubled while the restarts fail
    assert replica["ready"] is False and replica["restarts"] >= 3
    assert replica["error"] == "FallbackRefusedError: not loaded on cpu:0"


def test_metrics_of_replicas_merge_into_one_family_each():
    one = ('# HELP preload_engine_requests_total Requests.\n# TYPE preload_engine_requests_total counter\n'
           'preload_engine_requests_total{replica="%d"} %d.0\n# HELP preload_engine_ready Ready.\n'
           '# TYPE preload_engine_ready gauge\npreload_engine_ready{replica="%d"} 1.0\n')
    merged = merge_metrics([one % (0, 5, 0), one % (1, 7, 1)])
    assert merged == ["# HELP preload_engine_requests_total Requests.", "# TYPE preload_engine_requests_total counter",
                      'preload_engine_requests_total{replica="0"} 5.0',
                      'preload_engine_requests_total{replica="1"} 7.0',
                      "# HELP preload_engine_ready Ready.", "# TYPE preload_engine_ready gauge",
                      'preload_engine_ready{replica="0"} 1.0', 'preload_engine_ready{replica="1"} 1.0']
    assert json.dumps(merge_metrics(["", "garbage without a family\n"])) == '["garbage without a family"]'


class RouterProcess:
    """`python -m worker.router` on a free port over stand-in replicas (router_replica.py)."""

    def __init__(self, tmp_path, replicas: int = 2, command: list[str] | None = None):
        self.sockets = pathlib.Path(tempfile.mkdtemp(prefix="plr-", dir="/tmp"))  # short: socket paths
        self.log = tmp_path / "replicas.log"
        settings = {"replicas": replicas, "socket_dir": str(self.sockets), "host": "127.0.0.1", "port": 0,
                    "log_level": "WARNING", "command": command or [sys.executable, str(REPLICA_SCRIPT)]}
        self.errors = tmp_path / "router.err"
        with open(self.errors, "w") as errors:
            self.proc = subprocess.Popen([sys.executable, "-m", "worker.router", json.dumps(settings)], cwd=REPO,
                                         stdout=subprocess.PIPE, stderr=errors, text=True,
                                         env={**os.environ, "ROUTER_REPLICA_LOG": str(self.log)})
        self.ready = json.loads(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.ready['port']}"

    def stderr(self) -> str:
        return self.errors.read_text(errors="replace")

    def readiness(self) -> dict:
        try:
            return json.load(urllib.request.urlopen(self.url + "/ready", timeout=10))
        except urllib.error.HTTPError as e:
            return json.load(e)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:  # killed: its replicas go with it (their parent-death signal)
            self.proc.kill()
            code = self.proc.wait()
        shutil.rmtree(self.sockets, ignore_errors=True)
        return code


def post(url: str, body: dict):
    return urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                                         {"Content-Type": "application/json"}), timeout=30)


def test_an_answer_a_dying_replica_cuts_short_reaches_the_client_cut(tmp_path):
    """The body ends short, as the replica's did, so that the client can tell (a clean end would pass
    part of an answer off as all of it); the replica is restarted."""
    router = RouterProcess(tmp_path)
    try:
        response = post(router.url, {"die_after_bytes": 1000})
        with pytest.raises(http.client.IncompleteRead):
            response.read()
        wait_until(lambda: router.readiness()["replicas"][0]["restarts"] == 1, 10, "the restart")
        wait_until(lambda: router.readiness()["status"] == "ready", 20, "the replica back")
        assert [r["in_flight"] for r in router.readiness()["replicas"]] == [0, 0]
    finally:
        assert router.stop() == -signal.SIGTERM  # ended by the signal, as a single engine is


def test_a_client_gone_before_its_answer_ends_its_request_at_the_replica(tmp_path):
    """A client that gives up (its timeout) before the replica's answer begins: the request must not
    stay counted against the replica (each such client would draw requests away from it for good),
    and the replica's request is closed, as the client's was: an engine stops generating for it
    (through the router, 4 choices of 400 tokens ran to their end after the client had gone)."""
    router = RouterProcess(tmp_path, replicas=1)
    try:
        connections = [http.client.HTTPConnection("127.0.0.1", router.ready["port"], timeout=10) for _ in range(3)]
        for connection in connections:
            connection.request("POST", "/v1/completions", json.dumps({"delay_s": 30}),
                               {"Content-Type": "application/json"})
        wait_until(lambda: router.log.exists() and router.log.read_text().count("0 got") == 3, 10, "the requests")
        for connection in connections:
            connection.close()  # gone before the answer
        wait_until(lambda: router.log.read_text().count("0 gone") == 3, 10, "the replica's requests closed")
        wait_until(lambda: router.readiness()["replicas"][0]["in_flight"] == 0, 5, "no request in flight")
        assert json.load(post(router.url, {}))["replica"] == 0
    finally:
        router.stop()


def test_a_request_that_reached_a_replica_is_not_sent_to_another(tmp_path):
    """A replica that died with a request was asked the same request again: one that crashes
    replicas would have crashed them all in turn. Only a replica not connected to is passed over."""
    router = RouterProcess(tmp_path)
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            post(router.url, {"die": True})
        assert err.value.code == 502
        assert "the engine replica serving this request stopped before it answered" in \
            json.load(err.value)["error"]["message"]
        assert router.log.read_text().count(" got") == 1
    finally:
        router.stop()


def test_a_hung_replica_ends_its_requests_and_streams(tmp_path):
    """A stopped (hung) replica was out of rotation but held its requests, and streams, until their
    clients gave up: a minute, or for good."""
    router = RouterProcess(tmp_path, replicas=1)
    pid = router.readiness()["replicas"][0]["engine"]["pid"]
    try:
        stream = post(router.url, {"chunks": 1000})
        assert stream.readline().startswith(b"data: {")
        plain: dict = {}

        def ask() -> None:
            try:
                post(router.url, {"delay_s": 60})
            except urllib.error.HTTPError as e:
                plain["error"] = (e.code, json.load(e)["error"]["message"])
        asker = threading.Thread(target=ask)
        asker.start()
        wait_until(lambda: router.readiness()["replicas"][0]["in_flight"] == 2, 10, "both requests at the replica")
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        rest = stream.read().decode()  # ends once the health check has failed
        asker.join(40)
        assert time.monotonic() - started < 30  # two health checks unanswered: about 15 s
        assert rest.rstrip().endswith('"code": 502}}') and "stopped (ReplicaStopped)" in rest, rest[-300:]
        code, message = plain["error"]
        assert code == 502 and "did not answer 2 health checks in a row, each given 5 s" in message
        assert router.readiness()["replicas"][0]["in_flight"] == 0
    finally:
        os.kill(pid, signal.SIGCONT)
        router.stop()


def test_hostile_headers_and_paths_get_a_json_answer(tmp_path):
    """A header of non-ASCII bytes or a path of %ff%00 gave a plain-text 500 and a traceback; a
    path with .. segments reached a replica's own /metrics; every answer had two Date headers."""
    router = RouterProcess(tmp_path, replicas=1)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", router.ready["port"], timeout=10)
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("X-Odd", "\u00e9\u4e2d".encode() + b"\xff")
        connection.putheader("Content-Length", "2")
        connection.endheaders(b"{}")
        answer = connection.getresponse()
        assert answer.status == 200 and len(answer.headers.get_all("date")) == 1
        assert json.load(answer)["headers"]["x-odd"] == "\u00e9\u4e2d".encode().decode("latin-1") + "\xff"
        for path, status in [("/v1/%ff%00", 400), ("/v1/%2e%2e/metrics", 404), ("/v1/../ready", 404)]:
            connection = http.client.HTTPConnection("127.0.0.1", router.ready["port"], timeout=10)
            connection.request("GET", path)
            answer = connection.getresponse()
            assert answer.status == status and "error" in json.load(answer), path
        assert "Traceback" not in router.stderr()
    finally:
        router.stop()


def test_a_client_that_leaves_mid_body_leaves_no_traceback(tmp_path):
    router = RouterProcess(tmp_path, replicas=1)
    try:
        with socket.create_connection(("127.0.0.1", router.ready["port"])) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"a\": ")
        time.sleep(0.5)
        assert json.load(post(router.url, {}))["replica"] == 0
        assert "Traceback" not in router.stderr() and "ClientDisconnect" not in router.stderr()
    finally:
        router.stop()


def test_metrics_answer_with_a_hundred_requests_in_flight(tmp_path):
    """/metrics queued behind the requests for the replica's 100 connections, timed out and left out
    every replica's series."""
    router = RouterProcess(tmp_path, replicas=1)
    askers = [threading.Thread(target=lambda: post(router.url, {"delay_s": 8}), daemon=True) for _ in range(105)]
    try:
        for asker in askers:
            asker.start()
        wait_until(lambda: router.readiness()["replicas"][0]["in_flight"] >= 100, 10, "100 requests in flight")
        metrics = urllib.request.urlopen(router.url + "/metrics", timeout=10).read().decode()
        assert 'm{replica="0"} 1' in metrics
    finally:
        for asker in askers:
            asker.join(30)
        router.stop()


def test_bodies_a_single_engine_takes_pass_the_router_and_their_bytes_are_given_back(tmp_path):
    """The router refused bodies over 16 MiB that a single engine takes (up to 64 MiB): a chat of 8 Mi
    multi-byte characters. Bodies are now bounded as an engine's, and all together."""
    router = RouterProcess(tmp_path, replicas=1)
    try:
        padding = "\u00e9" * (10 << 20)  # 20 MiB of UTF-8
        assert json.load(post(router.url, {"padding": padding}))["replica"] == 0
        with pytest.raises(urllib.error.HTTPError) as err:
            post(router.url, {"padding": padding * 4})
        assert err.value.code == 413 and "over 64 MiB" in json.load(err.value)["error"]["message"]
        metrics = urllib.request.urlopen(router.url + "/metrics", timeout=10).read().decode()
        assert "preload_router_request_body_bytes 0\n" in metrics
        for request, status, message in [  # the router's own errors in OpenAI's JSON shape, as an engine's
            (urllib.request.Request(router.url + "/v2/completions"), 404,
             "no such path '/v2/completions'; this router serves /health, /ready, /metrics, /v1/{path:path}"),
            (urllib.request.Request(router.url + "/v1/completions", method="DELETE"), 405,
             "DELETE is not allowed on /v1/completions")]:
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=10)
            assert err.value.code == status and json.load(err.value)["error"]["message"] == message
            assert status == 404 or set(err.value.headers["Allow"].split(", ")) == {"GET", "HEAD", "POST"}
    finally:
        router.stop()


def test_sigterm_stops_every_replica_gracefully_and_removes_their_sockets(tmp_path):
    """Replicas the supervisor thread restarted die with that thread (their parent-death signal):
    it now lasts until they are stopped, and each gets SIGTERM, not SIGKILL."""
    router = RouterProcess(tmp_path)
    try:
        first = router.readiness()["replicas"][0]["engine"]["pid"]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: (doc := router.readiness())["status"] == "ready" and
                   doc["replicas"][0]["engine"]["pid"] != first, 20, "the restarted replica")
        pids = [r["engine"]["pid"] for r in router.readiness()["replicas"]]
    except BaseException:
        router.stop()
        raise
    assert router.stop() == -signal.SIGTERM
    stopped = sorted(int(line.split()[1]) for line in router.log.read_text().splitlines() if line.endswith("SIGTERM"))
    assert stopped == sorted(pids)
    assert not router.sockets.exists()


def test_a_replica_that_cannot_even_be_started_is_tried_again(tmp_path):
    """A restart whose spawn fails (its executable gone or unreadable) killed the supervisor thread:
    nothing was restarted after it, and the replicas it had restarted died with it."""
    script = tmp_path / "replica"
    script.write_text(f"#!{sys.executable}\n" + REPLICA_SCRIPT.read_text())
    script.chmod(0o700)
    router = RouterProcess(tmp_path, command=[str(script)])
    try:
        script.chmod(0o000)
        os.kill(router.readiness()["replicas"][0]["engine"]["pid"], signal.SIGKILL)
        wait_until(lambda: "cannot start it" in router.readiness()["replicas"][0].get("error", ""), 20,
                   "the failed start")
        script.chmod(0o700)
        wait_until(lambda: router.readiness()["status"] == "ready", 30, "the replica back")
        assert router.readiness()["replicas"][1]["restarts"] == 0
    finally:
        router.stop()


def test_an_answer_whose_relay_never_began_still_ends_its_request(tmp_path):
    """Cleanup ran in the relay's generator only: an answer whose headers could not be sent (the
    client gone) left the request counted against the replica, its body's bytes held and its
    upstream connection open."""
    import anyio
    import httpx
    from starlette.requests import ClientDisconnect

    from worker.replica import Replica
    from worker.router import Relayed

    replica = Replica(0, tmp_path / "r.sock", ["true"])
    replica.in_flight, ended = 1, []

    async def run() -> None:
        upstream = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200, text="x")))
        response = await upstream.send(upstream.build_request("GET", "http://replica/v1/x"), stream=True)

        async def send(message):
            raise OSError("the client is gone")

        with pytest.raises(ClientDisconnect):  # (starlette's name for the send's OSError)
            await Relayed(replica, replica.generation, response, lambda: ended.append(True))(
                {"type": "http", "asgi": {"spec_version": "2.4"}}, None, send)
        assert response.is_closed

    anyio.run(run)
    assert replica.in_flight == 0 and ended == [True]
