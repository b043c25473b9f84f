"""`preload snapshot`: CRIU snapshots of TP 1 engines whose weights stay in the daemon.

create:  ask the engine for a quiet point (worker/quiesce.py), dump it with CRIU, write
         manifest.json (atomically, last), and let the original serve on (unless --stop).
restore: check the manifest against this host and the daemon, restore the image in a PID and mount
         namespace of its own (so that one snapshot restores many times side by side, and while
         the original lives), wake the copy, which re-attaches its weights, re-runs the canary and
         listens on the port given now. Any failure kills the copy and says why.

This module is what the restore command runs before the engine is back, so it imports neither
torch nor grpc: the restore's own start-up is part of the time to ready. CRIU and the host are
worker/criu.py's; the images on disk, snapshot_images.py's; the manifest, snapshot_manifest.py's."""

import dataclasses
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import stat
import subprocess
import time

from preload_daemon.config import default_runtime_dir
from worker import control
from worker.criu import SnapshotError, find_criu, host_facts, kill_namespace, restored_pid, run_criu
from worker.procs import die_with_parent, kill_and_wait, process_alive, process_uid
from worker.snapshot_images import IMAGES, image_bytes, pack, seed_unpacked, unpacked
from worker.snapshot_manifest import (FORMAT, MANIFEST, check_ours, daemon_problem, hold_version, host_mismatches,
                                      read_manifest, refusal, write_atomically)

MAX_READY_BYTES = 1 << 20


# --- create -------------------------------------------------------------------------------------

def engine_readiness(url: str, timeout: float = 5.0) -> dict:
    """The engine's /ready document (also when it answers 503)."""
    import urllib.error
    import urllib.request
    url = url.rstrip("/")
    if not re.match(r"^https?://[^/\s]+$", url):
        raise SnapshotError(f"--engine {url!r}: give the engine's base URL, e.g. http://127.0.0.1:8000")
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=timeout) as response:
            body = response.read(MAX_READY_BYTES)
    except urllib.error.HTTPError as e:
        body = e.read(MAX_READY_BYTES)
    except (OSError, ValueError) as e:
        raise SnapshotError(f"no engine answers at {url}: {e}; is it running? (`preload engine ... --port P`)") \
            from None
    try:
        ready = json.loads(body)
        if not isinstance(ready, dict):
            raise ValueError("not an object")
    except ValueError:
        raise SnapshotError(f"{url}/ready did not answer with a preload engine's JSON") from None
    return ready


def _wake(pid: int, fd: int, message: dict) -> None:
    """Writes one line into the engine's wake pipe through /proc (its own user or root only)."""
    path = f"/proc/{pid}/fd/{int(fd)}"
    try:
        wfd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SnapshotError(f"cannot reach engine pid {pid}'s snapshot pipe ({path}: {e.strerror}); the snapshot "
                            "commands must run as the engine's user or root, on its host") from None
    try:
        if not stat.S_ISFIFO(os.fstat(wfd).st_mode):
            raise SnapshotError(f"{path} is not the engine's snapshot pipe")
        os.write(wfd, json.dumps(message).encode() + b"\n")
    finally:
        os.close(wfd)


def _ensure_new_dir(directory: pathlib.Path) -> None:
    """A new or empty directory of ours, claimed by making its images directory in it (another
    create into the same new directory fails here, before it quiets its engine or wipes ours)."""
    try:
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise SnapshotError(f"{directory} exists and is not empty; choose a new directory (snapshots are never "
                                "overwritten)")
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_ours(directory)
        (directory / IMAGES).mkdir(mode=0o700)
    except FileExistsError:
        raise SnapshotError(f"{directory} is taken (another snapshot is being written there, or a link of that "
                            "name points nowhere); choose a new directory") from None
    except OSError as e:  # /proc/x, a name too long, a read-only place
        raise SnapshotError(f"cannot make {directory}: {e.strerror or e}; choose a directory you can write") from None


