"""Soak and fault runs of the daemon on real processes and sockets, with what they leak.

- `concurrency`: P client processes, each attaching and releasing I times at once; attach
  latency p50 / p99 against one client alone, and no error. The P clients run twice, and the
  second run is the one reported and checked for leaks: the first fills the daemon's thread pools,
  which are bounded and keep their idle threads (up to 16 gRPC workers and 4 session workers).
- `engines`: C cycles of starting an engine warm (ipc_cache) and killing it with SIGKILL.
- `daemon`: with one engine serving, C cycles of killing the daemon with SIGKILL and starting a
  new one, which adopts the slabs; the engine keeps answering, then re-attaches on its own. Adoption
  time against a reload of the same model.

After each run: the daemon's memory (RSS), open files, threads and /dev/shm entries, before and
after, and the leases left (must be none once the clients are gone). The concurrency run's check
counts from after its first round; `all` checks the daemon that served the clients and engines
before the daemon run kills it, and that run's new daemon from its own start. Exit code 0 only if
every check held. One JSON document on stdout; progress on stderr.

    .venv/bin/python scripts/soak.py all --short          # what CI runs (seconds)
    .venv/bin/python scripts/soak.py all                  # full length: 16 x 50, 200 engines, 20 daemons
    .venv/bin/python scripts/soak.py daemon --cycles 5 --model "$(.venv/bin/preload default-model)"
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout: `python scripts/soak.py`

from preload_daemon.client import DaemonClient  # noqa: E402
from preload_daemon.plan import LoadSpec  # noqa: E402
from preload_daemon.supervisor import DaemonProcess  # noqa: E402

FULL = {"procs": 16, "iters": 50, "engine_cycles": 200, "daemon_cycles": 20}
SHORT = {"procs": 12, "iters": 3, "engine_cycles": 1, "daemon_cycles": 1}  # 12 fill the pools past stable()'s slack
CLIENT = """
import json, sys, time
from preload_daemon.client import DaemonClient
client = DaemonClient(sys.argv[1])
client.attach(sys.argv[2]).release()  # warm: the session and the channel
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
times = []
for _ in range(int(sys.argv[3])):
    start = time.perf_counter()
    model = client.attach(sys.argv[2])
    times.append(time.perf_counter() - start)
    model.release()
print(json.dumps(times))
"""


def log(message: str) -> None:
    print(f"soak: {message}", file=sys.stderr, flush=True)


class Daemon(DaemonProcess):
    """A daemon process on cpu:0 of `runtime_dir` (what `preload serve` starts), and a client."""

    def __init__(self, runtime_dir: pathlib.Path):
        super().__init__("cpu:0", runtime_dir)
        self.wait_started()
        self.client = DaemonClient(self.config.socket_path, timeout=60)

    def footprint(self) -> dict:
        proc = psutil.Process(self.proc.pid)
        stats = self.client.stats()
        return {"rss_mib": round(proc.memory_info().rss / 2**20, 1), "open_files": proc.num_fds(),
                "threads": proc.num_threads(), "shm_entries": len(list(self.config.shm_dir.iterdir())),
                "leases": stats.num_leases, "sessions": stats.num_sessions}

    def settled_footprint(self) -> dict:
        """footprint() once every client's session has closed."""
        wait_for(lambda: self.client.stats().num_sessions == 0, 10, "every client's session to close")
        return self.footprint()

    def kill(self) -> None:
        self.client.close()
        self.proc.kill()
        self.proc.wait()
        self.log_file.close()

    def stop(self) -> None:
        self.client.close()
        super().stop()


def percentiles(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered) * 1e3, 2),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 2)}


def run_clients(daemon: Daemon, name: str, procs: int, iters: int) -> list[float]:
    clients = [subprocess.Popen([sys.executable, "-c", CLIENT, str(daemon.config.socket_path), name, str(iters)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
               for _ in range(procs)]
    for c in clients:
        if c.stdout.readline().strip() != "ready":
            raise RuntimeError("a client failed to attach before the run")
    for c in clients:  # all start together
        c.stdin.write("go\n")
        c.stdin.flush()
    times = []
    for c in clients:
        out, _ = c.communicate(timeout=600)
        if c.returncode != 0:
            raise RuntimeError(f"a client exited with code {c.returncode}")
        times += json.loads(out)
    return times


def concurrency(daemon: Daemon, name: str, procs: int, iters: int) -> tuple[dict, dict]:
    """Attach latency alone and with `procs` clients at once, and the daemon's footprint to check
    leaks from. The clients run twice: the first time fills the daemon's thread pools, which are
    bounded (gRPC's workers, the sessions' request threads) and keep their idle threads; a leak
    grows again the second time, whose figures are reported."""
    log(f"concurrency: 1 client x {iters}, then {procs} clients x {iters}, twice")
    alone = percentiles(run_clients(daemon, name, 1, iters))
    run_clients(daemon, name, procs, iters)
    filled = daemon.settled_footprint()
    together = percentiles(run_clients(daemon, name, procs, iters))
    return {"alone": alone, f"{procs}_processes": together, "errors": 0}, filled


def start_engine(model: pathlib.Path, name: str, runtime_dir: pathlib.Path) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "preload_cli", "engine", str(model), "--name", name,
                             "--load-format", "ipc_cache", "--no-fallback", "--port", "0", "--runtime-dir",
                             str(runtime_dir), "--max-batch", "1", "--max-model-len", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    ready = json.loads(proc.stdout.readline() or "{}")
    if ready.get("status") != "ready":
        proc.kill()
        raise RuntimeError(f"the engine did not start: {ready}")
    return proc, ready


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def engines(daemon: Daemon, model: pathlib.Path, name: str, cycles: int) -> dict:
    log(f"engines: {cycles} cycles of a warm start and SIGKILL")
    starts = []
    for i in range(cycles):
        start = time.monotonic()
        proc, _ = start_engine(model, name, daemon.config.runtime_dir)
        starts.append(time.monotonic() - start)
        proc.kill()
        proc.wait()
        if (i + 1) % 20 == 0:
            log(f"  {i + 1}/{cycles}: {daemon.footprint()}")
    wait_for(lambda: daemon.client.stats().num_leases == 0, 10, "the killed engines' leases to end")
    return {"cycles": cycles, "start_to_ready_median_s": round(statistics.median(starts), 3)}


def health(port: int) -> dict:
    return json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5))


