"""`preload snapshot` with real CRIU on the default model: create, kill the original, restore, the
same canary and completions; two restores side by side; refusals that leave nothing running.
The pure parts (manifest checks, refusals, canary comparison) are tested without CRIU."""

import ast
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from preload_daemon.config import DaemonConfig
from preload_daemon.plan import LoadSpec
from tests.conftest import REPO, DaemonHandle, exited, run_preload, wait_until
from tests.worker.conftest import EngineProcess, post
from worker import criu, snapshot, snapshot_images, snapshot_manifest
from worker.quiesce import canary_mismatch, request_matrix_units


def _host_can_snapshot() -> str:
    try:
        failed = [f"{c.name}: {c.detail}" for c in criu.check_host() if not c.ok]
    except Exception as e:  # noqa: BLE001 - any failure to check is a reason to skip
        return f"{type(e).__name__}: {e}"
    return "; ".join(failed)


WHY_NOT = _host_can_snapshot()


def needs_criu(test):
    return pytest.mark.criu(pytest.mark.skipif(bool(WHY_NOT), reason=f"cannot snapshot here: {WHY_NOT}")(test))
PROMPT = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


def complete(url: str, body: dict = PROMPT) -> str:
    return post(f"{url}/v1/completions", body)["choices"][0]["text"]


def chat(url: str) -> str:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    return post(f"{url}/v1/chat/completions", body)["choices"][0]["message"]["content"]


def get_ready(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/ready", timeout=10) as response:
        return json.load(response)


class Restore:
    """`preload snapshot restore DIR --detach` as a process; `ready` is its JSON line."""

    def __init__(self, directory, runtime_dir, *extra):
        self.run = run_preload("snapshot", "restore", directory, "--detach", *extra, runtime_dir=runtime_dir)
        lines = [line for line in self.run.stdout.splitlines() if line.startswith("{")]
        self.ready = json.loads(lines[-1]) if self.run.returncode == 0 and lines else {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ready['port']}"

    def stop(self) -> None:
        if self.ready:
            try:
                os.kill(self.ready["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def restore_processes(runtime) -> list[str]:
    """Restores of this runtime dir's snapshots still running: their namespaces' CRIU (the first
    process of each), which lives exactly as long as the restored engine in it. (Read whole from
    /proc: `ps` cuts its lines to the terminal's or $COLUMNS' width.)"""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmd = process.info["cmdline"] or []
        if len(cmd) > 2 and os.path.basename(cmd[0]) == "criu" and cmd[1] == "restore" \
                and any(f"{runtime}/snapshots/" in arg for arg in cmd):
            found.append(" ".join(cmd))
    return found


@pytest.fixture(scope="module")
def served(default_model):
    """A daemon holding the default model and a warm engine on it, in a runtime dir of their own."""
    if WHY_NOT:
        pytest.skip(f"cannot snapshot here: {WHY_NOT}")
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="pl-snap-", dir="/tmp"))
    daemon = DaemonHandle(runtime)
    daemon.client.load(LoadSpec(path=str(default_model)))
    engine = EngineProcess(default_model, "ipc_cache", runtime)
    assert engine.ready.get("load_format") == "ipc_cache", engine.ready
    state = {"runtime": runtime, "daemon": daemon, "engine": engine, "restores": [], "model": default_model}
    yield state
    for r in state["restores"]:
        r.stop()
    engine.stop()
    state["daemon"].stop()
    shutil.rmtree(DaemonConfig(runtime_dir=runtime).shm_dir, ignore_errors=True)
    shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def snap(served):
    """A snapshot of the served engine, taken while it serves (it goes on serving), after a chat
    request started its template renderer (a child process, which the quiet point ends)."""
    before = complete(served["engine"].url)
    assert chat(served["engine"].url)
    renderers = psutil.Process(served["engine"].proc.pid).children(recursive=True)
    assert [" ".join(p.cmdline()[1:3]) for p in renderers] == ["-m worker.template_process"]
    directory = served["runtime"] / "snap"
    run = run_preload("snapshot", "create", "--engine", served["engine"].url, "--dir", directory, "--json",
                      runtime_dir=served["runtime"], timeout=180)
    assert run.returncode == 0, run.stderr
    return {"dir": directory, "manifest": json.loads(run.stdout), "text": before, "renderers": renderers}


@needs_criu
def test_create_holds_the_engines_version_while_the_engine_lets_go_of_its_lease(tiny_llama, tmp_path):
    """An engine lets go of its lease at the quiet point: a version leased by that engine alone, out
    of --keep, was freed then, and the engine, unable to attach again after the dump, died."""
    from tests.conftest import copy_checkpoint
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="pl-snap-", dir="/tmp"))
    daemon, engine = DaemonHandle(runtime), None
    try:
        for i in range(3):
            copy_checkpoint(tiny_llama, tmp_path / f"c{i}")
        daemon.client.load(LoadSpec(path=str(tmp_path / "c0"), name="m"))
        engine = EngineProcess(tmp_path / "c0", "ipc_cache", runtime, "--name", "m", "--no-fallback")
        assert engine.ready.get("weights_version") == 1, engine.ready
        for i in (1, 2):  # v1, no longer active, is kept by the engine's lease alone
            daemon.client.load(LoadSpec(path=str(tmp_path / f"c{i}"), name="m"), keep=0)
        body = {"prompt": [5, 17, 99], "max_tokens": 4, "temperature": 0}
        before = post(f"{engine.url}/v1/completions", body)["choices"][0]["text"]
        run = run_preload("snapshot", "create", "--engine", engine.url, "--dir", runtime / "snap",
                          runtime_dir=runtime, timeout=180)
        assert run.returncode == 0, run.stderr
        assert post(f"{engine.url}/v1/completions", body)["choices"][0]["text"] == before  # it serves on
        assert sorted(m.version for m in daemon.client.list_models()) == [1, 3]  # (keep 0 freed v2)
    finally:
        if engine is not None:
            engine.stop()
        daemon.stop()
        shutil.rmtree(DaemonConfig(runtime_dir=runtime).shm_dir, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)


