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
"""The processes of TP ranks 1..N-1 that this engine started: [(rank, process)]."""


def watch_followers(followers: Followers, stopping: threading.Event, leaders: list[Leader] | None = None,
                    step_timeout: float = 0.0) -> None:
    """If a TP rank dies, or rank 0's step is stuck on the others (a rank stopped or hung holds every
    collective, with no error: requests waited for good while /health said alive), the engine cannot
    go on: say which rank, end the others, exit non-zero. A step is stuck once it has run
    `step_timeout` s and a rank is stopped, or no rank of this host (rank 0 included) has been at work
    for a further `step_timeout` s: a long prefill on a large model keeps its ranks busy for minutes."""
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
        mark = None  # (the step, when, CPU seconds of this host's ranks then), once it ran past the timeout
        while not stopping.wait(0.2):
            for rank, proc in followers:
                if proc.poll() is not None:
                    give_up(f"TP rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")
            since = max((leader.step_since for leader in leaders or ()), default=0.0)
            now = time.monotonic()
            if not step_timeout or not since or now - since <= step_timeout:
                continue
            if stopped := stopped_ranks(followers):
                give_up(f"a step has waited {step_timeout:g} s (--tp-step-timeout) for the other TP ranks: {stopped}")
            busy = cpu_seconds([os.getpid(), *(proc.pid for _, proc in followers)])
            if mark is None or mark[0] != since:
                mark = (since, now, busy)
            elif now - mark[1] >= step_timeout:
                if busy - mark[2] < IDLE_SHARE * (now - mark[1]):
                    give_up(f"a step has run {now - since:.0f} s, the last {now - mark[1]:.0f} s (--tp-step-timeout) "
                            "with no rank of this host at work: a rank hangs (or is stopped on another host)")
                mark = (since, now, busy)

    threading.Thread(target=watch, name="rank-watch", daemon=True).start()


IDLE_SHARE = 0.05  # of one core: this host's ranks together, waiting on a hung rank (gloo's waits sleep)


def stopped_ranks(followers: Followers) -> str:
    """Which of this engine's ranks are stopped (SIGSTOP, a debugger), in words ("" if none)."""
    import psutil
    stopped = []
    for rank, proc in followers:
        try:
            if psutil.Process(proc.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                stopped.append(f"rank {rank} (pid {proc.pid}) is stopped")
        except psutil.Error:
            pass
    return "; ".join(stopped)


def cpu_seconds(pids: list[int]) -> float:
    """The CPU time the processes have used, together."""
    import psutil
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


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