def create(url: str, directory: pathlib.Path, *, stop: bool = False, drain_timeout: float = 30.0,
           runtime_dir: pathlib.Path | None = None, log=print) -> dict:
    """Snapshots the engine at `url` into `directory`; returns the manifest. A failed create leaves
    the directory empty (or absent), and the engine serving as before where it can."""
    ready = engine_readiness(url)
    if why := refusal(ready, url):
        raise SnapshotError(why)
    criu, _ = find_criu()
    directory = pathlib.Path(directory).absolute()
    _check_engine_process(ready["pid"], url)
    created = not os.path.lexists(directory)
    _ensure_new_dir(directory)
    runtime = pathlib.Path(runtime_dir) if runtime_dir else default_runtime_dir()
    try:
        return _create(url, ready, directory, criu, stop, drain_timeout, runtime, log)
    except BaseException as e:
        if not (directory / MANIFEST).exists():
            for child in directory.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            if created:
                directory.rmdir()
        if isinstance(e, control.ControlError):  # an OSError, which the command line would print as a traceback
            raise SnapshotError(f"engine pid {ready['pid']}: {e}") from None
        if isinstance(e, OSError):  # packing into a full disk: the engine was resumed (or it says why not)
            raise SnapshotError(f"cannot write the snapshot in {directory}: {e.strerror or e}") from None
        raise


def _check_engine_process(pid: int, url: str) -> None:
    """The pid an engine's /ready names must be a preload engine: whatever answers at a URL must
    not get us to write into some other process's pipe."""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            argv = f.read(1 << 16).split(b"\0")
    except (OSError, ValueError):
        raise SnapshotError(f"the engine at {url} names pid {pid}, which is not a process on this host; run the "
                            "snapshot commands on the engine's host") from None
    if not any(b"preload" in a for a in argv) or b"engine" not in argv:
        raise SnapshotError(f"the engine at {url} names pid {pid}, which is not a `preload engine` process")
    try:
        uid = process_uid(pid)
    except OSError:
        raise SnapshotError(f"engine pid {pid} ended before its snapshot began") from None
    if uid != os.getuid():  # its control socket and images belong to its user, in its runtime directory
        raise SnapshotError(f"engine pid {pid} runs as uid {uid}, and this command as uid {os.getuid()}; run the "
                            f"snapshot commands as the engine's user (e.g. `sudo -u '#{uid}' preload snapshot ...`)")


def _create(url: str, ready: dict, directory: pathlib.Path, criu: str, stop: bool, drain_timeout: float,
            runtime: pathlib.Path, log) -> dict:
    t0 = time.time()
    pid, wake_fd = ready["pid"], ready["snapshot"]["wake_fd"]
    server, path = control.listen(runtime)
    try:
        _wake(pid, wake_fd, {"op": "snapshot", "control": str(path)})
        conn = control.accept(server, 10.0, expect_pid=pid)
    except control.NoConnection as e:
        raise control.ControlError(f"{e}. An engine connects only to a control socket in its own runtime directory; "
                                   f"this command used {runtime} (pass the engine's --runtime-dir or "
                                   "PRELOAD_RUNTIME_DIR); its log says why") from None
    finally:
        server.close()
        path.unlink(missing_ok=True)
    streams: list[int] = []
    with conn:
        hello, _ = control.receive(conn, 10.0)
        identity = hello.get("hello") or {}
        why = "" if identity else str(hello.get("error", "the engine did not introduce itself"))
        why = why or refusal({**ready, **identity, "status": "ready" if identity.get("ready") else "loading"}, url)
        if why:
            if identity:  # else the engine said why, and closed
                control.send(conn, {"op": "cancel"})
            raise SnapshotError(why)
        log(f"snapshot: draining {url} (up to {drain_timeout:g}s) and quieting pid {pid}")
        held = hold_version(identity, runtime)  # until the original has its lease back (below)
        control.send(conn, {"op": "quiesce", "drain_timeout": drain_timeout})
        answer, streams = control.receive(conn, drain_timeout + 120)
        if "quiet" in answer:  # then its agent closes the connection and waits on its pipe: dump then
            try:
                control.wait_closed(conn, 10.0)
            except BaseException:
                control._close(streams)
                raise
    try:
        if "quiet" not in answer:
            control._close(streams)
            raise SnapshotError(f"the engine could not reach a quiet point: {answer.get('error', answer)}; it "
                                "serves on")
        try:
            return _dump(url, directory, criu, stop, runtime, pid, identity, answer["quiet"], streams, t0)
        finally:
            control._close(streams)
    finally:
        if held is not None:
            held.close()


