"""What one engine worker knows about itself: its weights, engine, tokenizer, readiness and timings.
Shared by the HTTP handlers, the loading thread and the lease watcher."""

import logging
import os
import threading
import time

from preload_daemon.errors import InvalidRequestError, PreloadError
from worker.engine import Engine
from worker.loader import LoadedWeights
from worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def process_start_time() -> float:
    """When this process started, as a wall-clock timestamp, to the kernel's 10 ms tick.
    (psutil's create_time adds the boot time, which /proc/stat rounds to whole seconds.)"""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class WorkerState:
    def __init__(self, name: str, requested_format: str, replica: int = 0):
        self.name = name
        self.requested_format = requested_format
        self.replica = replica
        self.ranks: list[dict] = []
        self.process_start = process_start_time()
        self.timings: dict[str, float] = {"process_start": self.process_start}
        self.engine: Engine | None = None
        self.tokenizer: Tokenizer | None = None
        self.weights: LoadedWeights | None = None
        self.failure = ""
        self._ready = threading.Event()

    def set_ready(self, weights: LoadedWeights, engine: Engine, tokenizer: Tokenizer | None,
                  ranks: list[dict]) -> dict:
        """`ranks`: every TP rank's readiness document (rank, device, load format, timings)."""
        self.weights, self.engine, self.tokenizer, self.ranks = weights, engine, tokenizer, ranks
        self.timings.update(weights_start=weights.started, weights_done=weights.finished, ready=time.time())
        self._ready.set()
        return self.readiness()

    def is_ready(self) -> bool:
        return self._ready.is_set() and not self.failure

    def not_ready_reason(self) -> str:
        return self.failure or ("ready" if self._ready.is_set() else "loading weights")

    def readiness(self) -> dict:
        """The /ready body: a status, and the timestamps process_start, weights_start, weights_done, ready."""
        status = "ready" if self.is_ready() else "failed" if self.failure else "loading"
        body = {"status": status, "model": self.name, **self.timings, "requested_load_format": self.requested_format,
                "replica": self.replica, "pid": os.getpid()}
        if self.weights is not None:
            formats = {r.get("load_format") for r in self.ranks} or {self.weights.load_format}
            body.update(load_format=formats.pop() if len(formats) == 1 else "mixed",
                        fallback_reason=self.weights.fallback_reason, weights_version=self.weights.version,
                        content_digest=self.weights.content_digest, tp_size=len(self.ranks), ranks=self.ranks)
            if self.ranks and "draft" in self.ranks[0]:
                body["draft"] = self.ranks[0]["draft"]
            if self.engine is not None and self.engine.speculator is not None:
                body["speculation"] = self.engine.speculation()
        if status != "ready":
            body["reason"] = self.not_ready_reason()
        return body

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint ships no tokenizer.json; send token ids as the prompt")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def watch_lease(self, interval: float = 1.0) -> None:
        """While attached, confirm the lease every `interval`; if the daemon goes away, stop
        reporting ready rather than serve from weights nobody vouches for any more."""
        attached = self.weights.attached if self.weights else None
        if attached is None:
            return

        def watch() -> None:
            while not self.failure:
                time.sleep(interval)
                try:
                    attached.renew()
                except PreloadError as e:
                    self.failure = f"lost the daemon's lease on {self.name}: {e}"
                    log.error("%s; no longer ready", self.failure)

        threading.Thread(target=watch, name="lease-watch", daemon=True).start()

    def metrics_text(self) -> str:
        stats = self.engine.stats if self.engine else {}
        labels = f'model="{self.name}",replica="{self.replica}"'
        lines = ["# TYPE preload_engine_ready gauge", f"preload_engine_ready{{{labels}}} {int(self.is_ready())}"]
        if "weights_done" in self.timings:
            fmt = f'{labels},load_format="{self.weights.load_format}"'
            lines += ["# TYPE preload_engine_weights_seconds gauge",
                      f"preload_engine_weights_seconds{{{fmt}}} "
                      f'{self.timings["weights_done"] - self.timings["weights_start"]:.6f}',
                      "# TYPE preload_engine_start_to_ready_seconds gauge",
                      f"preload_engine_start_to_ready_seconds{{{fmt}}} "
                      f'{self.timings["ready"] - self.timings["process_start"]:.6f}']
        for key, value in stats.items():
            lines += [f"# TYPE preload_engine_{key}_total counter", f"preload_engine_{key}_total{{{labels}}} {value}"]
        speculation = self.engine.speculation() if self.engine else {}
        for key in ("acceptance_rate", "mean_accepted_length", "tokens_per_main_forward"):
            if key in speculation:
                lines += [f"# TYPE preload_engine_spec_{key} gauge",
                          f"preload_engine_spec_{key}{{{labels}}} {speculation[key]:.6f}"]
        return "\n".join(lines) + "\n"