@needs_criu
def test_create_keeps_the_original_serving_and_records_the_manifest(served, snap):
    # The chat template's renderer, started before the snapshot, ended at the quiet point.
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in snap["renderers"])
    manifest = snap["manifest"]
    engine, model = manifest["engine"], manifest["engine"]["model"]
    assert (model["name"], model["version"]) == (served["model"].name, 1)
    assert model["content_digest"].startswith("xxh3_128:") and model["cache_key"]["content_digest"]
    assert engine["tp_size"] == 1 and engine["load_format"] == "ipc_cache" and engine["kernels"]
    for field in ("kernel", "criu", "python", "torch", "preload", "cpu_flags"):
        assert manifest["host"][field], field
    canary = manifest["canary"]
    assert len(canary["tokens"]) == len(canary["logprobs"]) > 0 and all(lp <= 0 for lp in canary["logprobs"])
    # Weights stay in the daemon: the image holds engine state only.
    assert manifest["image"]["bytes"] < 0.25 * manifest["image"]["weight_bytes"], manifest["image"]
    assert manifest["original"] == "serving"
    assert complete(served["engine"].url) == snap["text"]
    assert get_ready(served["engine"].url)["status"] == "ready"
    inspect = run_preload("snapshot", "inspect", snap["dir"], runtime_dir=served["runtime"])
    assert inspect.returncode == 0 and "canary" in inspect.stdout and model["content_digest"] in inspect.stdout


def _pipe_fds(inode_link: str) -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}") == inode_link for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


@needs_criu
def test_a_failed_dump_leaves_the_engine_serving(served, snap, tmp_path, monkeypatch):
    """CRIU fails (here a wrapper that fails every dump): with --stop too, the engine comes back from
    its quiet point and serves, the command says why, and keeps none of the engine's streams."""
    real, _ = criu.find_criu()
    wrapper = tmp_path / "criu"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = dump ] && {{ echo "Error (injected): no dump" >&2; '
                       f'exit 1; }}; done\nexec {real} "$@"\n')
    wrapper.chmod(0o700)
    monkeypatch.setenv(criu.CRIU_ENV, str(wrapper))
    engine = served["engine"]
    stdout = os.readlink(f"/proc/{engine.proc.pid}/fd/1")
    held = _pipe_fds(stdout)
    with pytest.raises(criu.SnapshotError, match="injected"):
        snapshot.create(engine.url, tmp_path / "failed", stop=True, runtime_dir=served["runtime"], log=lambda _: None)
    assert not (tmp_path / "failed").exists()  # made by the create, so removed with what it held
    assert _pipe_fds(stdout) == held
    assert get_ready(engine.url)["status"] == "ready" and complete(engine.url) == snap["text"]


@needs_criu
def test_with_stop_a_failure_after_the_dump_resumes_the_engine(served, snap, tmp_path, monkeypatch):
    """--stop ended the engine with the dump itself: packing into a full disk then lost both the
    engine and the snapshot. The engine is ended only once the snapshot is whole now, and serves on
    when anything before that fails."""
    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot, "pack", full)
    engine = served["engine"]
    with pytest.raises(criu.SnapshotError, match="cannot write the snapshot in .*: No space left on device"):
        snapshot.create(engine.url, tmp_path / "full", stop=True, runtime_dir=served["runtime"], log=lambda _: None)
    assert not (tmp_path / "full").exists()
    assert engine.proc.poll() is None and get_ready(engine.url)["status"] == "ready"
    assert complete(engine.url) == snap["text"]


