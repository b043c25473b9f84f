"""One data-parallel replica as the router sees it (router.py): its engine process, started with
`--replica I --uds SOCKET`, its readiness (the engine's ready line, then a health check every
PROBE_EVERY_S), its requests in flight, and the router's waits on it, which end when it stops
answering."""

import asyncio
import json
import logging
import pathlib
import subprocess
import threading

import anyio
import httpx

from worker.procs import spawn_child

log = logging.getLogger(__name__)
RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
PROBE_EVERY_S = 2.0
PROBE_TIMEOUT_S = 5.0
HUNG_AFTER_PROBES = 2
"""A replica's /ready is asked every PROBE_EVERY_S; one that has not answered within
PROBE_TIMEOUT_S is out of rotation until it does, and once HUNG_AFTER_PROBES in a row went
unanswered (about 15 s) the requests it holds end: a replica busy for a moment keeps them."""


class ReplicaStopped(Exception):
    """The replica a request went to stopped answering (its health check) while it was served."""


class Replica:
    def __init__(self, index: int, uds: pathlib.Path, command: list[str]):
        self.index, self.uds, self.command = index, uds, command
        self.proc: subprocess.Popen | None = None
        self.ready_doc: dict = {}
        self.failure = ""
        self.restarts = 0
        self.in_flight = 0
        self.generation = 0  # counts its processes: a request is counted against the one it went to
        self.reachable = True
        self.unanswered = 0  # health checks in a row
        self.delay, self.next_start = RESTART_DELAY_S, 0.0
        self.ever_ready = False
        # A connection per request, none kept alive: a request that fails on its connection then
        # reached a replica that accepted it (a 502, never sent again), not a kept connection the
        # replica had closed meanwhile (its idle timeout, or its death), which nothing tells apart.
        self.client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(uds)),
                                        limits=httpx.Limits(max_connections=100, max_keepalive_connections=0),
                                        base_url="http://replica", timeout=None)
        # Connections of their own: a scrape does not queue behind a hundred requests in flight.
        self.scraper = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(uds)),
                                         base_url="http://replica", timeout=5)
        self.prober = httpx.Client(transport=httpx.HTTPTransport(uds=str(uds)), base_url="http://replica",
                                   timeout=PROBE_TIMEOUT_S)
        self.loop: asyncio.AbstractEventLoop | None = None
        """The router's event loop, which the prober thread hands _end_waits to (set by wait())."""
        self.waits: set[anyio.CancelScope] = set()
        """The router's waits on this replica now (headers, a stream's next chunk): cancelled when it
        stops answering its health check, so that a hung replica does not hold its requests for good."""

    @property
    def ready(self) -> bool:
        return bool(self.ready_doc) and self.reachable and self.proc is not None and self.proc.poll() is None

    def done(self, generation: int) -> None:
        """A request to process `generation` ended (a later process starts from none)."""
        if generation == self.generation:
            self.in_flight -= 1

    def probe(self) -> None:
        """Asks a started replica's /ready: out of rotation while it does not answer, back once it does."""
        if not self.ready_doc or self.proc is None or self.proc.poll() is not None:
            return
        try:
            answered = self.prober.get("/ready").status_code == 200
        except httpx.HTTPError:
            answered = False
        if answered != self.reachable:
            log.warning("replica %d (pid %d) %s", self.index, self.proc.pid, "answers again; back in rotation"
                        if answered else f"did not answer its health check within {PROBE_TIMEOUT_S:g} s; out of "
                        "rotation until it does")
            self.reachable = answered
        self.unanswered = 0 if answered else self.unanswered + 1
        if self.unanswered >= HUNG_AFTER_PROBES and self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._end_waits)
            except RuntimeError:  # the router's server has stopped, its loop closed: nothing waits any more
                pass

    def _end_waits(self) -> None:
        if self.waits:
            log.warning("replica %d did not answer %d health checks in a row: its %d request(s) end", self.index,
                        self.unanswered, len(self.waits))
        for scope in list(self.waits):
            scope.cancel()

    async def wait(self, awaitable):
        """`awaitable`'s result; ReplicaStopped if the replica stops answering meanwhile."""
        self.loop = asyncio.get_running_loop()
        with anyio.CancelScope() as scope:
            self.waits.add(scope)
            try:
                return await awaitable
            finally:
                self.waits.discard(scope)
        raise ReplicaStopped(f"it did not answer {HUNG_AFTER_PROBES} health checks in a row, each given "
                             f"{PROBE_TIMEOUT_S:g} s")

    def start(self) -> None:
        self.uds.unlink(missing_ok=True)
        self.generation += 1  # first: a request of the old process that ends now no longer counts
        self.ready_doc, self.failure, self.reachable, self.in_flight, self.unanswered = {}, "", True, 0, 0
        self.proc = spawn_child([*self.command, "--replica", str(self.index), "--uds", str(self.uds)],
                                stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read_events, args=(self.proc,), name=f"replica-{self.index}",
                         daemon=True).start()

    def _read_events(self, proc: subprocess.Popen) -> None:
        """The replica's stdout carries its readiness line (and a failure line if it fails)."""
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "ready" and proc is self.proc:
                self.ready_doc, self.ever_ready, self.delay = event, True, RESTART_DELAY_S
                log.info("replica %d ready (%s, pid %d)", self.index, event.get("load_format"), proc.pid)
            elif event.get("event") == "failed" and proc is self.proc:
                self.failure = event.get("error", "failed")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