def _dump(url: str, directory: pathlib.Path, criu: str, stop: bool, runtime: pathlib.Path, pid: int,
          identity: dict, quiet: dict, streams: list[int], t0: float) -> dict:
    """CRIU's dump of the quiet engine, the original's resume, the image packed, the manifest written
    last. With --stop the original, parked, is ended once the snapshot is whole (a dump that killed
    it lost both when the packing failed); a failure before then resumes it."""
    images = directory / IMAGES  # made by _ensure_new_dir
    timings, toggled = {"start": t0}, False
    try:
        timings["dump_start"] = time.time()
        toggled = _cuda_checkpoint(identity, pid)
        run_criu([criu, "dump", "-t", str(pid), "-D", str(images), "--shell-job", "-o", "dump.log", "-v2",
                  "--leave-running"], images / "dump.log", "dump")
        timings["dumped"] = time.time()
        if not stop and toggled:
            toggled = not _cuda_checkpoint(identity, pid)
        if stop:
            manifest = _finish(directory, criu, identity, quiet, timings, runtime, "stopped")
            kill_and_wait(pid)  # as CRIU's dump without --leave-running would have (SIGKILL)
            return manifest
    except BaseException as e:
        if process_alive(pid):  # it is parked: it serves on as it was
            try:
                if toggled:  # its device state back on the GPU first
                    _cuda_checkpoint(identity, pid)
                _resume_original(runtime, identity, quiet, streams)
            except SnapshotError as resume_error:
                raise SnapshotError(f"{e}; and then {resume_error}") from None
        raise
    try:  # first the original (its downtime), then the packing
        resumed = _resume_original(runtime, identity, quiet, streams)
    except SnapshotError as e:
        _finish(directory, criu, identity, quiet, timings, runtime, f"did not resume: {e}")
        raise SnapshotError(f"the snapshot in {directory} is complete, but {e}") from None
    timings["original_ready"] = resumed["timings"]["ready"]
    return _finish(directory, criu, identity, quiet, timings, runtime, "serving")


def _finish(directory: pathlib.Path, criu: str, identity: dict, quiet: dict, timings: dict, runtime: pathlib.Path,
            original: str) -> dict:
    """The dumped image packed and the manifest written, last (what makes the directory a snapshot)."""
    images = directory / IMAGES
    unpacked_bytes = image_bytes(images)
    raw = directory / ".unpacked"
    packed = pack(images, raw)
    seed_unpacked(directory, images, raw, runtime)
    manifest = {
        "format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host_facts(criu), "engine": identity, "canary": quiet["canary"],
        "image": {"bytes": image_bytes(images), "unpacked_bytes": unpacked_bytes, "packed": packed,
                  "weight_bytes": identity["model"]["weight_bytes"]},
        "timings": {**quiet["timings"], **timings}, "original": original,
    }
    write_atomically(directory / MANIFEST, json.dumps(manifest, indent=2).encode())
    return manifest


def _resume_original(runtime: pathlib.Path, identity: dict, quiet: dict, streams: list[int]) -> dict:
    server, path = control.listen(runtime)
    try:
        _wake(identity["host_pid"], identity["wake_fd"], {"op": "resume", "control": str(path)})
        conn = control.accept(server, 30.0, expect_pid=identity["host_pid"])
    finally:
        server.close()
        path.unlink(missing_ok=True)
    with conn:
        control.send(conn, {"op": "resume", "canary": quiet["canary"], "listen": identity["listen"]}, streams)
        answer, _ = control.receive(conn, 120.0)
    if "ready" not in answer:
        raise SnapshotError(f"the original engine did not come back after the dump: {answer.get('error', answer)}")
    return answer


def _cuda_checkpoint(identity: dict, pid: int) -> bool:
    """GPU engines: NVIDIA's cuda-checkpoint moves the engine's own device state (context, KV cache)
    to host memory before the dump, and back after it (and after a restore). Weights are IPC memory
    it cannot checkpoint: the quiet point has already let go of them. False for a CPU engine."""
    if not str(identity.get("device", "")).startswith("cuda"):
        return False
    tool = shutil.which("cuda-checkpoint")
    if tool is None:
        raise SnapshotError("the engine runs on a GPU, and NVIDIA's cuda-checkpoint is not on PATH")
    run = subprocess.run([tool, "--toggle", "--pid", str(pid)], capture_output=True, text=True, timeout=300)
    if run.returncode:
        raise SnapshotError(f"cuda-checkpoint --toggle --pid {pid} failed: {run.stderr.strip()[-500:]}")
    return True


# --- inspect and restore ------------------------------------------------------------------------

@dataclasses.dataclass
class Restored:
    """A restored engine: its ready document, and the namespace's first process (unshare)."""
    ready: dict
    process: subprocess.Popen
    pid: int
    """The engine, as this host numbers it."""
    workdir: pathlib.Path

    def stop(self, timeout: float = 10.0) -> int:
        """Ends the engine (SIGTERM, then the whole namespace) and returns its exit status."""
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_namespace(self.process)
            return self.process.wait()


