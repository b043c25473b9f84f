"""Child processes of an engine (TP ranks, DP replicas) that never outlive it, and other processes' facts."""

import ctypes
import os
import signal
import socket
import subprocess
import time

PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: not in a forked child of a threaded parent


def die_with_parent() -> None:
    """preexec_fn of child processes: the kernel kills the child when the thread that started it
    ends (with its process), so no rank or replica outlives its engine, even after kill -9."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the caller binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_child(argv: list[str], **popen) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, **popen)


def process_uid(pid: int) -> int:
    with open(f"/proc/{int(pid)}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                return int(line.split()[1])
    raise ProcessLookupError(f"cannot read pid {pid}'s user")


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def kill_and_wait(pid: int) -> None:
    """SIGKILL to `pid`, and gone (or 10 s passed) before this returns."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10.0
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
