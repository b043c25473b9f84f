"""`preload engine|generate --tp-size N --dp-size M` as real process trees on real sockets."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest

from preload_cli.models import tiny_model
from preload_daemon.config import DaemonConfig
from tests.conftest import REPO, exited, run_preload, wait_until

PROMPT = [5, 17, 99, 3, 200, 41]


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def complete(url: str) -> dict:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=60))


def stop_daemons(runtime_dir) -> None:
    """Stops the daemons `preload serve --no-supervise` left running."""
    for d in json.loads(run_preload("status", "--json", runtime_dir=runtime_dir).stdout)["daemons"]:
        if "pid" in d:
            os.kill(d["pid"], signal.SIGTERM)


def generate(model, runtime_dir, *extra) -> dict:
    out = run_preload("generate", model, "--prompt-ids", "5,17,99,3", "--max-tokens", "8", "--runtime-dir",
                      runtime_dir, *extra, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_generate_tp2_cold_and_warm_equals_tp1(runtime_dir, tiny_llama):
    """The same tokens at TP 1, TP 2 cold, and TP 2 attached to the two daemons `serve` started."""
    tp1 = generate(tiny_llama, runtime_dir, "--load-format", "safetensors")
    cold = generate(tiny_llama, runtime_dir, "--load-format", "safetensors", "--tp-size", "2")
    assert cold["token_ids"] == tp1["token_ids"] and [r["load_format"] for r in cold["ranks"]] == ["safetensors"] * 2
    served = run_preload("serve", tiny_llama, "--tp-size", "2", "--no-supervise", runtime_dir=runtime_dir)
    assert served.returncode == 0, served.stderr
    try:
        warm = generate(tiny_llama, runtime_dir, "--tp-size", "2", "--no-fallback")
        assert warm["token_ids"] == tp1["token_ids"]
        assert [(r["rank"], r["device"], r["load_format"]) for r in warm["ranks"]] == \
            [(0, "cpu:0", "ipc_cache"), (1, "cpu:1", "ipc_cache")]
        wrong = run_preload("generate", tiny_llama, "--prompt-ids", "1,2", "--tp-size", "2", "--devices", "cpu:1,cpu:0",
                            "--no-fallback", "--runtime-dir", runtime_dir, timeout=300)
        assert wrong.returncode == 1
        assert "tp_rank (1 here, 0 asked)" in wrong.stderr and "tp_rank (0 here, 1 asked)" in wrong.stderr
    finally:
        stop_daemons(runtime_dir)


@pytest.mark.parametrize("args, env, message", [
    (["--tp-size", "0"], {}, "--tp-size must be at least 1, got 0"),
    (["--threads", "-1"], {}, "--threads must be 0..1024"),
    (["--threads", "100000"], {}, "--threads must be 0..1024 (0: the cores divided among the processes), got 100000"),
    (["--prefill-chunk", "-1"], {}, "--prefill-chunk must be >= 0 (0: prefill every prompt whole)"),
    (["--tp-size", "2"], {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' and WORLD_SIZE='2' must be whole numbers"),
    (["--tp-size", "2"], {"RANK": "0", "WORLD_SIZE": "3"}, "torchrun started 3 processes for --tp-size 2"),
    (["--tp-size", "2", "--devices", "cpu:0,cpu:0"], {}, "give one distinct device per rank"),
])
def test_bad_parallel_flags_are_one_clear_line(runtime_dir, tiny_llama, args, env, message):
    out = run_preload("generate", tiny_llama, "--prompt-ids", "1,2", "--load-format", "safetensors", *args,
                      "--runtime-dir", runtime_dir, env_extra=env)
    assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_dp_size_out_of_bounds(runtime_dir, tiny_llama):
    out = run_preload("engine", tiny_llama, "--dp-size", "1000", "--runtime-dir", runtime_dir)
    assert out.returncode == 1 and "--dp-size must be in [1, 64], got 1000" in out.stderr


def test_tp_size_that_does_not_fit_fails_before_loading(runtime_dir, tiny_llama):
    out = run_preload("generate", tiny_llama, "--prompt-ids", "1,2", "--tp-size", "3", "--load-format", "safetensors",
                      "--runtime-dir", runtime_dir)
    assert out.returncode == 1
    assert "tp_size 3 does not fit" in out.stderr and "TP sizes that fit: 1, 2, 4" in out.stderr


def test_a_draft_that_does_not_fit_the_tp_size_fails_before_any_rank_starts(runtime_dir, tiny_llama, checkpoints):
    """It failed on every rank, after the ranks had started and loaded the main weights."""
    draft = tiny_model("llama", checkpoints / "three-heads", num_attention_heads=3, num_key_value_heads=3,
                       hidden_size=96)
    out = run_preload("generate", tiny_llama, "--prompt-ids", "1,2", "--tp-size", "2", "--load-format", "safetensors",
                      "--speculative", "draft", "--draft-model", draft, "--runtime-dir", runtime_dir)
    assert out.returncode == 1 and f"{draft}/config.json" in out.stderr and "tp_size 2 does not fit" in out.stderr
    assert "TP rank" not in out.stderr and "loaded" not in out.stderr, out.stderr


@pytest.mark.slow
def test_killing_a_tp_rank_ends_the_engine_without_orphans(start_engine, runtime_dir, tiny_llama):
    engine = start_engine(tiny_llama, "safetensors", "--tp-size", "2")
    assert engine.ready["event"] == "ready", engine.stop()
    status, body = get(engine.url + "/ready")
    assert status == 200 and [r["rank"] for r in body["ranks"]] == [0, 1]
    assert all(r["weights_done"] >= r["weights_start"] > 0 for r in body["ranks"])
    assert complete(engine.url)["choices"][0]["text"] is not None
    follower = body["ranks"][1]["pid"]
    os.kill(follower, signal.SIGKILL)
    assert engine.proc.wait(15) == 1
    assert "TP rank 1" in engine.proc.stdout.read() + engine.stop()
    wait_until(lambda: exited(follower) and exited(engine.proc.pid), 15, what="the engine and its follower to exit")


@pytest.mark.slow
def test_a_stopped_tp_rank_ends_the_engine_after_the_step_timeout(start_engine, runtime_dir, tiny_llama):
    """A rank stopped (SIGSTOP) or hung holds every collective with no error: requests waited for good
    while /health and /ready said alive and ready."""
    import threading
    engine = start_engine(tiny_llama, "safetensors", "--tp-size", "2", "--tp-step-timeout", "2")
    assert engine.ready["event"] == "ready", engine.stop()
    follower = get(engine.url + "/ready")[1]["ranks"][1]["pid"]
    os.kill(follower, signal.SIGSTOP)
    try:
        threading.Thread(target=lambda: _quietly(complete, engine.url), daemon=True).start()
        assert engine.proc.wait(30) == 1
    finally:
        _quietly(os.kill, follower, signal.SIGCONT)
    out = engine.proc.stdout.read() + engine.stop()
    assert f"a step has waited 2 s (--tp-step-timeout) for the other TP ranks: rank 1 (pid {follower}) is stopped" \
        in out, out
    wait_until(lambda: exited(follower), 15, what="the stopped rank to be ended too")


def test_a_long_step_at_work_is_not_taken_for_a_hung_rank(monkeypatch):
    """The step timeout timed rank 0's own work too: a long prompt prefilled whole on a large model
    would have ended a healthy engine. A step past it ends the engine only once no rank is at work."""
    import threading
    import types

    from worker import ranks
    exits = []
    monkeypatch.setattr(ranks.os, "_exit", exits.append)
    stopping = threading.Event()
    ranks.watch_followers([], stopping, [types.SimpleNamespace(step_since=time.monotonic())], 0.3)
    try:
        busy_until = time.monotonic() + 1.5
        while time.monotonic() < busy_until:  # rank 0 at work, 5 timeouts long
            pass
        assert exits == []
        wait_until(lambda: exits, 5, what="an idle step past the timeout to end the engine")
    finally:
        stopping.set()


def _quietly(call, *args):
    try:
        call(*args)
    except Exception:
        pass


@pytest.mark.slow
def test_dp_replicas_share_one_copy_and_survive_a_kill(start_engine, runtime_dir, default_model):
    """Two replicas behind one port map the daemon's slab (its pages counted once across them, in
    PSS); a killed replica leaves the endpoint answering and comes back warm."""
    served = run_preload("serve", default_model, "--no-supervise", runtime_dir=runtime_dir, timeout=300)
    assert served.returncode == 0, served.stderr
    try:
        engine = start_engine(default_model, "ipc_cache", "--dp-size", "2", "--no-fallback")
        assert engine.ready["event"] == "ready", engine.stop()
        status, body = get(engine.url + "/ready")
        assert status == 200 and body["status"] == "ready" and body["replicas_ready"] == 2
        for _ in range(4):
            assert complete(engine.url)["choices"][0]["finish_reason"] in ("length", "stop")
        huge = urllib.request.Request(engine.url + "/v1/completions", b" " * ((64 << 20) + 1),
                                      {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:  # the router's limit, as an engine's
            urllib.request.urlopen(huge, timeout=60)
        assert err.value.code == 413 and "over 64 MiB" in json.load(err.value)["error"]["message"]
        replicas = [r["engine"]["pid"] for r in body["replicas"]]
        shm = DaemonConfig(runtime_dir=runtime_dir).shm_dir
        slab_pss = [slab_memory(pid, shm) for pid in replicas]
        slab_size = sum(f.stat().st_size for f in shm.iterdir())
        for pss, private, rss in slab_pss:
            assert rss > 0.5 * slab_size, "a replica does not map the slab"
            assert private == 0, "a replica holds private copies of slab pages"
        daemon_pid = next(d["pid"] for d in json.loads(run_preload("status", "--json", runtime_dir=runtime_dir)
                                                        .stdout)["daemons"])
        total = sum(p for p, _, _ in slab_pss) + slab_memory(daemon_pid, shm)[0]
        assert total <= 1.02 * slab_size, f"{total} bytes of slab PSS for a {slab_size}-byte slab: more than one copy"
        for p in replicas:
            assert psutil.Process(p).memory_full_info().uss < slab_size, "a replica's own memory holds the weights"

        # A stream the killed replica was serving ends with an error event, not a bare cut, and its
        # request no longer counts against the replica (a count left behind starved its successor).
        body = json.dumps({"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}).encode()
        stream = urllib.request.urlopen(urllib.request.Request(engine.url + "/v1/completions", body,
                                                               {"Content-Type": "application/json"}), timeout=60)
        assert stream.readline().startswith(b"data: ")
        status, during = get(engine.url + "/ready")
        serving = next(r for r in during["replicas"] if r["in_flight"] == 1)
        os.kill(serving["engine"]["pid"], signal.SIGKILL)
        rest = stream.read().decode()
        assert '"error"' in rest and "the engine replica serving this request stopped" in rest, rest[-300:]
        for _ in range(3):
            assert complete(engine.url)["choices"][0]["text"] is not None
        body = wait_for_status(engine.url, "ready", 60)
        back = body["replicas"][serving["replica"]]
        assert back["restarts"] == 1 and back["engine"]["pid"] != serving["engine"]["pid"]
        assert back["engine"]["load_format"] == "ipc_cache"
        assert [r["in_flight"] for r in body["replicas"]] == [0, 0]
        metrics = urllib.request.urlopen(engine.url + "/metrics", timeout=30).read().decode()
        assert f'preload_engine_ready{{model="{default_model.name}",replica="1"}} 1.0' in metrics
        assert f'preload_router_replica_restarts_total{{replica="{serving["replica"]}"}} 1' in metrics
        meta = [line for line in metrics.splitlines() if line.startswith("#")]
        assert len(meta) == len(set(meta)), "a metric family's HELP or TYPE repeated (split across replicas)"

        # A replica that stops answering (stopped, hung) leaves the rotation, and comes back once it
        # answers again (one failed connection took a live replica out for good).
        stopped = body["replicas"][1]["engine"]["pid"]
        os.kill(stopped, signal.SIGSTOP)
        try:
            body = wait_for_status(engine.url, "degraded", 30)
            assert body["replicas"][1]["answering"] is False
            for _ in range(3):
                assert complete(engine.url)["choices"][0]["text"] is not None
        finally:
            os.kill(stopped, signal.SIGCONT)
        body = wait_for_status(engine.url, "ready", 30)
        assert body["replicas"][1]["engine"]["pid"] == stopped and body["replicas"][1]["restarts"] == 0

        # SIGTERM: the replicas are stopped and the router's socket directory removed.
        router = engine.proc.pid
        children = [c.pid for c in psutil.Process(router).children(recursive=True)]
        engine.stop()
        wait_until(lambda: all(map(exited, children)), 15, what="the router's replicas to exit")
        assert not list(runtime_dir.glob("engine-*")), list(runtime_dir.iterdir())
    finally:
        stop_daemons(runtime_dir)


def wait_for_status(url: str, status: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _, body = get(url + "/ready")
        if body["status"] == status:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.2)


def slab_memory(pid: int, shm_dir) -> tuple[int, int, int]:
    """(PSS, private bytes, RSS) of the process's mappings of slab files, from /proc/PID/smaps."""
    pss = private = rss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = len(fields) >= 6 and fields[5].startswith(str(shm_dir))
            elif inside and fields[0] == "Pss:":
                pss += int(fields[1]) * 1024
            elif inside and fields[0] in ("Private_Clean:", "Private_Dirty:"):
                private += int(fields[1]) * 1024
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1]) * 1024
    return pss, private, rss


@pytest.mark.slow
def test_ranks_started_by_torchrun(runtime_dir, tiny_llama):
    """torchrun starts both ranks itself (RANK/WORLD_SIZE): the engine joins its group and spawns nothing."""
    tp1 = generate(tiny_llama, runtime_dir, "--load-format", "safetensors")
    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "preload_cli", "generate",
                          str(tiny_llama), "--prompt-ids", "5,17,99,3", "--max-tokens", "8", "--load-format",
                          "safetensors", "--tp-size", "2", "--runtime-dir", str(runtime_dir)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["token_ids"] == tp1["token_ids"] and [r["rank"] for r in result["ranks"]] == [0, 1]
