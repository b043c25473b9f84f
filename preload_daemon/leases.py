"""Leases: each Attach pins a model version for one process, identified by pid and start time
(a recycled pid is a different process) as the kernel reported them when the process opened its
session (sessions.py). A lease ends when its session's connection closes; leases of processes that
are gone are also reaped by pid, as a second line."""

import dataclasses
import secrets
import time

import psutil


@dataclasses.dataclass(slots=True)
class Lease:
    id: str
    pid: int
    pid_start_time: float
    model: str
    version: int
    created_at: float
    renewed_at: float
    session: str = ""

    @classmethod
    def new(cls, pid: int, pid_start_time: float, model: str, version: int, session: str = "") -> "Lease":
        now = time.time()
        return cls(secrets.token_hex(8), pid, pid_start_time, model, version, now, now, session)


def holder_alive(pid: int, pid_start_time: float) -> bool:
    """Whether the process that started at `pid_start_time` still runs as `pid`."""
    return pid_start_time >= 0 and process_start_time(pid) == pid_start_time


def process_start_time(pid: int) -> float:
    """The process's start time, or -1.0 if it is gone (zombies count as gone: they hold no mappings)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return -1.0
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return -1.0