def daemon_restarts(daemon: Daemon, model: pathlib.Path, name: str, cycles: int) -> tuple[Daemon, dict]:
    log(f"daemon: {cycles} cycles of SIGKILL and a new daemon, with an engine serving")
    engine, ready = start_engine(model, name, daemon.config.runtime_dir)
    port, digest = ready["port"], ready["content_digest"]
    adopt_s, reattach_s, daemon_start_s = [], [], []
    try:
        for _ in range(cycles):
            killed = time.monotonic()
            daemon.kill()
            wait_for(lambda: health(port)["status"] == "degraded", 10, "the engine to notice")
            started = time.monotonic()
            daemon = Daemon(daemon.config.runtime_dir)
            daemon_start_s.append(time.monotonic() - started)
            stats = daemon.client.stats()
            if [m.key.content_digest for m in stats.models] != [digest]:
                raise RuntimeError(f"the new daemon holds {[m.key.content_digest for m in stats.models]}, not {digest}")
            adopt_s.append(stats.adoption_seconds)
            wait_for(lambda: health(port)["status"] == "alive", 30, "the engine to re-attach")
            reattach_s.append(time.monotonic() - killed)
        leases = daemon.client.stats().num_leases
        if leases != 1:
            raise RuntimeError(f"the daemon holds {leases} leases for one engine")
    finally:
        engine.kill()
        engine.wait()
    return daemon, {"cycles": cycles, "adoption_median_s": round(statistics.median(adopt_s), 4),
                    "daemon_start_to_serving_median_s": round(statistics.median(daemon_start_s), 3),
                    "kill_to_engine_reattached_median_s": round(statistics.median(reattach_s), 3)}


def reload_seconds(model: pathlib.Path, name: str) -> float:
    """A load of the same checkpoint by a fresh daemon (page cache warm): what adoption saves."""
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="soak-reload-", dir="/tmp"))
    daemon = Daemon(runtime)
    try:
        start = time.monotonic()
        daemon.client.load(LoadSpec(path=str(model), name=name))
        return time.monotonic() - start
    finally:
        daemon.stop()
        shutil.rmtree(runtime, ignore_errors=True)


def stable(before: dict, after: dict) -> list[str]:
    """What grew in a way that means a leak."""
    problems = []
    if after["leases"] or after["sessions"]:
        problems.append(f"{after['leases']} lease(s) and {after['sessions']} session(s) left")
    if after["shm_entries"] != before["shm_entries"]:
        problems.append(f"/dev/shm entries {before['shm_entries']} -> {after['shm_entries']}")
    if after["open_files"] > before["open_files"] + 8:
        problems.append(f"open files {before['open_files']} -> {after['open_files']}")
    if after["threads"] > before["threads"] + 8:
        problems.append(f"threads {before['threads']} -> {after['threads']}")
    if after["rss_mib"] > before["rss_mib"] * 1.5 + 50:
        problems.append(f"RSS {before['rss_mib']} -> {after['rss_mib']} MiB")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", choices=["concurrency", "engines", "daemon", "all"])
    parser.add_argument("--model", default="", help="checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--short", action="store_true", help="the short version CI runs")
    parser.add_argument("--procs", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--cycles", type=int, default=None, help="engine or daemon cycles")
    args = parser.parse_args(argv)
    sizes = dict(SHORT if args.short else FULL)
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    if args.model:
        model = pathlib.Path(args.model).resolve()
    else:
        from preload_cli.models import tiny_model
        model = tiny_model("llama", runtime / "tiny-llama")
    name = "soak"
    daemon = Daemon(runtime)
    report: dict = {"model": str(model), "cpus": os.cpu_count()}
    try:
        daemon.client.load(LoadSpec(path=str(model), name=name))
        before = report["before"] = daemon.footprint()
        problems = []
        if args.run in ("concurrency", "all"):
            report["concurrency"], before = concurrency(daemon, name, args.procs or sizes["procs"],
                                                        args.iters or sizes["iters"])
        if args.run in ("engines", "all"):
            report["engines"] = engines(daemon, model, name, args.cycles or sizes["engine_cycles"])
        if args.run in ("daemon", "all"):
            if args.run == "all":  # the daemon the clients and engines used is killed next: check it first
                problems += stable(before, daemon.settled_footprint())
            daemon, report["daemon"] = daemon_restarts(daemon, model, name, args.cycles or sizes["daemon_cycles"])
            if not args.short:  # a daemon of its own: seconds that the short run saves
                report["daemon"]["reload_s"] = round(reload_seconds(model, name), 4)
            before = daemon.footprint() | {"leases": 0, "sessions": 0}  # a new process: compare from here
        report["after"] = daemon.settled_footprint()
        report["problems"] = problems + stable(before, report["after"])
    except Exception as e:
        report["problems"] = [f"{type(e).__name__}: {e}"]
    finally:
        daemon.stop()
        shm = daemon.config.shm_dir
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
