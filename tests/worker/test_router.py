"""The data-parallel router's supervision (worker/router.py) against stand-in replica processes:
real processes that say ready and die, or fail at start, as an engine replica would."""

import http.client
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import REPO, wait_until
from worker import router as router_module
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
    monkeypatch.setattr(router_module, "RESTART_DELAY_S", 0.5)
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
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.router", json.dumps(settings)], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "ROUTER_REPLICA_LOG": str(self.log)})
        self.ready = json.loads(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.ready['port']}"

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


def test_a_client_gone_before_its_answer_is_not_counted_against_the_replica(tmp_path):
    """A client that gives up (its timeout) before the replica's answer begins: the request must not
    stay counted against the replica (each such client would draw requests away from it for good)
    nor hold its upstream connection."""
    router = RouterProcess(tmp_path, replicas=1)
    try:
        for _ in range(3):
            connection = http.client.HTTPConnection("127.0.0.1", router.ready["port"], timeout=10)
            connection.request("POST", "/v1/completions", json.dumps({"delay_s": 3}),
                               {"Content-Type": "application/json"})
            connection.close()  # gone before the answer
        wait_until(lambda: router.readiness()["replicas"][0]["in_flight"] == 3, 2, "the requests at the replica")
        wait_until(lambda: router.readiness()["replicas"][0]["in_flight"] == 0, 10, "no request in flight")
        assert json.load(post(router.url, {}))["replica"] == 0
    finally:
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
    stopped = sorted(int(line.split()[1]) for line in router.log.read_text().splitlines())
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
