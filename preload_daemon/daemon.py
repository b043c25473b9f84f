"""The daemon process: server, lease reaper, optional HTTP probes, signal handling."""

import http.server
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.parse

import torch
from prometheus_client import CONTENT_TYPE_LATEST

from preload_daemon.config import DaemonConfig
from preload_daemon.errors import InvalidRequestError
from preload_daemon.runtime_dir import check_socket_room
from preload_daemon.server import DaemonServer

log = logging.getLogger(__name__)

MAX_PROBE_CONNECTIONS = 32
PROBE_DEADLINE_S = 2.0
"""A probe connection's whole request and answer: one that takes longer is cut."""
PROBE_EVICT_WAIT_S = 1.0
"""How long a new probe connection waits for the slot of the oldest one, which it cut."""


def run(config: DaemonConfig, on_started=lambda server, http_port: None) -> int:
    """Runs one per-device daemon until SIGTERM or SIGINT; returns the exit code."""
    try:  # the room for its own sockets DaemonConfig checked
        check_socket_room(config.runtime_dir)
    except InvalidRequestError as e:
        log.warning("%s (data-parallel engines and snapshots need that room; this daemon does not)", e)
    # A daemon of the device holds its lock: DaemonServer says so. Whatever else is at the socket's
    # path (one a dead daemon left, or a process of ours listening there) is replaced.
    probes = _bind_http(config.http_port) if config.http_port is not None else None  # before any socket is made
    try:
        server = DaemonServer(config)
    except OSError as e:  # a directory or a link where a socket or the lock goes, an unwritable runtime dir
        if probes:
            probes.server_close()
        where = f": {e.filename}" if e.filename else ""
        raise InvalidRequestError(f"cannot start the daemon for {config.device}: {e.strerror or e}{where}; remove "
                                  f"what is in the way, or set PRELOAD_RUNTIME_DIR to a directory of your own") from None
    if config.threads:
        torch.set_num_threads(config.threads)
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=_reap_loop, args=(server, stop, config.reap_interval_s), name="reaper",
                     daemon=True).start()
    if probes:
        _serve_http(probes, server)
    http_port = probes.server_address[1] if probes else None
    log.info("daemon for %s serving on %s (pid %d, %s%s)", config.device, config.socket_path, os.getpid(),
             _compute_threads(), f", HTTP probes on 127.0.0.1:{http_port}" if probes else "")
    on_started(server, http_port)
    # With a timeout: a signal the kernel hands to another thread (the main one just continued from
    # SIGSTOP, say) runs its Python handler only when this thread next runs Python; a wait without
    # one would sleep through SIGTERM for good.
    while not stop.wait(1.0):
        pass
    log.info("daemon for %s shutting down: freeing %d slab(s)", config.device, len(server.store.variants()))
    if probes:
        probes.shutdown()
    server.stop()
    return 0


def _compute_threads() -> str:
    count = torch.get_num_threads()
    return f"{count} compute thread{'s' if count != 1 else ''}"


def _reap_loop(server: DaemonServer, stop: threading.Event, interval: float) -> None:
    """Ends the leases of processes that are gone, and says (once) if this daemon's socket goes:
    its runtime dir removed (a cleanup of /tmp), the daemon goes on serving the engines attached but
    no new client finds it."""
    path = server.config.socket_path
    socket_id, missing = _file_id(path), False
    while not stop.wait(interval):
        try:
            server.store.leases.reap()
        except Exception:
            log.exception("lease reaper failed; retrying")
        if (_file_id(path) != socket_id) != missing:
            missing = not missing
            if missing:
                log.error("this daemon's socket %s was removed or replaced (its runtime directory cleaned up?): "
                          "engines attached keep their weights, but no new client can reach this daemon; restart "
                          "it (SIGTERM, then `preload serve`) to serve new ones", path)


def _file_id(path) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


