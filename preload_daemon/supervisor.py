"""What `preload serve` does: start (or reuse) one daemon per device, load each rank's shard with a
progress bar, wait until every rank is ready, then watch the daemons in the foreground. The CLI
layer parses the arguments and calls serve()."""

import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from tqdm import tqdm

from preload_daemon.client import DaemonClient
from preload_daemon.config import DaemonConfig, ensure_private_dir, resolve_devices
from preload_daemon.default_model import default_model_path
from preload_daemon.errors import DaemonUnavailableError, PreloadError
from preload_daemon.plan import LoadSpec

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0


class DaemonProcess:
    """A daemon this command started (and stops on exit)."""

    def __init__(self, device: str, runtime_dir: pathlib.Path, log_level: str = "INFO"):
        self.device = device
        self.config = DaemonConfig(device=device, runtime_dir=runtime_dir)
        self.log_file = open(self.config.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "preload_daemon", "--device", device, "--runtime-dir", str(runtime_dir),
             "--log-level", log_level],
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


def ensure_daemon(device: str, runtime_dir: pathlib.Path, log_level: str = "INFO") -> DaemonProcess | None:
    """Reuses the daemon serving `device` if one answers; otherwise starts one and returns it."""
    config = DaemonConfig(device=device, runtime_dir=runtime_dir)
    with DaemonClient(config.socket_path, timeout=2.0) as client:
        try:
            stats = client.stats()
            log.info("reusing daemon for %s (pid %d)", device, stats.pid)
            return None
        except DaemonUnavailableError:
            pass
    ensure_private_dir(runtime_dir)
    daemon = DaemonProcess(device, runtime_dir, log_level)
    daemon.wait_started()
    log.info("started daemon for %s (pid %d, log %s)", device, daemon.proc.pid, config.log_path)
    return daemon


def load_all(specs: list[LoadSpec], devices: list[str], runtime_dir: pathlib.Path, show_progress: bool = True):
    """Loads spec r on device r, all ranks at once, one progress bar per rank."""
    results: list = [None] * len(specs)
    bars = [tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=f"{spec.name} rank {r} {devices[r]}",
                 position=r, disable=not show_progress, mininterval=0.1 if sys.stderr.isatty() else 2.0)
            for r, spec in enumerate(specs)]

    def load(rank: int) -> None:
        def on_progress(update) -> None:
            bar = bars[rank]
            if update.bytes_total and bar.total != update.bytes_total:
                bar.reset(total=update.bytes_total)
            bar.set_postfix_str(f"{update.stage} {update.tensors_done}/{update.tensors_total} tensors", refresh=False)
            bar.update(update.bytes_done - bar.n)
        try:
            with DaemonClient.for_device(devices[rank], runtime_dir) as client:
                results[rank] = client.load(specs[rank], on_progress)
        except PreloadError as e:
            results[rank] = e

    threads = [threading.Thread(target=load, args=(r,)) for r in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for bar in bars:
        bar.close()
    for rank, result in enumerate(results):
        if isinstance(result, Exception):
            raise type(result)(f"rank {rank} on {devices[rank]}: {result}")
    return results


def serve(model: str | None, *, name: str = "", tp_size: int = 1, devices: str = "", dtype: str = "auto",
          quantization: str = "none", runtime_dir: pathlib.Path, log_level: str = "INFO",
          supervise: bool = True) -> int:
    """Starts (or reuses) one daemon per device, loads rank r of `model` (default: the embedded default
    model) on device r, and then, if `supervise`, watches the daemons until SIGINT/SIGTERM; otherwise
    returns once loaded and leaves them running. 0 on success, 1 when a supervised daemon dies."""
    model = model or str(default_model_path())
    device_list = resolve_devices(devices, tp_size)
    specs = [LoadSpec(path=os.path.abspath(model), name=name, dtype=dtype, quantization=quantization,
                      tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    started: list[DaemonProcess] = []
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for device in device_list:
            daemon = ensure_daemon(device, runtime_dir, log_level)
            if daemon is not None:
                started.append(daemon)
        infos = load_all(specs, device_list, runtime_dir)
        for device, info in zip(device_list, infos):
            print(f"ready: {info.name} v{info.version} on {device} ({info.num_tensors} tensors, "
                  f"{info.slab_bytes / 2**20:.1f} MiB, loaded in {info.load_seconds:.2f}s)", flush=True)
        if not supervise:
            started.clear()  # leave them running
            return 0
        return watch(started, device_list, runtime_dir, stop)
    finally:
        for daemon in started:
            daemon.stop()


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