@needs_criu
def test_a_second_snapshot_of_a_quiet_engine_is_refused(served, snap, tmp_path, monkeypatch):
    """A create that read /ready just before another quieted the engine: the quiet engine said it was
    ready, failed on its stopped server, and resumed itself in the middle of the first one's dump."""
    real, _ = criu.find_criu()
    wrapper = tmp_path / "criu"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = dump ] && sleep 3; done\nexec {real} "$@"\n')
    wrapper.chmod(0o700)
    monkeypatch.setenv(criu.CRIU_ENV, str(wrapper))
    engine = served["engine"]
    ready = snapshot.engine_readiness(engine.url)
    first = []
    thread = threading.Thread(target=lambda: first.append(snapshot.create(
        engine.url, tmp_path / "first", runtime_dir=served["runtime"], log=lambda _: None)))
    thread.start()
    try:
        wait_until(lambda: (tmp_path / "first" / "images" / "dump.log").exists(), 60, "the first dump to begin")
        (tmp_path / "second").mkdir(mode=0o700)
        with pytest.raises(criu.SnapshotError, match="at a quiet point for another snapshot; try again once it serves"):
            snapshot._create(engine.url, ready, tmp_path / "second", real, False, 5.0, served["runtime"],
                             lambda _: None)
    finally:
        thread.join(120)
    assert first and first[0]["original"] == "serving"
    assert get_ready(engine.url)["status"] == "ready" and complete(engine.url) == snap["text"]


