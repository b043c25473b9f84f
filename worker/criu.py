"""CRIU and the host it runs on, for `preload snapshot` (worker/snapshot.py): finding a CRIU that
works here, what a snapshot records of the host and checks at restore, running `criu` and reading
its log, and the PID namespace a restore runs in. Imports nothing heavy (restore's start-up counts).
"""

import dataclasses
import functools
import importlib.util
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import time

import preload_daemon
from preload_daemon.errors import PreloadError

MIN_CRIU = (4, 1)
CRIU_ENV = "PRELOAD_CRIU"
# CPU features a process may have chosen code paths by (torch, glibc, our kernels): a restore host
# must have every one of them that the snapshot's host had.
_ISA_FLAG = re.compile(r"^(sse|ssse|avx|fma|f16c|bmi|amx|aes|vaes|pclmul|vpclmul|sha|popcnt|movbe|adx|abm|lzcnt|"
                       r"xsave|rdrand|rdseed|gfni|erms|fsrm|cx16|sha_ni)")


class SnapshotError(PreloadError):
    """A snapshot cannot be taken or restored; the message says why and what to do."""


def find_criu() -> tuple[str, str]:
    """(path, version) of the CRIU to use: $PRELOAD_CRIU, else the one scripts/setup.sh built
    beside this interpreter, else criu on PATH; it must be at least 4.1."""
    chosen = os.environ.get(CRIU_ENV, "")
    if chosen:  # the user's choice is used or refused, never passed over for another CRIU
        version = criu_version(chosen) if os.access(chosen, os.X_OK) else ""
        if version and tuple(int(x) for x in version.split(".")[:2]) >= MIN_CRIU:
            return chosen, version
        raise SnapshotError(f"{CRIU_ENV}={chosen} is not a CRIU >= {'.'.join(map(str, MIN_CRIU))} that runs here "
                            f"({'version ' + version if version else 'it does not run or has no version'}); point "
                            f"it at one, or unset it to use the one scripts/setup.sh built")
    candidates = [str(pathlib.Path(sys.executable).parent / "criu"), shutil.which("criu") or ""]
    seen = []
    for path in filter(None, candidates):
        if not os.access(path, os.X_OK):
            continue
        version = criu_version(path)
        seen.append(f"{path} ({version or 'no version'})")
        if version and tuple(int(x) for x in version.split(".")[:2]) >= MIN_CRIU:
            return path, version
    found = f"found only {', '.join(seen)}" if seen else "none found"
    raise SnapshotError(f"snapshots need CRIU >= {'.'.join(map(str, MIN_CRIU))} ({found}); run scripts/setup.sh "
                        f"as root (it builds one), or set {CRIU_ENV}=/path/to/criu")


@functools.lru_cache(maxsize=8)
def criu_version(path: str) -> str:
    """CRIU's version ("" if it does not run); asked once per path (find_criu, then host_facts)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    match = re.search(r"Version:\s*([0-9]+\.[0-9]+(?:\.[0-9]+)?)", out)
    return match.group(1) if match else ""


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(f for f in line.split(":", 1)[1].split() if _ISA_FLAG.match(f))
    except OSError:
        pass
    return []


def host_facts(criu: str = "") -> dict:
    """What a manifest records of the host and checks at restore (the engine adds its own)."""
    return {"kernel": platform.release(), "machine": platform.machine(), "cpu_flags": cpu_flags(),
            "criu": criu_version(criu) if criu else "", "preload": preload_daemon.__version__,
            "python": platform.python_version(), "torch": torch_version()}


def torch_version() -> str:
    """The installed torch's version, read from its version.py: importing torch (seconds) or
    importlib.metadata (tens of milliseconds) would slow every restore down."""
    spec = importlib.util.find_spec("torch")
    try:
        with open(pathlib.Path(spec.origin).parent / "version.py") as f:
            match = re.search(r"^__version__\s*=\s*['\"]([^'\"+]+)", f.read(), re.M)
    except (AttributeError, TypeError, OSError):
        return ""
    return match.group(1) if match else ""


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_host() -> list[Check]:
    """Whether this host can take and restore snapshots, check by check (`preload snapshot check`)."""
    checks = [Check("linux", sys.platform.startswith("linux"), platform.platform())]
    try:
        criu, version = find_criu()
        checks.append(Check("criu", True, f"{criu} {version}"))
    except SnapshotError as e:
        checks.append(Check("criu", False, str(e)))
        criu = ""
    root = os.geteuid() == 0
    checks.append(Check("privileges", root, "root" if root else "CRIU needs root (or CAP_CHECKPOINT_RESTORE and "
                        "CAP_SYS_ADMIN); run the snapshot commands as root"))
    if criu and root:
        run = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=60)
        lines = (run.stdout + run.stderr).strip().splitlines()
        detail = next((line for line in lines if "Looks good" in line), lines[-1] if lines else "")
        checks.append(Check("criu check", run.returncode == 0, detail or f"exit {run.returncode}"))
    unshare = shutil.which("unshare")
    if unshare and root:
        run = subprocess.run([unshare, "--pid", "--fork", "--mount", "--propagation", "private", "--mount-proc",
                              "true"], capture_output=True, text=True, timeout=30)
        checks.append(Check("namespaces", run.returncode == 0, "restores run in PID and mount namespaces of their own"
                            if run.returncode == 0 else f"unshare failed: {run.stderr.strip()[-300:]}"))
    else:
        checks.append(Check("namespaces", False, "needs unshare (util-linux) and root" if root else "needs root"))
    cuda = shutil.which("cuda-checkpoint")
    checks.append(Check("cuda-checkpoint", True, cuda or "not found: CPU engines only (GPU engines need NVIDIA's "
                        "cuda-checkpoint on PATH)"))
    return checks


def run_criu(argv: list[str], log_path: pathlib.Path, what: str) -> None:
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if run.returncode:
        tail = log_errors(log_path) or (run.stderr.strip()[-800:])
        raise SnapshotError(f"criu {what} failed (exit {run.returncode}): {tail} (full log: {log_path})")


def log_errors(log_path: pathlib.Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if "Error" in line and "RLIMIT_NOFILE" not in line]
    return " | ".join(errors[-4:])[-800:]


# --- the namespace a restore runs in -------------------------------------------------------------

def restored_pid(process: subprocess.Popen, workdir: pathlib.Path, ns_pid: int, timeout: float) -> int:
    """The restored engine's pid on this host: the child of the namespace's CRIU whose pid inside
    the namespace is the snapshot's (CRIU restores pids), once CRIU has written its pidfile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SnapshotError(f"criu restore failed (exit {process.returncode}): "
                                f"{log_errors(workdir / 'restore.log') or (workdir / 'criu.out').read_text()[-800:]}")
        if (workdir / "pid").exists():
            for child in _children(process.pid):
                for grandchild in _children(child):
                    if _ns_pid(grandchild) == ns_pid:
                        return grandchild
        time.sleep(0.002)
    raise SnapshotError(f"criu restore did not finish within {timeout:g}s (logs: {workdir})")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _ns_pid(pid: int) -> int:
    """The innermost pid of a process (its pid in its own PID namespace)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return -1


def kill_namespace(process: subprocess.Popen) -> None:
    """Kills the namespace's first process, which takes every process in the namespace with it."""
    for pid in _children(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        process.kill()
    except ProcessLookupError:
        pass
    process.wait()
