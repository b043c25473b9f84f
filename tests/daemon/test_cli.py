"""`preload` commands run as a user would run them."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from tests.conftest import REPO, run_preload


def daemon_pids(runtime_dir) -> list[int]:
    out = run_preload("status", "--json", runtime_dir=runtime_dir, check=True).stdout
    return [d["pid"] for d in json.loads(out)["daemons"]]


def test_serve_status_wait_ready_evict(runtime_dir, tiny_llama):
    out = run_preload("serve", tiny_llama, "--no-supervise", runtime_dir=runtime_dir)
    assert out.returncode == 0, out.stderr
    assert "ready: tiny-llama v1 on cpu:0" in out.stdout
    try:
        status = run_preload("status", runtime_dir=runtime_dir, check=True).stdout
        assert "serving" in status
        header, row = [line for line in status.splitlines() if "tiny-llama" in line or line.startswith("MODEL")]
        assert header.split()[:3] == ["MODEL", "VERSION", "ACTIVE"] and row.split()[:3] == ["tiny-llama", "1", "*"]
        doc = json.loads(run_preload("status", "--json", runtime_dir=runtime_dir, check=True).stdout)
        assert doc["daemons"][0]["models"][0]["key"]["architecture"] == "LlamaForCausalLM"

        assert run_preload("wait-ready", "--model", "tiny-llama", "--timeout", "5", runtime_dir=runtime_dir).returncode == 0
        missing = run_preload("wait-ready", "--model", "other", "--timeout", "0.5", runtime_dir=runtime_dir)
        assert missing.returncode == 1 and "'other' is not loaded on cpu:0 (loaded: tiny-llama)" in missing.stderr

        again = run_preload("serve", tiny_llama, "--no-supervise", runtime_dir=runtime_dir)
        assert "v1" in again.stdout and len(daemon_pids(runtime_dir)) == 1, "serve must reuse the daemon"

        bad = run_preload("evict", "tiny-llama@x", runtime_dir=runtime_dir)
        assert bad.returncode == 2 and "use MODEL@N" in bad.stderr
        evicted = run_preload("evict", "tiny-llama@1", runtime_dir=runtime_dir)
        assert evicted.returncode == 0 and "evicted tiny-llama v1 from cpu:0" in evicted.stdout
    finally:
        for pid in daemon_pids(runtime_dir):
            os.kill(pid, signal.SIGTERM)


def test_wait_ready_without_daemon_times_out_with_reason(runtime_dir):
    out = run_preload("wait-ready", "--timeout", "0.3", runtime_dir=runtime_dir)
    assert out.returncode == 1 and "no daemon in" in out.stderr


def test_serve_bad_input_is_one_clear_line(runtime_dir, tiny_llama, tmp_path):
    out = run_preload("serve", tmp_path, "--no-supervise", runtime_dir=runtime_dir)
    assert out.returncode == 1 and "config.json is missing" in out.stderr
    out = run_preload("serve", tiny_llama, "--tp-size", "2", "--devices", "cpu:0", runtime_dir=runtime_dir)
    assert out.returncode == 1 and "give one distinct device per rank" in out.stderr
    out = run_preload("serve", tiny_llama, "--quantization", "fp5", runtime_dir=runtime_dir)
    assert out.returncode == 2 and "invalid choice: 'fp5'" in out.stderr
    for pid in daemon_pids(runtime_dir):
        os.kill(pid, signal.SIGTERM)


def test_serve_supervises_and_exits_nonzero_when_a_daemon_dies(runtime_dir, tiny_llama):
    """serve --tp-size 2 starts two daemons, loads both ranks and watches them; a killed daemon ends
    serve with exit code 1, and Ctrl-C on a healthy serve stops the daemons it started."""
    env = {**os.environ, "PRELOAD_RUNTIME_DIR": str(runtime_dir)}
    cmd = [sys.executable, "-m", "preload_cli", "serve", str(tiny_llama), "--tp-size", "2"]

    def start():
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        lines = []
        while not any("serving on cpu:0, cpu:1" in line for line in lines):
            line = proc.stdout.readline()
            assert line, f"serve ended early: {lines} {proc.stderr.read()}"
            lines.append(line)
        return proc, lines

    proc, lines = start()
    assert sum("ready: tiny-llama v1" in line for line in lines) == 2
    pids = daemon_pids(runtime_dir)
    assert len(pids) == 2
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "serve left its daemons running"
        time.sleep(0.1)

    proc, _ = start()
    os.kill(daemon_pids(runtime_dir)[1], signal.SIGKILL)
    assert proc.wait(30) == 1
    assert "cpu:1" in proc.stderr.read()
