import json
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import REPO


def post(url: str, body: dict) -> dict:
    """A JSON POST to an engine, its JSON answer."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


class EngineProcess:
    """A real `preload engine` process on a free port; `ready` is its readiness JSON line."""

    def __init__(self, model, load_format: str, runtime_dir, *extra: str, wait: bool = True):
        cmd = [sys.executable, "-m", "preload_cli", "engine", str(model), "--load-format", load_format,
               "--port", "0", "--runtime-dir", str(runtime_dir), "--max-batch", "4", "--max-model-len", "256", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        self.ready = json.loads(self.proc.stdout.readline() or "{}") if wait else {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ready['port']}"

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


@pytest.fixture
def start_engine(runtime_dir):
    engines = []

    def start(model, load_format, *extra, wait=True) -> EngineProcess:
        engines.append(EngineProcess(model, load_format, runtime_dir, *extra, wait=wait))
        return engines[-1]

    yield start
    for engine in engines:
        engine.stop()
