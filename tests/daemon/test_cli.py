"""`preload` commands run as a user would run them: the first `serve` as its own process, the
others through preload's main() in this process (run_cli), which saves an interpreter start each."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import save_file

from preload_daemon.client import DaemonClient
from preload_daemon.errors import CheckpointError
from preload_daemon.plan import LoadSpec
from tests.conftest import REPO, copy_checkpoint, exited, run_cli, run_preload, wait_until


def daemon_pids(runtime_dir) -> list[int]:
    """The pids of the daemons that answer (status exits 1 when one does not)."""
    out = run_cli("status", "--json", runtime_dir=runtime_dir).stdout
    return [d["pid"] for d in json.loads(out)["daemons"] if "pid" in d]


def test_serve_status_wait_ready_evict(runtime_dir, tiny_llama):
    out = run_preload("serve", tiny_llama, "--no-supervise", runtime_dir=runtime_dir)
    assert out.returncode == 0, out.stderr
    assert "ready: tiny-llama v1 (main) on cpu:0" in out.stdout
    try:
        status = run_cli("status", runtime_dir=runtime_dir, check=True).stdout
        assert "serving" in status
        header = next(line for line in status.splitlines() if line.startswith("MODEL"))
        row = next(line for line in status.splitlines() if line.startswith("tiny-llama"))
        assert header.split()[:4] == ["MODEL", "VERSION", "DEVICE", "ACTIVE"]
        assert row.split()[:4] == ["tiny-llama", "1", "cpu:0", "*"]
        doc = json.loads(run_cli("status", "--json", runtime_dir=runtime_dir, check=True).stdout)
        daemon = doc["daemons"][0]
        assert daemon["models"][0]["key"]["architecture"] == "LlamaForCausalLM"
        # 64-bit integers are numbers, as jq compares them (protobuf's JSON mapping writes strings)
        assert type(daemon["resident_bytes"]) is int and daemon["resident_bytes"] > 0
        assert type(daemon["models"][0]["slab_bytes"]) is int and doc["stale_sockets"] == []

        assert run_cli("wait-ready", "--model", "tiny-llama", "--timeout", "5", runtime_dir=runtime_dir).returncode == 0
        missing = run_cli("wait-ready", "--model", "other", "--timeout", "0.5", runtime_dir=runtime_dir)
        assert missing.returncode == 1 and "'other' is not loaded (loaded: tiny-llama)" in missing.stderr

        again = run_cli("serve", tiny_llama, "--no-supervise", runtime_dir=runtime_dir)
        assert "v1" in again.stdout and len(daemon_pids(runtime_dir)) == 1, "serve must reuse the daemon"

        bad = run_cli("evict", "tiny-llama@x", runtime_dir=runtime_dir)
        assert bad.returncode == 2 and "use MODEL@N" in bad.stderr
        evicted = run_cli("evict", "tiny-llama@1", runtime_dir=runtime_dir)
        assert evicted.returncode == 0 and "evicted tiny-llama v1 (float32/none rank 0/1) from cpu:0" in evicted.stdout
        # the record (its last number) stays, but a model with no version left is not counted as held
        status = run_cli("status", runtime_dir=runtime_dir, check=True).stdout.splitlines()
        columns = dict(zip(status[0].split(), re.split(r"\s{2,}", status[1])))
        assert (columns["MODELS"], columns["RESIDENT"]) == ("0", "0 B"), status
        assert not any(line.startswith("tiny-llama") for line in status)
    finally:
        for pid in daemon_pids(runtime_dir):
            os.kill(pid, signal.SIGTERM)


def test_wait_ready_without_daemon_times_out_with_reason(runtime_dir):
    out = run_cli("wait-ready", "--timeout", "0.3", runtime_dir=runtime_dir)
    assert out.returncode == 4 and "no daemon in" in out.stderr
    out = run_cli("wait-ready", "--version", "2", runtime_dir=runtime_dir)
    assert out.returncode == 2 and "--version needs --model" in out.stderr


def test_publish_rollback_pin_and_wait_ready_codes(runtime_dir, tiny_llama, tmp_path):
    """The RL loop's commands as a user types them, and wait-ready's exit codes for a version."""
    second = tmp_path / "step-2"
    tensors = copy_checkpoint(tiny_llama, second)
    save_file({k: v * 0.5 for k, v in tensors.items()}, str(second / "model.safetensors"))
    assert run_cli("serve", tiny_llama, "--name", "m", "--no-supervise", runtime_dir=runtime_dir).returncode == 0
    try:
        waiting = run_cli("wait-ready", "--model", "m", "--version", "2", "--timeout", "0.3", runtime_dir=runtime_dir)
        assert waiting.returncode == 1 and "v2 is not published yet" in waiting.stderr
        out = run_cli("publish", "m", "--from", second, "--json", runtime_dir=runtime_dir)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["version"], doc["created"], doc["devices"]) == (2, True, ["cpu:0"])
        assert run_cli("wait-ready", "--model", "m", "--version", "2", runtime_dir=runtime_dir).returncode == 0
        assert run_cli("pin", "m@1", runtime_dir=runtime_dir).stdout.strip() == "m v1 pinned on cpu:0"
        status = run_cli("status", runtime_dir=runtime_dir, check=True).stdout
        rows = [line.split()[:5] for line in status.splitlines() if line.startswith("m ")]
        assert rows[:2] == [["m", "1", "cpu:0", "pin", "ready"], ["m", "2", "cpu:0", "*", "ready"]], status
        out = run_cli("rollback", "m", "--to", "1", runtime_dir=runtime_dir)
        assert out.returncode == 0 and "v1 is active on cpu:0" in out.stdout
        status = json.loads(run_cli("status", "--json", runtime_dir=runtime_dir, check=True).stdout)
        assert status["daemons"][0]["summaries"][0]["active_version"] == 1
        out = run_cli("evict", "m@1", runtime_dir=runtime_dir)
        assert out.returncode == 1 and "m v1 is pinned on cpu:0; `preload unpin m@1` first" in out.stderr
        bad = run_cli("publish", "m", "--from", tmp_path / "nowhere", runtime_dir=runtime_dir)
        assert bad.returncode == 1 and "not a directory" in bad.stderr
        assert "this publish left the active version of m as it was" in bad.stderr
        failed = run_cli("wait-ready", "--model", "m", "--version", "3", "--timeout", "5", runtime_dir=runtime_dir)
        assert failed.returncode == 3 and "not a directory" in failed.stderr
        broken = tmp_path / "broken"  # a load that fails before it is given a number
        copy_checkpoint(tiny_llama, broken)
        (broken / "model.safetensors").write_bytes((tiny_llama / "model.safetensors").read_bytes()[:5000])
        with DaemonClient(runtime_dir / "daemon-cpu-0.sock") as client, pytest.raises(CheckpointError):
            client.load(LoadSpec(path=str(broken), name="m"))  # a bare LoadModel asks for no number (serve and publish do)
        status = run_cli("status", runtime_dir=runtime_dir).stdout
        failures = status.partition("recent failed loads:\n")[2].splitlines()
        assert failures[0].startswith("  m a new version: CheckpointError: ") and failures[0].endswith("(on cpu:0)")
        assert failures[1].startswith("  m v3: CheckpointError: ") and "not a directory" in failures[1], status
        assert run_cli("rollback", "m", "--to", "7", runtime_dir=runtime_dir).returncode == 1
        assert run_cli("pin", "m", runtime_dir=runtime_dir).returncode == 2
    finally:
        for pid in daemon_pids(runtime_dir):
            os.kill(pid, signal.SIGTERM)


def test_serve_bad_input_is_one_clear_line(runtime_dir, tiny_llama, tmp_path):
    out = run_cli("serve", tmp_path, "--no-supervise", runtime_dir=runtime_dir)
    assert out.returncode == 1 and "config.json is missing" in out.stderr
    out = run_cli("serve", tiny_llama, "--tp-size", "2", "--devices", "cpu:0", runtime_dir=runtime_dir)
    assert out.returncode == 1 and "give one distinct device per rank" in out.stderr
    out = run_cli("serve", tiny_llama, "--quantization", "fp5", runtime_dir=runtime_dir)
    assert out.returncode == 2 and "invalid choice: 'fp5'" in out.stderr
    # before any daemon starts (it started them, and used up a version number, before refusing)
    out = run_cli("serve", tiny_llama, "--tp-size", "3", "--no-supervise", runtime_dir=runtime_dir)
    assert out.returncode == 1 and "tp_size 3 does not fit" in out.stderr, out.stderr
    assert not list(pathlib.Path(runtime_dir).glob("daemon-cpu-*.log")), "a daemon was started"
    for name in ("llama@3", " llama"):  # `evict llama@3` would mean version 3 of llama
        out = run_cli("serve", tiny_llama, "--name", name, "--no-supervise", runtime_dir=runtime_dir)
        assert out.returncode == 1 and f"model name {name!r} has an '@' or spaces at an end" in out.stderr, out.stderr
        assert "give another with --name" in out.stderr
    out = run_cli("status", "--json", runtime_dir=runtime_dir, check=True)
    assert [m for d in json.loads(out.stdout)["daemons"] for m in d.get("summaries", [])] == []
    for pid in daemon_pids(runtime_dir):
        os.kill(pid, signal.SIGTERM)


@pytest.mark.parametrize("flags, message", [
    (["--threads", "-1"], "--threads must be 0..1024 (0: every core; this host has "),
    (["--threads", "100000"], "got 100000"),
    (["--load-timeout", "0"], "--load-timeout must be positive"),
    (["--max-sessions", "0"], "--max-sessions at least 1"),
])
def test_daemon_bad_flags_are_one_clear_line_and_leave_no_shared_memory(tmp_path, flags, message):
    """Refused before anything is made: no /dev/shm/preload-* directory (nor its record)."""
    runtime_dir = tmp_path / "rt"
    out = run_cli("daemon", *flags, runtime_dir=runtime_dir)
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert not (runtime_dir / "shm-dir").exists()  # written beside the directory it names


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
    share = max(1, (os.cpu_count() or 1) // 2)  # each daemon its share of the cores, as it reports at start
    for device in ("cpu-0", "cpu-1"):
        assert f"{share} compute thread" in (runtime_dir / f"daemon-{device}.log").read_text()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    wait_until(lambda: all(map(exited, pids)), 10, what="serve's daemons to exit (serve left them running)")

    proc, _ = start()
    os.kill(daemon_pids(runtime_dir)[1], signal.SIGKILL)
    assert proc.wait(30) == 1
    assert "cpu:1" in proc.stderr.read()


@pytest.mark.parametrize("args, message", [
    (("engine", "--port", "70000"), "argument --port: 70000 is not a port"),
    (("engine", "--port", "-1"), "argument --port: -1 is not a port"),
    (("engine", "--wait-for-daemon", "nan"), "argument --wait-for-daemon: 'nan': seconds must be a finite number"),
    (("wait-ready", "--timeout", "inf", "--model", "x"), "argument --timeout: 'inf': seconds must be a finite"),
    (("serve", "--keep", "-1"), "argument --keep: -1: versions to keep must be in [0, "),
    (("publish", "m", "--from", "/nonexistent", "--keep", "-1"), "argument --keep: -1: versions to keep must be in [0, "),
    (("rollback", "m", "--to", "99999999999999"), "argument --to: 99999999999999: a version must be in [1, "),
    (("evict", "m@99999999999999"), "bad version '99999999999999' in 'm@99999999999999'"),
    (("evict", "m@²"), "bad version '²' in 'm@²'"),
    (("pin", "m@²"), "'m@²': use NAME@VERSION"),
    (("snapshot", "restore", "D", "--port", "65536"), "argument --port: 65536 is not a port"),
    (("snapshot", "create", "--engine", "http://x", "--dir", "D", "--drain-timeout", "1e10"),
     "argument --drain-timeout: '1e10': seconds must be a finite number from 0 to 604800 (a week)"),
    (("evict", "@3"), "no model name in '@3'; use MODEL or MODEL@N"),
    (("bench", "attach", "--sizes-gb", "0.1,1e9"), "argument --sizes-gb: '1e9': a size in GB must be a number in (0, "),
    (("bench", "restart", "--synthetic-gb", "nan"), "argument --synthetic-gb: 'nan': a size in GB must be a number"),
    (("bench", "decode", "--batch", "0"), "argument --batch: 0: requests must be in [1, 256]"),
    (("demo", "--repeats", "0"), "argument --repeats: 0: repeats must be in [1, 1000]"),
    (("demo", "--runtime-dir", "D"), "unrecognized arguments: --runtime-dir D"),  # it makes a private one
    (("bench", "attach", "--runtime-dir", "D"), "unrecognized arguments: --runtime-dir D"),
    (("wait-ready", "--device", "foo"), "preload wait-ready: bad device 'foo': use cpu:N or cuda:N"),
    (("wait-ready", "--from", "/x"), "preload wait-ready: --from needs --model"),
    (("wait-ready", "--model", "m", "--from", "/nonexistent"), "preload wait-ready: /nonexistent: not a directory"),
    (("wait-ready", "--device", "cpu:99999999999999999999999"), "bad device 'cpu:99999999999999999999999'"),
])
def test_numbers_out_of_range_get_a_usage_error_not_a_traceback(runtime_dir, args, message):
    """A port past 65535 crashed the engine's server with a traceback (once an abort), a timeout of
    nan or inf waited for good, --keep -1 failed inside protobuf, a version past 2**31 in the RPC;
    a benchmark's 1e9 GB checkpoint was built until memory ran out, and --repeats 0 failed after
    all the work, in statistics. demo and bench took --runtime-dir and ignored it."""
    out = run_cli(*args, runtime_dir=None if args[0] in ("demo", "bench") else runtime_dir)
    assert out.returncode in (1, 2) and message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("planted", ["daemon-cpu-0.sock", "session-cpu-0.sock", "daemon-cpu-0.lock"])
def test_a_directory_where_a_socket_or_the_lock_goes_is_one_line(runtime_dir, planted):
    """Each was a traceback (IsADirectoryError), and left the daemon's other socket behind."""
    (runtime_dir / planted).mkdir()
    out = run_preload("daemon", runtime_dir=runtime_dir, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot start the daemon for cpu:0: Is a directory: {runtime_dir / planted}; remove what is in the way" \
        in out.stderr, out.stderr
    assert sorted(p.name for p in runtime_dir.iterdir() if p.name.endswith(".sock")) == \
        ([planted] if planted.endswith(".sock") else [])


def test_a_busy_http_port_is_one_line_and_leaves_no_socket(runtime_dir):
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        out = run_preload("daemon", "--http-port", port, runtime_dir=runtime_dir, timeout=60)
    finally:
        busy.close()
    assert out.returncode == 1 and f"--http-port {port}: cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not list(runtime_dir.glob("*.sock"))


def test_a_runtime_dir_too_long_for_its_sockets_is_refused_at_start(runtime_dir):
    """A path of 70-88 bytes let the daemon start, and a DP replica's or a snapshot's socket failed
    later; past 88 the daemon failed with a traceback. The refused daemon leaves no shared-memory
    directory behind (it had made an empty /dev/shm/preload-* before it refused)."""
    long_dir = runtime_dir / ("x" * (99 - len(str(runtime_dir))))  # 100 bytes in all
    for command, most in ((("daemon",), 83), (("engine", "--dp-size", "2", "--load-format", "safetensors"), 67)):
        out = run_preload(*command, runtime_dir=long_dir, timeout=120)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"the runtime directory {long_dir} is 100 bytes long" in out.stderr, out.stderr
        assert f"at most {most} bytes long" in out.stderr
    assert not (long_dir / "shm-dir").exists()  # the record of one made (other tests' may come and go)


def test_a_planted_daemon_log_is_not_written_through(runtime_dir, tiny_llama, tmp_path):
    """serve appended the daemon's log to whatever a link at its name pointed to."""
    victim = tmp_path / "victim"
    victim.write_text("precious data")
    (runtime_dir / "daemon-cpu-0.log").symlink_to(victim)
    out = run_cli("serve", tiny_llama, "--no-supervise", runtime_dir=runtime_dir)
    assert out.returncode == 1 and "cannot open the daemon's log" in out.stderr and "remove it" in out.stderr
    assert victim.read_text() == "precious data"


def test_ctrl_c_while_serve_loads_ends_it_and_says_what_became_of_the_load(runtime_dir, tmp_path):
    """serve took SIGINT and SIGTERM as 'stop watching' from its start: a load of minutes went on,
    then serve exited 0 with the version loaded."""
    from preload_cli.models import synthetic_checkpoint
    model = synthetic_checkpoint(tmp_path / "synthetic", 0.3)
    env = {**os.environ, "PRELOAD_RUNTIME_DIR": str(runtime_dir)}
    proc = subprocess.Popen([sys.executable, "-m", "preload_cli", "serve", str(model), "--quantization", "mxfp4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while '"loading"' not in run_cli("status", "--json", runtime_dir=runtime_dir).stdout:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        pids = daemon_pids(runtime_dir)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM while loading; stopping the daemons this command started (cpu:0)" in err, err
    assert "ready:" not in out and "Traceback" not in err
    wait_until(lambda: all(map(exited, pids)), 10, what="serve's daemon to exit (serve left it running)")


def test_wait_ready_fails_on_a_stale_active_version_and_says_how_to_reload(runtime_dir, tiny_llama, tmp_path):
    """A version whose files changed on disk (chown -R, a new checkpoint written over the old) was
    'ready' to wait-ready and status, and engines started on its files refused it."""
    model = tmp_path / "m"
    copy_checkpoint(tiny_llama, model)
    assert run_cli("serve", model, "--no-supervise", runtime_dir=runtime_dir).returncode == 0
    try:
        assert run_cli("wait-ready", "--model", "m", runtime_dir=runtime_dir).returncode == 0
        os.chmod(model / "model.safetensors", 0o600)  # its ctime changes: the daemon can no longer vouch for it
        out = run_cli("wait-ready", "--model", "m", "--timeout", "5", runtime_dir=runtime_dir)
        assert out.returncode == 3, out.stderr
        assert "m v1 on cpu:0 is stale (checkpoint changed on disk since it was loaded" in out.stderr
        assert f"`preload serve {model} --name m` loads them again" in out.stderr  # (without --name: another model)
        status = run_cli("status", runtime_dir=runtime_dir, check=True).stdout
        assert any(line.split()[:5] == ["m", "1", "cpu:0", "*", "stale"] for line in status.splitlines()), status
        by_number = run_cli("wait-ready", "--model", "m", "--version", "1", runtime_dir=runtime_dir)
        assert by_number.returncode == 0, by_number.stderr  # attaching by number still works
    finally:
        for pid in daemon_pids(runtime_dir):
            os.kill(pid, signal.SIGTERM)


def test_status_escapes_what_it_did_not_write_and_tells_a_dead_daemons_socket_from_a_hung_daemon(
        runtime_dir, tiny_llama, tmp_path):
    """A checkpoint directory named with an escape sequence and a newline drove the terminal and
    broke the table. The socket a SIGKILL-ed daemon left behind made wait-ready --model fail for
    every model; a hung daemon made evict say the model was not loaded, and status exit 0."""
    import socket
    model = tmp_path / "m\x1b[31mX\nINJECTED"
    copy_checkpoint(tiny_llama, model)
    assert run_cli("serve", model, "--name", "m", "--no-supervise", runtime_dir=runtime_dir).returncode == 0
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(runtime_dir / "daemon-cpu-1.sock"))  # what a daemon killed with SIGKILL leaves
    stale.close()
    pid = daemon_pids(runtime_dir)[0]
    try:
        out = run_cli("status", runtime_dir=runtime_dir)
        assert out.returncode == 0 and "\x1b" not in out.stdout and "\\x1b[31mX\\nINJECTED" in out.stdout, out.stdout
        assert not any(line.startswith("INJECTED") for line in out.stdout.splitlines())
        assert f"daemons that are gone (a new daemon for the device replaces its socket):\n  cpu:1: {runtime_dir}" \
            in out.stdout, out.stdout
        assert run_cli("wait-ready", "--model", "m", "--timeout", "3", runtime_dir=runtime_dir).returncode == 0
        os.kill(pid, signal.SIGSTOP)
        try:
            out = run_cli("status", runtime_dir=runtime_dir)
            assert out.returncode == 1 and "\nunreachable daemons:\n  cpu:0: the daemon on " in out.stdout, out.stdout
            assert "did not answer within 3s: it may be hung or stopped" in out.stdout
            evict = run_cli("evict", "m", runtime_dir=runtime_dir)
            assert evict.returncode == 1 and "daemon cpu:0 does not answer, so whether it holds 'm' is unknown" \
                in evict.stderr, evict.stderr
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        os.kill(pid, signal.SIGTERM)


def test_an_engine_on_a_busy_port_or_an_unknown_host_is_one_line(runtime_dir, tiny_llama):
    """uvicorn's own text (no flag named) and exit code 3, after the weights had loaded."""
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        for args, message in ((("--port", port), f"--port {port}: cannot listen on 127.0.0.1:{port} (Address already "
                                                  "in use); pick a free port"),
                              (("--host", "host.invalid"), "--host host.invalid: ")):
            out = run_preload("engine", tiny_llama, "--load-format", "safetensors", *args, runtime_dir=runtime_dir)
            assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    finally:
        busy.close()


def test_a_criu_named_by_preload_criu_is_used_or_refused_never_passed_over(runtime_dir):
    out = run_preload("snapshot", "check", runtime_dir=runtime_dir, env_extra={"PRELOAD_CRIU": "/bin/false"})
    assert out.returncode == 1 and "PRELOAD_CRIU=/bin/false is not a CRIU >= 4.1 that runs here" in out.stdout, \
        out.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly(runtime_dir):
    """`preload status --json | head -3` printed a BrokenPipeError traceback once the output passed
    the pipe's buffer; a reader gone at once shows it with any output."""
    read, write = os.pipe()
    os.close(read)
    try:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered: written at the end
        out = subprocess.run([sys.executable, "-m", "preload_cli", "status", "--json", "--runtime-dir",
                              str(runtime_dir)], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO,
                             env=env)
    finally:
        os.close(write)
    assert out.returncode == 141 and out.stderr == ""
