"""The daemon's configuration, resolved once (CLI > environment > default), and the places on disk
that follow from it (their making and checking: runtime_dir.py). Nothing else in the daemon reads
os.environ."""

import dataclasses
import logging
import os
import pathlib
import re
import sys

from preload_daemon.errors import InvalidRequestError
from preload_daemon.runtime_dir import DAEMON_SOCKET_TAIL, check_socket_room, shm_dir_for, socket_path

_DEVICE_RE = re.compile(r"^(cpu|cuda):(\d{1,4})$")  # up to 9999: no int() of a long string


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_THREADS = 1024  # compute threads a process may ask for (100,000 failed as Python's "can't start new thread")


def configure_logging(level: str) -> None:
    """The one log format of every preload process (CLI, daemon, engine ranks, router): stderr,
    with the pid, so interleaved lines of a process tree can be told apart."""
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")


def parse_device(text: str) -> str:
    """Normalises a device name ("cpu:0", "cuda:1"); raises on anything else."""
    match = _DEVICE_RE.match(text.strip())
    if not match:
        raise InvalidRequestError(f"bad device {text!r}: use cpu:N or cuda:N (N < 10000), e.g. --device cpu:0")
    return f"{match.group(1)}:{int(match.group(2))}"


def cuda_ordinal(device: str) -> int | None:
    """N of a (parsed) "cuda:N" device name; None for any other device."""
    return int(device.split(":")[1]) if device.startswith("cuda:") else None


def resolve_devices(devices: str, tp_size: int) -> list[str]:
    """One device per TP rank: the comma-separated `devices`, or cpu:0..cpu:TP-1."""
    if tp_size < 1:
        raise InvalidRequestError(f"--tp-size must be at least 1, got {tp_size}")
    if not devices:
        return [f"cpu:{r}" for r in range(tp_size)]
    parsed = [parse_device(d) for d in devices.split(",")]
    if len(parsed) != tp_size or len(set(parsed)) != tp_size:
        raise InvalidRequestError(f"--devices lists {len(parsed)} device(s) ({devices}) for --tp-size {tp_size}; "
                                  "give one distinct device per rank")
    return parsed


def core_share(processes: int) -> int:
    """Compute threads for each of `processes` processes of this host that load or run at once (a TP
    engine's ranks and replicas, serve's daemons): its share of the cores, at least 1; 0 for a
    process alone (torch's default: every core). Each with every core, their OpenMP threads spin on
    each other's cores."""
    return max(1, (os.cpu_count() or 1) // processes) if processes > 1 else 0


def default_runtime_dir() -> pathlib.Path:
    """$PRELOAD_RUNTIME_DIR, else $XDG_RUNTIME_DIR/preload, else /tmp/preload-$UID."""
    if os.environ.get("PRELOAD_RUNTIME_DIR"):  # absolute: a relative one meant another dir in each process
        return pathlib.Path(os.path.abspath(os.environ["PRELOAD_RUNTIME_DIR"]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        return pathlib.Path(os.path.abspath(os.environ["XDG_RUNTIME_DIR"])) / "preload"
    return pathlib.Path(f"/tmp/preload-{os.getuid()}")


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class DaemonConfig:
    """Everything one per-device daemon needs to know."""

    device: str = "cpu:0"
    """The device whose weights this daemon holds: cpu:N or cuda:N."""
    runtime_dir: pathlib.Path = dataclasses.field(default_factory=default_runtime_dir)
    """Private directory (0700) for the sockets, logs and pid files of this user's daemons."""
    shm_dir: pathlib.Path | None = None
    """Where host slabs live; by default a private directory with a random name under /dev/shm,
    recorded in runtime_dir (see shm_dir_for)."""
    http_port: int | None = None
    """If set, also answer HTTP /health, /ready and /metrics on 127.0.0.1:http_port (0 picks a free port)."""
    reap_interval_s: float = 1.0
    """How often leases of dead processes are looked for."""
    max_message_bytes: int = 64 << 20
    """Largest gRPC message accepted or sent; bigger requests are refused."""
    allow_external_links: bool = False
    """Load checkpoint files that link outside their directory (a Hugging Face cache snapshot does)."""
    load_timeout_s: float = 3600.0
    """A load or publish still running after this long fails and frees what it made."""
    max_sessions: int = 1024
    """Open sessions (one per attached process) beyond which new ones are refused."""
    max_rpcs: int = 256
    """Concurrent RPCs beyond which new ones are refused with RESOURCE_EXHAUSTED."""
    publish_stall_s: float = 60.0
    """A publishing client that sends no tensor data for this long is dropped (its slabs freed)."""
    threads: int = 0
    """torch's compute threads for conversions and quantization; 0 leaves torch's default (every core).
    Daemons of one host loading at once share its cores: `preload serve` gives each its share."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", parse_device(self.device))
        object.__setattr__(self, "runtime_dir", pathlib.Path(self.runtime_dir))
        # Everything checked before the slab directory is made: a runtime dir too long for the
        # daemon's own sockets, or a bad flag, had left an empty /dev/shm/preload-* behind each
        # refused start.
        if self.reap_interval_s <= 0:
            raise InvalidRequestError(f"reap_interval_s must be positive, got {self.reap_interval_s}")
        if not 0 <= self.threads <= MAX_THREADS:
            raise InvalidRequestError(f"--threads must be 0..{MAX_THREADS} (0: every core; this host has "
                                      f"{os.cpu_count()}), got {self.threads}")
        if not self.load_timeout_s > 0 or self.max_sessions < 1 or self.max_rpcs < 1:
            raise InvalidRequestError(f"--load-timeout must be positive and --max-sessions at least 1; got "
                                      f"{self.load_timeout_s:g} and {self.max_sessions}")
        check_socket_room(self.runtime_dir, DAEMON_SOCKET_TAIL)
        if self.shm_dir is None:
            object.__setattr__(self, "shm_dir", shm_dir_for(self.runtime_dir))

    @property
    def socket_path(self) -> pathlib.Path:
        return socket_path(self.runtime_dir, self.device)

    @property
    def log_path(self) -> pathlib.Path:
        return self.runtime_dir / f"daemon-{self.device.replace(':', '-')}.log"
