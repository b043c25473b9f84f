"""The daemon's configuration, resolved once (CLI > environment > default), and the places on disk
that follow from it. Nothing else in the daemon reads os.environ."""

import dataclasses
import hashlib
import logging
import os
import pathlib
import re
import sys

from preload_daemon.errors import InvalidRequestError

_DEVICE_RE = re.compile(r"^(cpu|cuda):(\d+)$")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure_logging(level: str) -> None:
    """The one log format of every preload process (CLI, daemon, engine ranks, router): stderr,
    with the pid, so interleaved lines of a process tree can be told apart."""
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")


def parse_device(text: str) -> str:
    """Normalises a device name ("cpu:0", "cuda:1"); raises on anything else."""
    match = _DEVICE_RE.match(text.strip())
    if not match:
        raise InvalidRequestError(f"bad device {text!r}: use cpu:N or cuda:N, e.g. --device cpu:0")
    return f"{match.group(1)}:{int(match.group(2))}"


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


def default_runtime_dir() -> pathlib.Path:
    """$PRELOAD_RUNTIME_DIR, else $XDG_RUNTIME_DIR/preload, else /tmp/preload-$UID."""
    if os.environ.get("PRELOAD_RUNTIME_DIR"):
        return pathlib.Path(os.environ["PRELOAD_RUNTIME_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return pathlib.Path(os.environ["XDG_RUNTIME_DIR"]) / "preload"
    return pathlib.Path(f"/tmp/preload-{os.getuid()}")


def ensure_private_dir(path: pathlib.Path) -> pathlib.Path:
    """Creates `path` with mode 0700, or checks that an existing one is ours and private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise InvalidRequestError(f"{path} belongs to uid {info.st_uid}, not to us ({os.getuid()}); "
                                  "set PRELOAD_RUNTIME_DIR to a directory of your own")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def socket_path(runtime_dir: pathlib.Path, device: str) -> pathlib.Path:
    return runtime_dir / f"daemon-{device.replace(':', '-')}.sock"


def shm_dir_for(runtime_dir: pathlib.Path, shm_root: pathlib.Path = pathlib.Path("/dev/shm")) -> pathlib.Path:
    """The private slab directory for one runtime dir: distinct per user and per runtime dir, so two
    daemons (or two users, or two test sessions) never share slab names."""
    tag = hashlib.sha256(str(runtime_dir.resolve()).encode()).hexdigest()[:12]
    return shm_root / f"preload-{os.getuid()}-{tag}"


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class DaemonConfig:
    """Everything one per-device daemon needs to know."""

    device: str = "cpu:0"
    """The device whose weights this daemon holds: cpu:N or cuda:N."""
    runtime_dir: pathlib.Path = dataclasses.field(default_factory=default_runtime_dir)
    """Private directory (0700) for the sockets, logs and pid files of this user's daemons."""
    shm_dir: pathlib.Path | None = None
    """Where host slabs live; by default a private directory under /dev/shm derived from runtime_dir."""
    http_port: int | None = None
    """If set, also answer HTTP /health and /ready on 127.0.0.1:http_port (0 picks a free port)."""
    reap_interval_s: float = 1.0
    """How often leases of dead processes are looked for."""
    max_message_bytes: int = 64 << 20
    """Largest gRPC message accepted or sent; bigger requests are refused."""
    publish_stall_s: float = 60.0
    """A publishing client that sends no tensor data for this long is dropped (its slabs freed)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", parse_device(self.device))
        object.__setattr__(self, "runtime_dir", pathlib.Path(self.runtime_dir))
        if self.shm_dir is None:
            object.__setattr__(self, "shm_dir", shm_dir_for(self.runtime_dir))
        if self.reap_interval_s <= 0:
            raise InvalidRequestError(f"reap_interval_s must be positive, got {self.reap_interval_s}")

    @property
    def socket_path(self) -> pathlib.Path:
        return socket_path(self.runtime_dir, self.device)

    @property
    def log_path(self) -> pathlib.Path:
        return self.runtime_dir / f"daemon-{self.device.replace(':', '-')}.log"
