"""Child processes of an engine (TP ranks, DP replicas) that never outlive it."""

import ctypes
import signal
import socket
import subprocess

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
