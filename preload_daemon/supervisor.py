"""What `preload serve` does: start (or reuse) one daemon per device, load each rank's shard with a
progress bar (versions.publish_dir), wait until every rank is ready, then watch the daemons in the
foreground. The CLI layer parses the arguments and calls serve()."""

import dataclasses
import logging
import os
import pathlib
import signal
import stat
import subprocess
import sys
import threading
import time

from preload_daemon.arch import ArchSpec
from preload_daemon.client import DaemonClient
from preload_daemon.config import DaemonConfig, core_share, resolve_devices
from preload_daemon.default_model import default_model_path
from preload_daemon.errors import DaemonUnavailableError, InvalidRequestError
from preload_daemon.hfconfig import read_config
from preload_daemon.plan import LoadSpec
from preload_daemon.records import check_new_name
from preload_daemon.runtime_dir import ensure_private_dir
from preload_daemon.versions import Target, publish_dir

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0


class DaemonProcess:
    """A daemon this command started (and stops on exit)."""

    def __init__(self, device: str, runtime_dir: pathlib.Path, log_level: str = "INFO",
                 allow_external_links: bool = False, threads: int = 0):
        self.device = device
        self.config = DaemonConfig(device=device, runtime_dir=runtime_dir, threads=threads)
        self.log_file = open_log(self.config.log_path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "preload_daemon", "--device", device, "--runtime-dir", str(runtime_dir),
             "--log-level", log_level, *(["--allow-external-links"] if allow_external_links else []),
             *(["--threads", str(threads)] if threads else [])],
            stdin=subprocess.DEVNULL, stdout=self.log_file, stderr=subprocess.STDOUT)

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        with DaemonClient(self.config.socket_path, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise DaemonUnavailableError(f"daemon for {self.device} exited with code {self.proc.returncode} "
                                                 f"during start:\n{self.log_tail()}")
                try:
                    client.stats()
                    return
                except DaemonUnavailableError:
                    time.sleep(0.05)
        raise DaemonUnavailableError(f"daemon for {self.device} did not answer within {timeout:g}s; "
                                     f"see {self.config.log_path}")

    def log_tail(self, lines: int = 15) -> str:
        text = self.config.log_path.read_text(errors="replace").splitlines()
        return "\n".join("    " + line for line in text[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


def open_log(path: pathlib.Path):
    """The daemon's log, appended to: a regular file of ours, never through a link (it lies in the
    private runtime dir; a FIFO there would block the open, a link aim our writes elsewhere)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
    except OSError as e:
        raise InvalidRequestError(f"cannot open the daemon's log {path} ({e.strerror}); remove it") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise InvalidRequestError(f"{path} is not a regular file of ours; remove it")
    return os.fdopen(fd, "ab")


def ensure_daemon(device: str, runtime_dir: pathlib.Path, log_level: str = "INFO",
                  allow_external_links: bool = False, started: list | None = None,
                  threads: int = 0) -> DaemonProcess | None:
    """Reuses the daemon serving `device` if one answers (with the options it was started with);
    otherwise starts one (with `threads` compute threads; 0: every core) and returns it, appended to
    `started` as soon as it is spawned (so that a caller interrupted while it starts stops it too)."""
    config = DaemonConfig(device=device, runtime_dir=runtime_dir)
    with DaemonClient(config.socket_path, timeout=2.0) as client:
        try:
            stats = client.stats()
            log.info("reusing daemon for %s (pid %d)", device, stats.pid)
            return None
        except DaemonUnavailableError:
            pass
    ensure_private_dir(runtime_dir)
    daemon = DaemonProcess(device, runtime_dir, log_level, allow_external_links, threads)
    if started is not None:
        started.append(daemon)
    daemon.wait_started()
    log.info("started daemon for %s (pid %d, log %s)", device, daemon.proc.pid, config.log_path)
    return daemon


def serve(model: str | None, *, name: str = "", tp_size: int = 1, devices: str = "", dtype: str = "auto",
          quantization: str = "none", runtime_dir: pathlib.Path, log_level: str = "INFO",
          supervise: bool = True, keep: int | None = None, max_bytes: int | None = None,
          draft_model: str | None = None, allow_external_links: bool = False) -> int:
    """Starts (or reuses) one daemon per device, loads rank r of `model` (default: the embedded default
    model) on device r, and then, if `supervise`, watches the daemons until SIGINT/SIGTERM; otherwise
    returns once loaded and leaves them running. A checkpoint not loaded before becomes a new version
    of `name` and, once every rank holds it, the active one. 0 on success, 1 when a supervised daemon
    dies."""
    model = os.path.abspath(model or str(default_model_path()))
    device_list = resolve_devices(devices, tp_size)
    spec = LoadSpec(path=model, name=name, dtype=dtype, quantization=quantization, tp_size=tp_size)
    check_new_name(spec.name)  # before any daemon starts
    arch = ArchSpec.from_config(read_config(model), model)
    arch.check_tp(tp_size, quantization)  # (it started the other daemons and used up a version number first)
    # A checkpoint with MTP layers gets its draft component too (it shares the main one's embedding and lm_head).
    components = ("main", "draft") if arch.num_mtp_layers else ("main",)
    targets = [Target(device, [dataclasses.replace(spec.layout, tp_rank=r, component=c) for c in components])
               for r, device in enumerate(device_list)]
    started: list[DaemonProcess] = []
    stop, loading = threading.Event(), []
    # The ranks load at once, each converting and quantizing on torch's threads: each daemon gets its
    # share of the cores, as each rank of a TP engine does (with every core each, two daemons loading
    # TP=2 of a 1 GB model with int8 on a 2-core VM took 4.7-15.6 s a rank against 0.6 s, their
    # OpenMP threads spinning on each other's cores).
    threads = core_share(len(device_list))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:  # while loading: end the command (watch() sets `stop` instead)
        signal.signal(sig, _interrupt)
    try:
        for device in device_list:
            ensure_daemon(device, runtime_dir, log_level, allow_external_links, started, threads)
        loading.append(True)
        published = publish_dir(spec.name, model, targets, runtime_dir, always_activate=False, keep=keep,
                                max_bytes=max_bytes)
        results = list(zip(device_list, published.variants))
        if draft_model:  # a separate draft checkpoint, beside the model, in the same layouts
            draft_model = os.path.abspath(draft_model)
            draft_targets = [Target(t.device, [dataclasses.replace(t.layouts[0], component="main")]) for t in targets]
            draft = publish_dir(LoadSpec(path=draft_model).name, draft_model, draft_targets, runtime_dir,
                                always_activate=False, keep=keep, max_bytes=max_bytes)
            results += list(zip(device_list, draft.variants))
        for device, variants in results:
            for info in variants:
                print(f"ready: {info.name} v{info.version} ({info.key.component}) on {device} ({info.num_tensors} "
                      f"tensors, {info.slab_bytes / 2**20:.1f} MiB, loaded in {info.load_seconds:.2f}s)", flush=True)
        if not supervise:
            started.clear()  # leave them running
            return 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        return watch(started, device_list, runtime_dir, stop)
    except Interrupted as e:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second one must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        reused = [d for d in device_list if d not in {daemon.device for daemon in started}] if loading else []
        print(f"preload serve: interrupted by {signal.Signals(e.signum).name} while "
              + ("loading" if loading else "starting the daemons")
              + (f"; stopping the daemons this command started ({', '.join(d.device for d in started)})"
                 + (": their load is dropped" if loading else "") if started else "")
              + (f"; the daemons it reused ({', '.join(reused)}) finish the load under way: `preload status` shows "
                 f"it, `preload evict {spec.name}@VERSION` frees it" if reused else ""), file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        for daemon in started:
            daemon.stop()
        for sig, handler in previous.items():  # serve may run inside a longer-lived process
            signal.signal(sig, handler)


class Interrupted(Exception):
    """SIGINT or SIGTERM while serve loads: the command ends, cleaning up on its way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise Interrupted(signum)


def watch(started: list[DaemonProcess], devices: list[str], runtime_dir, stop: threading.Event) -> int:
    """Watches every rank's daemon until SIGINT/SIGTERM; a dead daemon ends serve with exit code 1."""
    print(f"serving on {', '.join(devices)}; Ctrl-C stops the daemons this command started", flush=True)
    while not stop.wait(1.0):
        for daemon in started:
            if daemon.proc.poll() is not None:
                print(f"daemon for {daemon.device} died (exit code {daemon.proc.returncode}):\n{daemon.log_tail()}",
                      file=sys.stderr)
                return 1
        for device in devices:
            with DaemonClient.for_device(device, runtime_dir, timeout=5.0) as client:
                try:
                    client.stats()
                except DaemonUnavailableError:
                    print(f"daemon for {device} stopped answering", file=sys.stderr)
                    return 1
    return 0

