"""Shared fixtures: small checkpoints built on the fly and real daemon processes on real sockets."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import torch

from preload_cli.models import tiny_model
from preload_daemon.client import DaemonClient
from preload_daemon.config import DaemonConfig
from preload_daemon.default_model import default_model_path
from preload_daemon.errors import DaemonUnavailableError
from preload_daemon.leases import process_start_time
from preload_daemon.sessions import Session

REPO = pathlib.Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_llama(checkpoints) -> pathlib.Path:
    """A 2-layer random Llama (GQA, fp32) saved by transformers."""
    return tiny_model("llama", checkpoints / "tiny-llama")


def copy_checkpoint(source: pathlib.Path, target: pathlib.Path) -> dict:
    """A private copy of a single-file checkpoint (to rewrite in place); returns its tensors."""
    from safetensors.torch import load_file, save_file
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    save_file(tensors, str(target / "model.safetensors"))
    return tensors


def me() -> Session:
    """This process as a ModelStore session (in-process store tests attach with it)."""
    return Session("t" * 32, os.getpid(), os.getuid(), process_start_time(os.getpid()))


@pytest.fixture(scope="session")
def default_model() -> pathlib.Path:
    """The embedded default model, converted once per machine (about 20 s the first time)."""
    return default_model_path()


def exited(process: "psutil.Process | int") -> bool:
    """Whether a process (or pid, as this host numbers it) has ended: gone, or a zombie awaiting its
    parent's wait."""
    try:
        return (psutil.Process(process) if isinstance(process, int) else process).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def runtime_dir():
    """A short private runtime dir (Unix socket paths are limited to 108 bytes), and its slabs."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="pl-", dir="/tmp"))
    yield path
    shm = DaemonConfig(runtime_dir=path).shm_dir
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)


class DaemonHandle:
    """A real daemon process (`python -m preload_daemon`)."""

    def __init__(self, runtime_dir: pathlib.Path, device: str = "cpu:0", http_port: int | None = None):
        self.config = DaemonConfig(device=device, runtime_dir=runtime_dir, http_port=http_port)
        cmd = [sys.executable, "-m", "preload_daemon", "--device", device, "--runtime-dir", str(runtime_dir),
               "--log-level", "DEBUG"]
        if http_port is not None:
            cmd += ["--http-port", str(http_port)]
        self.log = open(runtime_dir / f"test-{device.replace(':', '-')}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        self.client = DaemonClient(self.config.socket_path, timeout=60)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.stats(timeout=1)
                break
            except DaemonUnavailableError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"daemon did not start:\n{self.output()}")
                time.sleep(0.05)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def start_daemon(runtime_dir):
    daemons = []

    def start(device: str = "cpu:0", http_port: int | None = None) -> DaemonHandle:
        daemons.append(DaemonHandle(runtime_dir, device, http_port))
        return daemons[-1]

    yield start
    for d in daemons:
        d.stop()


@pytest.fixture
def daemon(start_daemon) -> DaemonHandle:
    return start_daemon()


def run_cli(*args, runtime_dir=None, check=False) -> subprocess.CompletedProcess:
    """Runs a `preload` command in this process (its main(), output captured): what run_preload
    does without paying an interpreter and torch import per command. Daemons it starts are still
    their own processes."""
    import contextlib
    import io

    from preload_cli.main import main
    argv = [*map(str, args), *(["--runtime-dir", str(runtime_dir)] if runtime_dir else [])]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 2
    result = subprocess.CompletedProcess(["preload", *argv], code, out.getvalue(), err.getvalue())
    if check:
        result.check_returncode()
    return result


def run_python(code: str, timeout: float = 120) -> str:
    """The stdout of `code` run in a fresh interpreter in the checkout (which must succeed)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def run_preload(*args, runtime_dir=None, timeout=120, check=False, env_extra=None) -> subprocess.CompletedProcess:
    """Runs the `preload` console script as a user would."""
    env = {**os.environ, **({"PRELOAD_RUNTIME_DIR": str(runtime_dir)} if runtime_dir else {}), **(env_extra or {})}
    cmd = [sys.executable, "-m", "preload_cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=check)