FAILED_RESTORES_KEPT = 5
"""The work directories (CRIU's logs) of the newest failed restores that a restore leaves; those of
older ones, past an hour old, it removes."""


def prune_failed_restores(root: pathlib.Path, keep: int = FAILED_RESTORES_KEPT, min_age_s: float = 3600.0) -> None:
    """Removes the work directories of all but the `keep` newest failed restores in `root`, sparing
    any younger than `min_age_s` (a restore running now has one)."""
    found = []
    for child in root.glob("restore-*"):
        try:
            info = child.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(info.st_mode):  # never a link: rmtree would not follow it, but nor should this
            found.append((info.st_mtime, child))
    found.sort(reverse=True)
    for mtime, child in found[keep:]:
        if time.time() - mtime > min_age_s:
            shutil.rmtree(child, ignore_errors=True)


def restore(directory: pathlib.Path, *, port: int | None = None, host: str | None = None,
            runtime_dir: pathlib.Path | None = None, timeout: float = 120.0, streams: list[int] = (0, 1, 2),
            tied: bool = False) -> Restored:
    """Restores the snapshot in `directory` and returns once the copy is ready (module docstring).
    `streams`: the restored engine's stdin, stdout and stderr (default: this process's); `tied`:
    the restored engine ends with the calling thread, so with this process however it ends, when
    called from the main thread (a foreground restore)."""
    started = time.time()
    directory = pathlib.Path(directory).absolute()
    manifest = read_manifest(directory)
    criu, _ = find_criu()
    if problems := host_mismatches(manifest, criu):
        raise SnapshotError(f"this host does not match the snapshot's: {'; '.join(problems)}; restore it on a host "
                            "like the one it was taken on, or take a new snapshot here")
    runtime = pathlib.Path(runtime_dir) if runtime_dir else default_runtime_dir()
    engine = manifest["engine"]
    if os.path.realpath(str(engine.get("runtime_dir", runtime))) != os.path.realpath(runtime):  # its control sockets'
        raise SnapshotError(f"the snapshot's engine used the runtime directory {engine['runtime_dir']}, not {runtime}; "
                            f"restore it with PRELOAD_RUNTIME_DIR={engine['runtime_dir']} (or --runtime-dir)")
    listen = {"host": host or engine["listen"].get("host", "127.0.0.1"),
              "port": engine["listen"].get("port") if port is None else port}
    images = unpacked(directory, manifest, runtime)
    prune_failed_restores(control.control_dir(runtime))
    workdir = control.control_dir(runtime) / f"restore-{secrets.token_hex(6)}"
    workdir.mkdir(mode=0o700)
    server, path = control.listen(runtime)
    process = None
    try:
        with open(workdir / "criu.out", "wb") as out:
            process = subprocess.Popen(
                [shutil.which("unshare") or "unshare", "--pid", "--fork", "--mount", "--propagation", "private",
                 "--mount-proc", "--kill-child", criu, "restore", "-D", str(images), "-W", str(workdir),
                 "--shell-job", "-o", "restore.log", "-v1", "--pidfile", str(workdir / "pid")],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                preexec_fn=die_with_parent if tied else None)
        # While CRIU restores: does the daemon still hold the weights? If not, the copy never wakes.
        if problem := daemon_problem(manifest, runtime):
            raise SnapshotError(problem)
        pid = restored_pid(process, workdir, engine["pid"], timeout)
        _cuda_checkpoint(engine, pid)  # a GPU engine's device state back on the GPU before it wakes
        _wake(pid, engine["wake_fd"], {"op": "resume", "control": str(path)})
        conn = control.accept(server, timeout, expect_pid=pid)
        with conn:
            control.send(conn, {"op": "resume", "canary": manifest["canary"], "listen": listen, "host_pid": pid,
                                "restore_start": started, "snapshot": str(directory)}, list(streams))
            answer, _ = control.receive(conn, timeout)
        if "ready" not in answer:
            raise SnapshotError(f"the restored engine failed: {answer.get('error', answer)} (logs: {workdir})")
    except BaseException as e:
        if process is not None:
            kill_namespace(process)
        if isinstance(e, control.ControlError):
            raise SnapshotError(f"the restored engine did not answer: {e} (logs: {workdir})") from None
        raise
    finally:
        server.close()
        path.unlink(missing_ok=True)
    shutil.rmtree(workdir, ignore_errors=True)  # CRIU's log of a restore that worked
    return Restored(answer["ready"], process, pid, workdir)