@needs_criu
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_create_terminated_during_the_dump_resumes_the_engine(served, snap, tmp_path, sig):
    """SIGTERM or SIGHUP (a supervisor, a closed terminal) to `snapshot create` mid-dump ended the
    command at once and left the engine parked for 10 minutes; now it unwinds as Ctrl-C does."""
    real, _ = criu.find_criu()
    wrapper = tmp_path / "criu"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = dump ] && sleep 3; done\nexec {real} "$@"\n')
    wrapper.chmod(0o700)
    engine = served["engine"]
    command = subprocess.Popen([sys.executable, "-m", "preload_cli", "snapshot", "create", "--engine", engine.url,
                                "--dir", str(tmp_path / "snap")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, cwd=REPO, env={**os.environ, "PRELOAD_RUNTIME_DIR": str(served["runtime"]),
                                                         criu.CRIU_ENV: str(wrapper)})
    wait_until(lambda: (tmp_path / "snap" / "images" / "dump.log").exists(), 60, "the dump to begin")
    command.send_signal(sig)
    assert command.wait(60) != 0
    assert "Traceback" not in command.stderr.read()
    def serving() -> bool:
        try:
            return get_ready(engine.url)["status"] == "ready"
        except OSError:  # not listening yet
            return False

    wait_until(serving, 30, "the engine to serve again")
    assert complete(engine.url) == snap["text"] and not (tmp_path / "snap").exists()


@needs_criu
def test_requests_past_the_drain_time_end_with_a_message_to_retry(served, snap, tmp_path):
    """Requests still running when --drain-timeout ran out were cancelled by the HTTP server: a bare
    "500 Internal Server Error", or a stream cut mid-chunk (and tracebacks in the log). They end
    through their generation now: a 503 in OpenAI's shape, or a last chunk that says why, and [DONE]."""
    engine = served["engine"]
    body = {"prompt": "The capital of France is", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    answers, lines, first = [], [], threading.Event()

    def plain():
        try:
            post(f"{engine.url}/v1/completions", body)
            answers.append("answered")
        except urllib.error.HTTPError as e:
            answers.append((e.code, json.load(e)))

    def streamed():
        request = urllib.request.Request(f"{engine.url}/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            for line in response:
                lines.append(line.decode().strip())
                first.set()

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for thread in threads:
        thread.start()
    assert first.wait(30)
    snapshot.create(engine.url, tmp_path / "drained", drain_timeout=0.3, runtime_dir=served["runtime"],
                    log=lambda _: None)
    for thread in threads:
        thread.join(60)
    assert answers and answers[0][0] == 503, answers
    assert answers[0][1]["error"]["message"] == "the engine is pausing for a snapshot; send the request again"
    lines = [line for line in lines if line]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "error: the engine is pausing for a snapshot; send the " \
        "request again" and lines[-1] == "data: [DONE]", lines[-3:]
    assert complete(engine.url) == snap["text"]


def test_a_new_directory_is_claimed_before_the_engine_is_quieted(tmp_path, monkeypatch):
    """Two creates into one new directory: the second failed with a traceback after quieting its
    engine (left parked), and its cleanup wiped the first one's images."""
    snapshot._ensure_new_dir(tmp_path / "snap")
    with pytest.raises(criu.SnapshotError, match="exists and is not empty"):
        snapshot._ensure_new_dir(tmp_path / "snap")
    assert (tmp_path / "snap" / "images").is_dir()
    real = snapshot.check_ours

    def raced(directory):  # the other create claims it between this one's look and its claim
        real(directory)
        (directory / "images").mkdir()

    monkeypatch.setattr(snapshot, "check_ours", raced)
    with pytest.raises(criu.SnapshotError, match="is taken .another snapshot is being written there"):
        snapshot._ensure_new_dir(tmp_path / "other")
    monkeypatch.undo()
    (tmp_path / "nowhere").symlink_to(tmp_path / "missing")
    for bad in (tmp_path / "nowhere", pathlib.Path("/proc/preload-snap"), tmp_path / ("x" * 300)):
        with pytest.raises(criu.SnapshotError, match="is taken|cannot make"):
            snapshot._ensure_new_dir(bad)


@needs_criu
def test_create_from_another_runtime_directory_says_so(served, tmp_path):
    """The engine connects only to a control socket in its own runtime directory: a create run with
    another one waited 10 s and ended in a ControlError traceback, leaving its directory behind."""
    other = pathlib.Path(tempfile.mkdtemp(prefix="pl-other-", dir="/tmp"))  # short: a socket path's limit
    run = run_preload("snapshot", "create", "--engine", served["engine"].url, "--dir", tmp_path / "snap",
                      runtime_dir=other, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "its own runtime directory" in run.stderr and str(other) in run.stderr, run.stderr
    assert not (tmp_path / "snap").exists()
    assert get_ready(served["engine"].url)["status"] == "ready"
    shutil.rmtree(other)
    long = tmp_path / ("r" * 100)
    long.mkdir(mode=0o700)
    run = run_preload("snapshot", "create", "--engine", served["engine"].url, "--dir", tmp_path / "snap",
                      runtime_dir=long, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "use a shorter runtime directory" in run.stderr, run.stderr


@needs_criu
def test_two_restores_serve_beside_the_original(served, snap):
    running = len(restore_processes(served["runtime"]))
    unpacked = snapshot_images.cache_path(snap["dir"], served["runtime"])
    assert unpacked.is_dir()  # create left this host's unpacked copy; drop it: the first restore unpacks
    shutil.rmtree(unpacked)
    first = Restore(snap["dir"], served["runtime"], "--port", "0")
    second = Restore(snap["dir"], served["runtime"], "--port", "0")
    served["restores"] += [first, second]
    assert first.run.returncode == 0 and second.run.returncode == 0, (first.run.stderr, second.run.stderr)
    assert first.ready["pid"] != second.ready["pid"] and first.ready["port"] != second.ready["port"]
    assert len(restore_processes(served["runtime"])) == running + 2
    assert complete(first.url) == complete(second.url) == snap["text"]
    assert chat(first.url) == chat(second.url) == chat(served["engine"].url)  # each starts its own renderer
    assert complete(served["engine"].url) == snap["text"]  # and the original, which still runs


@needs_criu
def test_a_foreground_restore_killed_takes_its_engine_with_it(served, snap):
    """Without --detach the restored engine is the command's: killed with SIGKILL, the command left
    it serving, unsupervised, its lease held."""
    running = restore_processes(served["runtime"])
    command = subprocess.Popen([sys.executable, "-m", "preload_cli", "snapshot", "restore", str(snap["dir"]), "--port",
                                "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                               env={**os.environ, "PRELOAD_RUNTIME_DIR": str(served["runtime"])})
    try:
        ready = json.loads(command.stdout.readline())
        url = f"http://127.0.0.1:{ready['port']}"
        assert complete(url) == snap["text"]
    finally:
        command.kill()
        command.wait()
    # The engine's own process, not only CRIU's: an exiting CRIU drops out of restore_processes (its
    # command line goes with its memory) before the kernel has ended the namespace's other processes,
    # and the engine once answered /health in that window.
    wait_until(lambda: restore_processes(served["runtime"]) == running and exited(ready["pid"]), 20,
               "the restored engine to end")
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=5)


@needs_criu
def test_restore_from_another_runtime_directory_names_the_engines(served, snap, tmp_path):
    """The copy takes control sockets only from its own runtime directory: a restore from another
    waited out its whole --timeout (120 s) and then said nothing of why."""
    other = pathlib.Path(tempfile.mkdtemp(prefix="pl-other-", dir="/tmp"))
    try:
        restored = Restore(snap["dir"], other, "--port", "0", "--timeout", "20")
        assert restored.run.returncode == 1 and "Traceback" not in restored.run.stderr, restored.run.stderr
        assert f"restore it with PRELOAD_RUNTIME_DIR={served['runtime']}" in restored.run.stderr
    finally:
        shutil.rmtree(other)


@needs_criu
def test_stop_ends_the_engine_once_its_snapshot_is_whole(served, snap, tmp_path):
    """--stop: the manifest says so, the engine is gone when the command returns, and its snapshot
    restores on the port it listened on."""
    engine = EngineProcess(served["model"], "ipc_cache", served["runtime"])
    try:
        run = run_preload("snapshot", "create", "--engine", engine.url, "--dir", tmp_path / "stopped", "--stop",
                          "--json", runtime_dir=served["runtime"], timeout=180)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["original"] == "stopped" and exited(engine.proc.pid)
        restored = Restore(tmp_path / "stopped", served["runtime"])
        served["restores"].append(restored)
        assert restored.run.returncode == 0, restored.run.stderr
        assert restored.url == engine.url and complete(restored.url) == snap["text"]
    finally:
        engine.stop()


@needs_criu
def test_restore_after_the_original_is_killed(served, snap):
    served["engine"].proc.kill()
    served["engine"].proc.wait()
    restored = Restore(snap["dir"], served["runtime"], "--port", "0")
    served["restores"].append(restored)
    assert restored.run.returncode == 0, restored.run.stderr
    ready = get_ready(restored.url)
    assert ready["status"] == "ready" and ready["weights_version"] == 1
    # this host's pid for the copy, in the ranks too (its own namespace's is the original's)
    assert ready["pid"] == ready["ranks"][0]["pid"] == restored.ready["pid"] != served["engine"].proc.pid
    assert ready["restored"]["snapshot"] == str(snap["dir"])
    assert ready["restored"]["restore_start"] <= ready["restored"]["reattached"] <= ready["restored"]["ready"]
    assert complete(restored.url) == snap["text"]
    # A new lease, held by the restored process as this host knows it.
    holders = {lease.pid for m in served["daemon"].client.list_models() for lease in m.leases}
    assert restored.ready["pid"] in holders, holders


def _copy(snap_dir: pathlib.Path, target: pathlib.Path, edit) -> pathlib.Path:
    """A snapshot directory sharing `snap_dir`'s images (hard links), with an edited manifest."""
    target.mkdir(mode=0o700)
    (target / "images").mkdir(mode=0o700)
    for f in (snap_dir / "images").iterdir():
        os.link(f, target / "images" / f.name)
    manifest = json.loads((snap_dir / "manifest.json").read_text())
    edit(manifest)
    (target / "manifest.json").write_text(json.dumps(manifest))
    os.chmod(target / "manifest.json", 0o600)
    return target


@needs_criu
def test_restore_refuses_a_host_that_does_not_match(served, snap):
    def other_host(m):
        m["host"]["kernel"] = "5.4.0-ancient"
        m["host"]["cpu_flags"] = [*m["host"]["cpu_flags"], "avx512_made_up"]

    copy = _copy(snap["dir"], served["runtime"] / "other-host", other_host)
    running = restore_processes(served["runtime"])
    restored = Restore(copy, served["runtime"], "--port", "0")
    assert restored.run.returncode == 1
    assert "kernel" in restored.run.stderr and "avx512_made_up" in restored.run.stderr
    assert restore_processes(served["runtime"]) == running


@needs_criu
def test_restore_fails_closed_when_the_canary_differs(served, snap):
    def other_canary(m):
        m["canary"]["tokens"] = [t + 1 for t in m["canary"]["tokens"]]

    copy = _copy(snap["dir"], served["runtime"] / "other-canary", other_canary)
    running = restore_processes(served["runtime"])
    restored = Restore(copy, served["runtime"], "--port", "0")
    assert restored.run.returncode == 1 and "canary differs" in restored.run.stderr, restored.run.stderr
    assert restore_processes(served["runtime"]) == running


@needs_criu
def test_restore_refuses_without_the_daemon_or_with_other_weights(served, snap, tiny_llama):
    for r in served["restores"]:
        r.stop()
    served["daemon"].stop()
    wait_until(lambda: not restore_processes(served["runtime"]), 20, "the restored engines to end")
    running = []
    restored = Restore(snap["dir"], served["runtime"], "--port", "0")
    assert restored.run.returncode == 1 and "no daemon answers" in restored.run.stderr, restored.run.stderr
    assert restore_processes(served["runtime"]) == running
    # A new daemon holds other weights under the model's name (a changed model version).
    served["daemon"] = DaemonHandle(served["runtime"])
    served["daemon"].client.load(LoadSpec(path=str(tiny_llama), name=served["model"].name, dtype="bfloat16"))
    restored = Restore(snap["dir"], served["runtime"], "--port", "0")
    assert restored.run.returncode == 1 and "other weights" in restored.run.stderr, restored.run.stderr
    assert restore_processes(served["runtime"]) == running


# --- without CRIU ------------------------------------------------------------------------------

@pytest.mark.parametrize("ready, expected", [
    ({"status": "loading", "reason": "loading weights"}, "not ready"),
    ({"status": "ready", "tp_size": 2}, "TP 2"),
    ({"status": "ready", "tp_size": 1, "load_format": "safetensors"}, "--load-format ipc_cache"),
    ({"status": "ready", "tp_size": 1, "load_format": "ipc_cache"}, "DP replica"),
    ({"status": "ready", "dp_size": 2, "replicas_ready": 2}, "a data-parallel router over 2 replicas"),
    ({"status": "ready", "tp_size": 1, "load_format": "ipc_cache", "pid": 7, "snapshot": {"wake_fd": 4}}, ""),
])
def test_refusal_names_the_reason(ready, expected):
    why = snapshot_manifest.refusal(ready, "http://127.0.0.1:1")
    assert (expected in why) if expected else why == ""


def test_a_restored_engine_asks_again_for_the_cpus_matrix_units():
    """A process's permission to use AMX tiles is the kernel's, not a register CRIU restores: the
    resume asks for it again (granted exactly where the CPU has AMX), or a restored engine's first
    AMX GEMM would die of SIGILL."""
    assert request_matrix_units() == (os.uname().machine == "x86_64" and "amx_tile" in criu.cpu_flags())


def test_canary_comparison():
    canary = {"prompt_ids": [1, 2], "tokens": [3, 4], "logprobs": [-0.5, -1.0]}
    assert canary_mismatch(canary, dict(canary)) == ""
    assert canary_mismatch(canary, {**canary, "logprobs": [-0.5, -1.0005]}) == ""
    assert "tokens" in canary_mismatch(canary, {**canary, "tokens": [3, 5]})
    assert "log-probabilities" in canary_mismatch(canary, {**canary, "logprobs": [-0.5, -1.1]})


def test_manifest_checks(tmp_path):
    with pytest.raises(snapshot.SnapshotError, match="not a snapshot"):
        snapshot.read_manifest(tmp_path)
    os.chmod(tmp_path, 0o700)
    (tmp_path / "images").mkdir(mode=0o700)
    (tmp_path / "manifest.json").write_text("{not json")
    os.chmod(tmp_path / "manifest.json", 0o600)
    with pytest.raises(snapshot.SnapshotError, match="not a valid snapshot manifest"):
        snapshot.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "engine": {}}))
    with pytest.raises(snapshot.SnapshotError, match="not a valid snapshot manifest"):
        snapshot.read_manifest(tmp_path)
    os.chmod(tmp_path / "manifest.json", 0o666)
    with pytest.raises(snapshot.SnapshotError, match="not writable by group or others"):
        snapshot.read_manifest(tmp_path)


MINIMAL = {"format": 1, "created": "2026-12-07T00:00:00Z", "host": {}, "canary": {"tokens": [], "prompt_ids": []},
           "image": {"bytes": 4, "weight_bytes": 8},
           "engine": {"listen": {}, "wake_fd": 4, "pid": 7, "device": "cpu:0", "kernels": "avx2",
                      "model": {"name": "m", "version": 1, "cache_key": {"tp_size": 1}, "weight_bytes": 8,
                                "content_digest": "xxh3_128:0"}}}


def _snapshot_dir(path: pathlib.Path, manifest: dict) -> pathlib.Path:
    path.mkdir(mode=0o700)
    (path / "images").mkdir(mode=0o700)
    (path / "images" / "core-1.img").write_bytes(b"core")
    os.chmod(path / "images" / "core-1.img", 0o600)
    (path / "manifest.json").write_text(json.dumps(manifest))
    os.chmod(path / "manifest.json", 0o600)
    return path


@pytest.mark.parametrize("change, message", [
    (lambda d: os.chmod(d / "images" / "core-1.img", 0o666), "core-1.img must be owned by uid"),
    (lambda d: (d / "images" / "pages-1.img").symlink_to("/etc/passwd"), "pages-1.img must be owned by uid"),
    (lambda d: os.mkfifo(d / "images" / "files.img", 0o600), "files.img is not a regular file"),
    (lambda d: _rewrite(d, lambda m: m["engine"].update(device="../../../tmp/x")), "is not cpu:N or cuda:N"),
    (lambda d: _rewrite(d, lambda m: m["engine"]["model"]["cache_key"].update(tp_size="2")),
     "cache key tp_size is not a int"),
    (lambda d: _rewrite(d, lambda m: m.pop("image")), "not a valid snapshot manifest (KeyError: 'image')"),
    # what `inspect` and `restore` read past the checks ended in tracebacks (one after CRIU had started)
    (lambda d: shutil.rmtree(d / "images"), "has no images directory"),
    (lambda d: _rewrite(d, lambda m: m["engine"].pop("kernels")), "(KeyError: 'kernels')"),
    (lambda d: _rewrite(d, lambda m: m["engine"]["model"].update(weight_bytes="8")), "weight bytes is not a int"),
    (lambda d: _rewrite(d, lambda m: m["host"].update(cpu_flags=7)), "host cpu_flags is not a list"),
    (lambda d: _rewrite(d, lambda m: m["host"].update(cpu_flags="avx2")), "host cpu_flags is not a list"),
    (lambda d: _rewrite(d, lambda m: m["engine"]["model"].update(version=2**70)), "version or TP rank is out of range"),
    (lambda d: _rewrite(d, lambda m: m["engine"]["model"]["cache_key"].update(tp_size=-1)), "out of range"),
    (lambda d: (d / "manifest.json").write_text('{"format": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     "(RecursionError"),
])
def test_every_file_and_field_a_restore_uses_is_checked(tmp_path, change, message):
    """CRIU restores as root from each file in images/ (only the directory and the manifest were
    checked: an image anyone could write was fed to it), and the manifest's fields go into paths and
    messages (a device of '../..' went into a socket path; a missing image was a KeyError)."""
    directory = _snapshot_dir(tmp_path / "snap", MINIMAL)
    assert snapshot.read_manifest(directory)["engine"]["device"] == "cpu:0"
    change(directory)
    with pytest.raises(snapshot.SnapshotError) as err:
        snapshot.read_manifest(directory)
    assert message in str(err.value)


def test_a_snapshot_under_a_directory_others_can_write_is_refused(tmp_path):
    """Restored as root from a directory a stranger owns: they could have swapped the snapshot."""
    world = tmp_path / "world"
    world.mkdir()
    directory = _snapshot_dir(world / "snap", MINIMAL)
    os.chown(world, 65534, 65534)
    os.chmod(world, 0o777)
    with pytest.raises(snapshot.SnapshotError, match=rf"{world}, above {directory}, belongs to uid 65534.*move the "
                                                     "snapshot under directories only you"):
        snapshot.read_manifest(directory)


def _rewrite(directory: pathlib.Path, edit) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, message", [
    (lambda f: os.truncate(f, f.stat().st_size // 2), "unpacks to"),
    (lambda f: f.write_bytes(f.read_bytes()[:40] + bytes(64) + f.read_bytes()[104:]), "does not unpack"),
])
def test_damaged_page_images_fail_the_restore_with_a_clear_error(tmp_path, damage, message):
    """A truncated image unpacked short without an error (CRIU then waited out the whole timeout),
    and a corrupt one ended the command in a zstd traceback, leaving its half-unpacked copy."""
    directory = _snapshot_dir(tmp_path / "snap", MINIMAL)
    (directory / "images" / "pages-1.img").write_bytes(os.urandom(1 << 16) * 8)
    snapshot_images.pack(directory / "images", tmp_path / "raw")
    damage(directory / "images" / "pages-1.img.zst")
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    with pytest.raises(snapshot.SnapshotError) as err:
        snapshot_images.unpacked(directory, {"image": {"packed": ["pages-1.img.zst"]}}, runtime)
    assert "pages-1.img.zst" in str(err.value) and message in str(err.value) and "take a new snapshot" in str(err.value)
    assert not list((runtime / "snapshots").iterdir())  # no half-unpacked copy left


def test_an_unpacked_copy_damaged_by_hand_is_unpacked_again(tmp_path):
    """A cached copy with a file truncated or removed made restores wait out their timeout (or fail
    in CRIU, with no hint to clear the cache): its size against the manifest's says it is damaged."""
    directory = _snapshot_dir(tmp_path / "snap", MINIMAL)
    (directory / "images" / "pages-1.img").write_bytes(os.urandom(1 << 16) * 8)
    manifest = {"image": {"unpacked_bytes": snapshot_images.image_bytes(directory / "images"),
                          "packed": snapshot_images.pack(directory / "images", tmp_path / "raw")}}
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    cache = snapshot_images.unpacked(directory, manifest, runtime)
    whole = (cache / "pages-1.img").read_bytes()
    for damage in (lambda: os.truncate(cache / "pages-1.img", 1000), lambda: (cache / "core-1.img").unlink()):
        damage()
        assert snapshot_images.unpacked(directory, manifest, runtime) == cache
        assert (cache / "pages-1.img").read_bytes() == whole and (cache / "core-1.img").read_bytes() == b"core"


def test_the_unpacked_copies_of_deleted_or_replaced_snapshots_are_trimmed(tmp_path):
    """A deleted snapshot's unpacked copy (about the engine's memory) stayed until four newer ones
    pushed it out; so did the copy of a snapshot since taken again at the same path."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    copies = {}
    for name in ("gone", "replaced", "kept", "fresh"):
        directory = _snapshot_dir(tmp_path / name, MINIMAL)
        (directory / "images" / "pages-1.img").write_bytes(os.urandom(1 << 12))
        manifest = {"image": {"unpacked_bytes": snapshot_images.image_bytes(directory / "images"),
                              "packed": snapshot_images.pack(directory / "images", tmp_path / f"raw-{name}")}}
        copies[name] = snapshot_images.unpacked(directory, manifest, runtime)
        old = time.time() - 2 * snapshot_images.TRIM_AFTER_S
        os.utime(copies[name], (old, old))
    shutil.rmtree(tmp_path / "gone")
    (tmp_path / "replaced" / "images" / "core-1.img").write_bytes(b"another core")
    (copies["kept"] / ".source").unlink(missing_ok=True)  # a copy from before copies named their snapshot
    snapshot_images.trim(copies["fresh"].parent, keep=copies["fresh"])
    assert sorted(name for name, copy in copies.items() if copy.is_dir()) == ["fresh", "kept"]


def test_a_restore_keeps_only_the_newest_failed_restores_logs(tmp_path):
    """Each failed restore leaves its work directory (CRIU's logs, named in its error); they piled up."""
    now = time.time()
    for i in range(8):  # an hour and more old, oldest first
        (tmp_path / f"restore-old{i}").mkdir()
        os.utime(tmp_path / f"restore-old{i}", (now - 7200 + i, now - 7200 + i))
    (tmp_path / "restore-running").mkdir()  # a restore under way: its directory is young
    os.utime(tmp_path / "restore-running", (now - 60, now - 60))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "restore-link").symlink_to(elsewhere)
    os.utime(tmp_path / "restore-link", (0, 0), follow_symlinks=False)
    snapshot.prune_failed_restores(tmp_path, keep=5)
    left = sorted(p.name for p in tmp_path.glob("restore-*"))
    assert left == ["restore-link", "restore-old4", "restore-old5", "restore-old6", "restore-old7", "restore-running"]
    snapshot.prune_failed_restores(tmp_path, keep=0)
    assert sorted(p.name for p in tmp_path.glob("restore-*")) == ["restore-link", "restore-running"]
    assert elsewhere.is_dir()


def test_host_mismatches_name_each_field():
    facts = criu.host_facts()
    assert snapshot.host_mismatches({"host": facts}, "") == []
    then = {**facts, "torch": "0.1", "cpu_flags": [*facts["cpu_flags"], "amx_made_up"]}
    problems = snapshot.host_mismatches({"host": then}, "")
    assert any(p.startswith("torch") for p in problems) and any("amx_made_up" in p for p in problems)


def test_engine_url_is_checked():
    with pytest.raises(snapshot.SnapshotError, match="base URL"):
        snapshot.engine_readiness("http://127.0.0.1:1/v1/completions")
    with pytest.raises(snapshot.SnapshotError, match="no engine answers"):
        snapshot.engine_readiness("http://127.0.0.1:1")


SESSION_PROBE = """
import os, sys
from worker.quiesce import own_session
if sys.argv[1] == "group-leader":
    os.setpgid(0, 0)
print(repr((os.getsid(0) == os.getpid(), own_session(), os.getsid(0) == os.getpid())))
"""


@pytest.mark.parametrize("case", ["plain", "group-leader"])
def test_an_engine_whose_session_leader_is_out_of_sight_starts_its_own(case):
    """In a PID namespace whose session leader lives outside it (how some job runners, CI among
    them, start jobs), CRIU cannot dump the engine: it starts a session of its own, or, as a process
    group leader that cannot, says why /ready refuses snapshots."""
    try:
        run = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", SESSION_PROBE, case],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if run.returncode and "unshare" in run.stderr and "Operation not permitted" in run.stderr:
        pytest.skip(f"cannot make a PID namespace here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    leader_before, problem, leader_after = ast.literal_eval(run.stdout)
    assert not leader_before
    if case == "plain":
        assert (problem, leader_after) == ("", True)
    else:
        assert "start the engine under `setsid`" in problem and not leader_after


def test_a_visible_session_leader_is_kept():
    """Where the session leader is in sight (here the probe leads a session of its own, as a shell's
    job has its shell), the engine keeps its session."""
    probe = "import os; from worker.quiesce import own_session; s = os.getsid(0); print(own_session() == '' and os.getsid(0) == s)"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120,
                         start_new_session=True)
    assert run.stdout.strip() == "True", run.stderr


def test_check_command_prints_a_table():
    run = subprocess.run([sys.executable, "-m", "preload_cli", "snapshot", "check", "--json"], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    report = json.loads(run.stdout)
    assert {c["name"] for c in report["checks"]} >= {"criu", "privileges", "namespaces"}
    assert run.returncode == (0 if report["ok"] else 1)


def test_attached_weights_suspend_and_resume_at_the_same_addresses(start_daemon, tiny_llama):
    """What the quiet point does to the weights, without CRIU: the mapping becomes an empty
    reservation, no descriptor names the slab, and resume maps the same weights at the same place;
    a daemon holding other weights under the name, or none under the version, is refused and the
    weights stay suspended."""
    from preload_daemon.buffers import descriptors_of
    from preload_daemon.client import DaemonClient
    from preload_daemon.errors import StaleError
    daemon = start_daemon()
    daemon.client.load(LoadSpec(path=str(tiny_llama), name="tiny"))
    attached = DaemonClient(daemon.config.socket_path).attach("tiny")  # suspend closes its client
    name = next(iter(attached))
    view = attached[name]
    expected, address = view.clone(), view.data_ptr()
    slab = attached.manifest.slabs[0]
    assert descriptors_of(slab.path)
    attached.suspend()
    assert attached.suspended and not descriptors_of(slab.path)
    maps = pathlib.Path("/proc/self/maps").read_text()
    assert slab.path not in maps
    assert daemon.client.list_models()[0].leases == []  # the session closed: the lease ended
    attached.resume(DaemonClient(daemon.config.socket_path))
    assert not attached.suspended and view.data_ptr() == address and torch_equal(view, expected)
    assert len(daemon.client.list_models()[0].leases) == 1
    # The same weights loaded again by a daemon started anew: new slabs (other names, the same bytes),
    # which resume maps in place of the old (a snapshot was refused as "laid out differently" after
    # any reload).
    attached.suspend()
    daemon.stop()
    daemon = start_daemon()
    daemon.client.load(LoadSpec(path=str(tiny_llama), name="tiny"))
    attached.resume(DaemonClient(daemon.config.socket_path))
    assert attached.manifest.slabs[0].id != slab.id and view.data_ptr() == address and torch_equal(view, expected)
    assert torch_equal(attached[list(attached)[-1]], attached[list(attached)[-1]].clone())  # new views too
    attached.suspend()
    daemon.stop()  # a daemon stopped gently frees everything; the next gives out v1 again
    daemon = start_daemon()
    daemon.client.load(LoadSpec(path=str(tiny_llama), name="tiny", dtype="bfloat16"))
    with pytest.raises(StaleError, match="tiny v1 on cpu:0 has no variant float32"):
        attached.resume(DaemonClient(daemon.config.socket_path))
    assert attached.suspended
    daemon.client.evict("tiny", force=True)
    daemon.client.load(LoadSpec(path=str(tiny_llama), name="tiny"))  # v2: v1's number is not given out again
    with pytest.raises(StaleError, match="tiny has no version 1 .* take a new snapshot"):
        attached.resume(DaemonClient(daemon.config.socket_path))
    assert attached.suspended


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)
