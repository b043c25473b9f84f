"""The data-parallel router's supervision (worker/router.py) against stand-in replica processes:
real processes that say ready and die, or fail at start, as an engine replica would."""

import json
import sys
import time

from worker import router as router_module
from worker.router import Router, merge_metrics

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
                      'preload_engine_requests_total{replica="0"} 5.0', 'preload_engine_requests_total{replica="1"} 7.0',
                      "# HELP preload_engine_ready Ready.", "# TYPE preload_engine_ready gauge",
                      'preload_engine_ready{replica="0"} 1.0', 'preload_engine_ready{replica="1"} 1.0']
    assert json.dumps(merge_metrics(["", "garbage without a family\n"])) == '["garbage without a family"]'