class _Probes(http.server.BaseHTTPRequestHandler):
    """HTTP /health, /ready and /metrics of the daemon the HTTP server was given (_serve_http)."""

    timeout = PROBE_DEADLINE_S  # per read (and _ProbeServer cuts the whole connection at the same deadline)

    def do_GET(self):
        server = self.server.daemon_server
        path = urllib.parse.urlsplit(self.path).path  # (a scraper's ?query names the same endpoint)
        if path == "/health":
            self._reply(200, {"status": "alive", "device": server.config.device, "pid": os.getpid(),
                              "sessions": len(server.sessions), "recovery": server.store.recovery})
        elif path == "/ready":
            ready = server.ready()
            with server.store.lock:
                models = [{"name": m.name, "active_version": m.active,
                           "versions": [{"version": n, "state": v.state} for n, v in sorted(m.versions.items())]}
                          for m in server.store.models()]
            self._reply(200 if ready else 503, {"ready": ready, "device": server.config.device,
                                                "loading": server.store.is_loading(), "models": models})
        elif path == "/metrics":
            self._send(200, server.metrics.text(), CONTENT_TYPE_LATEST)
        else:
            self._reply(404, {"error": f"no such endpoint {path[:200]!r}; try /health, /ready or /metrics"})

    def _not_allowed(self):
        self._reply(405, {"error": f"{self.command} is not served here; GET /health, /ready or /metrics"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _not_allowed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a bad request line, HEAD, OPTIONS, an unknown method) as JSON
        too, not its HTML page."""
        self.close_connection = True
        if self.command == "HEAD" or code < 200 or code in (204, 304):  # answers without a body
            self.send_response(code)
            self.end_headers()
            return
        self._reply(code, {"error": f"{code} {message or self.responses.get(code, ('',))[0]}"})

    def _reply(self, code: int, body: dict) -> None:
        self._send(code, json.dumps(body).encode(), "application/json")

    def _send(self, code: int, data: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):
        log.debug("http: " + fmt, *args)


class _ProbeServer(http.server.ThreadingHTTPServer):
    """A thread per connection, at most MAX_PROBE_CONNECTIONS at once, each cut PROBE_DEADLINE_S after
    it was accepted. Unbounded, any local user's 400 idle connections made 400 threads (3 GB of address
    space), and a few hundred more failed with "can't start new thread". When every slot is taken, a
    new connection takes the slot of the oldest one: a probe is answered within milliseconds of its
    connect, so the oldest is one that sent nothing. (Refusing the new one instead let a local user who
    opened 32 connections every 2 s keep every probe from answering.)"""

    request_queue_size = 128  # (socketserver's 5 made a burst of connects wait out SYN retries, 1 s and more)

    def __init__(self, address, handler):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(MAX_PROBE_CONNECTIONS)
        self.accepted: dict[socket.socket, float] = {}
        self.cut: set[socket.socket] = set()
        threading.Thread(target=self._cut_slow, name="http-probes-deadline", daemon=True).start()

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            held = [(conn, since) for conn, since in list(self.accepted.items()) if conn not in self.cut]
            if held:  # (one cut already, whose thread is still at work, is not cut again)
                self._cut(min(held, key=lambda item: item[1])[0])
            if not self.slots.acquire(timeout=PROBE_EVICT_WAIT_S):  # its thread sees the end and leaves
                self.shutdown_request(request)
                return
        self.accepted[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.accepted.pop(request, None)
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.accepted.pop(request, None)
            self.cut.discard(request)
            self.slots.release()

    def _cut(self, conn: socket.socket) -> None:
        self.cut.add(conn)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _cut_slow(self) -> None:
        """Shuts down the connections past their deadline (their threads then see the end and finish)."""
        while True:
            time.sleep(PROBE_DEADLINE_S / 4)
            now = time.monotonic()
            for conn, since in list(self.accepted.items()):
                if now - since > PROBE_DEADLINE_S:
                    self._cut(conn)


def _bind_http(port: int) -> http.server.ThreadingHTTPServer:
    try:
        return _ProbeServer(("127.0.0.1", port), _Probes)
    except OSError as e:
        raise InvalidRequestError(f"--http-port {port}: cannot listen on 127.0.0.1:{port} ({e.strerror or e}); "
                                  "pick a free port, or 0 for any") from None


def _serve_http(probes: http.server.ThreadingHTTPServer, server: DaemonServer) -> None:
    probes.daemon_server = server
    threading.Thread(target=probes.serve_forever, name="http-probes", daemon=True).start()
