"""What one engine worker knows about itself: its weights, engine, tokenizer, readiness and timings.
Shared by the HTTP handlers, the loading thread and the lease watcher."""

import logging
import os
import threading
import time
import weakref

from preload_daemon.errors import InvalidRequestError
from worker import metrics
from worker.engine import Engine
from worker.loader import LeaseKeeper, LoadedWeights
from worker.clock import process_start_time
from worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
        self.keepers: list[LeaseKeeper] = []
        self.draft: LoadedWeights | None = None
        self.restored: dict = {}
        """After a snapshot restore (worker/quiesce.py): the snapshot and the restore's timestamps."""
        self.snapshot_agent = None
        """worker/quiesce.Quiescer where this engine can be snapshotted."""
        self._ready = threading.Event()
        self._generations = weakref.WeakSet()  # the HTTP server's under way (server.Generation)
        self._generations_lock = threading.Lock()

    def set_ready(self, weights: LoadedWeights, engine: Engine, tokenizer: Tokenizer | None,
                  ranks: list[dict]) -> dict:
        """`ranks`: every TP rank's readiness document (rank, device, load format, timings)."""
        self.weights, self.engine, self.tokenizer, self.ranks = weights, engine, tokenizer, ranks
        self.timings.update(weights_start=weights.started, weights_done=weights.finished, ready=time.time())
        self._ready.set()
        return self.readiness()

    def is_ready(self) -> bool:
        return self._ready.is_set() and not self.failure and not self.weights_gone()

    def not_ready_reason(self) -> str:
        return self.failure or self.weights_gone() or ("ready" if self._ready.is_set() else "loading weights")

    def weights_gone(self) -> str:
        """Why the weights this engine reads may no longer exist (its daemon died holding them in
        memory that dies with it: a CUDA slab), or ""."""
        return "; ".join(k.lost for k in self.keepers if k.lost and k.fatal)

    def readiness(self) -> dict:
        """The /ready body: a status, and the timestamps process_start, weights_start, weights_done, ready."""
        status = "ready" if self.is_ready() else "failed" if self.failure or self.weights_gone() else "loading"
        body = {"status": status, "model": self.name, **self.timings, "requested_load_format": self.requested_format,
                "replica": self.replica, "pid": os.getpid()}
        if self.snapshot_agent is not None:  # what `preload snapshot create` needs to reach it
            body["pid"] = self.snapshot_agent.host_pid
            body["snapshot"] = {"wake_fd": self.snapshot_agent.wake_fd, "listen": self.snapshot_agent.listen,
                                **({"problem": self.snapshot_agent.problem} if self.snapshot_agent.problem else {})}
        if self.weights is not None:
            formats = {r.get("load_format") for r in self.ranks} or {self.weights.load_format}
            # This host's pid for this process: a restored copy's own (in its namespace) is the original's.
            ranks = [{**r, "pid": body["pid"]} if r.get("pid") == os.getpid() else r for r in self.ranks]
            body.update(load_format=formats.pop() if len(formats) == 1 else "mixed",
                        fallback_reason=self.weights.fallback_reason, weights_version=self.weights.version,
                        content_digest=self.weights.content_digest, tp_size=len(self.ranks), ranks=ranks)
            if self.ranks and "draft" in self.ranks[0]:
                body["draft"] = self.ranks[0]["draft"]
            if self.engine is not None and self.engine.speculator is not None:
                body["speculation"] = self.engine.speculation()
        if status != "ready":
            body["reason"] = self.not_ready_reason()
        if degraded := self.degraded():
            body["degraded"] = degraded
        if self.restored:
            body["restored"] = self.restored
        return body

    def track(self, generation, running: bool) -> None:
        """A generation of the HTTP server's starts (running) or ends, for interrupt_generations."""
        with self._generations_lock:
            (self._generations.add if running else self._generations.discard)(generation)

    def interrupt_generations(self, reason: str) -> None:
        """From any thread: every generation under way ends with `reason` (the snapshot's drain)."""
        with self._generations_lock:
            running = list(self._generations)
        for generation in running:
            generation.interrupt(reason)

    def health(self) -> dict:
        """The /health body: alive, or degraded (serving, but without its daemon) and why."""
        degraded = self.degraded()
        return {"status": "degraded" if degraded else "alive", "model": self.name,
                **({"reason": degraded} if degraded else {})}

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint ships no tokenizer.json; send token ids as the prompt")
        limit = self.tokenizer.max_text_chars(self.engine.max_len)  # before tokenizing: seconds of a core past it
        if len(text) > limit:
            raise InvalidRequestError(f"the prompt's text is {len(text)} characters, more than this engine's context "
                                      f"of {self.engine.max_len} tokens can hold ({limit} at most); send a shorter "
                                      "prompt")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def token_name(self, token: int) -> str:
        """One token as log-probabilities name it: its text; for one that holds part of a character
        (a replacement character alone), "bytes:" and its bytes escaped, as OpenAI's; "token_id:N"
        without a tokenizer."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        data = self.tokenizer.token_bytes(token)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes one token adds to a text (a character may span tokens; b"" without a tokenizer)."""
        return self.tokenizer.token_bytes(token) if self.tokenizer is not None else b""

    def chat_prompt(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint ships no tokenizer.json and so no chat template; use "
                                      "/v1/completions with token ids")
        return self.tokenizer.chat_prompt(messages)

    def attachments(self) -> list[LoadedWeights]:
        """The weights (main, draft) that are leased from a daemon."""
        return [w for w in (self.weights, self.draft) if w is not None and w.attached is not None]

    def keep_leases(self, device: str, runtime_dir) -> None:
        """Keeps the daemon leases of the attachments (main, draft) across daemon restarts
        (LeaseKeeper): while one is lost, /health says degraded and why."""
        self.keepers = [LeaseKeeper(w, device, runtime_dir).start() for w in self.attachments()]

    def degraded(self) -> str:
        return "; ".join(k.lost for k in self.keepers if k.lost)

    def metrics_text(self) -> str:
        return metrics.metrics_text(self)
