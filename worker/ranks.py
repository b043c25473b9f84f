"""Rank 0 of a tensor-parallel engine watching the processes of its other ranks (which it started,
or which torchrun did): a rank that exits, or a step that waits too long for the others, ends the
engine, naming the rank, rather than leaving it serving nothing."""

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

from worker.parallel import Leader

log = logging.getLogger(__name__)

Followers = Sequence[tuple[int, subprocess.Popen]]


def watch_followers(followers: Followers, stopping: threading.Event, leaders: list[Leader] | None = None,
                    step_timeout: float = 0.0) -> None:
    """If a TP rank dies, or rank 0's step waits past `step_timeout` s for the others (a rank stopped
    or hung holds every collective, with no error: requests waited for good while /health said
    alive), the engine cannot go on: say which rank, end the others, exit non-zero."""
    if not followers and not step_timeout:
        return

    def give_up(reason: str) -> None:
        if stopping.is_set():
            return
        log.error("%s; stopping the engine", reason)
        print(json.dumps({"event": "failed", "error": f"{reason}; stopping the engine"}), flush=True)
        stop_followers(followers)
        os._exit(1)

    def watch() -> None:
        while not stopping.wait(0.2):
            for rank, proc in followers:
                if proc.poll() is not None:
                    give_up(f"TP rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")
            for leader in leaders or ():
                since = leader.step_since
                if step_timeout and since and time.monotonic() - since > step_timeout:
                    give_up(f"a step has waited {step_timeout:g} s (--tp-step-timeout) for the other TP ranks: "
                            f"{stuck_ranks(followers)}")

    threading.Thread(target=watch, name="rank-watch", daemon=True).start()


def stuck_ranks(followers: Followers) -> str:
    """Which of this engine's ranks are stopped (SIGSTOP, a debugger), in words."""
    import psutil
    stopped = []
    for rank, proc in followers:
        try:
            if psutil.Process(proc.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                stopped.append(f"rank {rank} (pid {proc.pid}) is stopped")
        except psutil.Error:
            pass
    return "; ".join(stopped) or "one of them hangs (or is stopped on another host)"


def stop_followers(followers: Followers, timeout: float = 5.0) -> None:
    for _, proc in followers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)  # a stopped rank handles it once continued
    deadline = time.monotonic() + timeout
    for _, proc in followers:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
