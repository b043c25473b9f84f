"""Sessions: who the daemon's callers are, and when they die, from the kernel; and the attach hot
path.

gRPC serves its own Unix socket, which the runtime directory's permissions (0700, socket 0600)
close to other users, but gRPC Python cannot say which process is on a connection. So a client
that wants leases first opens a session: a plain connection to the daemon's session socket. On
accept the daemon reads the caller's pid and uid with SO_PEERCRED and answers one line, `OK TOKEN`
(or `ERR REASON` and closes). The client keeps the connection open; when the process exits,
however it exits (SIGKILL, zombie, crash), the kernel closes the connection and the daemon drops
the session's leases at once. A client learns the same way that its daemon died.

Requests on the session (the daemon's `on_request`; today Attach) travel as frames: a 4-byte
big-endian payload length, one kind byte, the payload (a serialized protobuf message). The answer
is one frame of the same kind, or of kind `E` with "ErrorClass: message". An attach this way is
one round trip on a connection the client holds anyway, binds the lease to the connection's
process without a token, and needs no gRPC channel (nor the grpc import) in the engine. A client
sends one request at a time and reads its answer before the next.

One thread watches every session with a selector: no thread per connection. Requests run on a
small pool; while one runs, its connection is out of the selector. The pool thread sends what of
the answer the socket takes at once (all of it, but for the largest manifests) and hands the rest
to the selector thread, which sends it as the client reads: a client that stops reading (stopped
with SIGSTOP, frozen by its cgroup, stuck in a debugger) holds no pool thread, and its session ends
once its answer has waited SEND_TIMEOUT_S (or sooner, longest waiting first, when unread answers
hold over UNSENT_BUDGET). The number of sessions is capped, with a clear refusal. accept() errors
(EMFILE, say) are logged and retried with back-off, never fatal.
"""

import concurrent.futures
import dataclasses
import errno
import logging
import os
import pathlib
import queue
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from preload_daemon.errors import PreloadError, details
from preload_daemon.leases import process_start_time

log = logging.getLogger(__name__)
_CRED = struct.Struct("3i")
MAX_LINE = 512
BACKOFF_S = (0.05, 2.0)
FRAME = struct.Struct(">IB")  # payload length, kind
MAX_REQUEST = 1 << 20  # an AttachRequest names at most a few thousand files
MAX_RESPONSE = 1 << 30
SEND_TIMEOUT_S = 10.0
UNSENT_BUDGET = 256 << 20  # answers the selector thread holds for clients that have not read them
REQUEST_THREADS = 4
ERROR = ord("E")
ATTACH = ord("A")  # an AttachRequest; answered with an AttachResponse


@dataclasses.dataclass(frozen=True, slots=True)
class Session:
    token: str
    pid: int
    uid: int
    pid_start_time: float


class SessionServer:
    def __init__(self, path: pathlib.Path, on_close: Callable[[Session], None], max_sessions: int = 1024,
                 on_request: Callable[[Session, int, bytes], bytes] | None = None):
        """`on_request(session, kind, payload)` answers a request frame with its payload, or raises
        (a PreloadError's message is sent back; anything else is logged and reported as internal)."""
        self.path = path
        self.uid = os.getuid()
        self.max_sessions = max_sessions
        self._on_close = on_close
        self._on_request = on_request
        self._sessions: dict[str, Session] = {}
        self._sockets: dict[socket.socket, Session] = {}
        self._buffers: dict[socket.socket, bytearray] = {}
        self._answered: queue.SimpleQueue = queue.SimpleQueue()  # (conn, unsent bytes or None) from the pool
        self._sending: dict[socket.socket, list] = {}  # conn -> [unsent bytes, deadline], on the selector
        self._pool = concurrent.futures.ThreadPoolExecutor(REQUEST_THREADS, thread_name_prefix="session-request")
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self.refused = 0
        self.accept_errors = 0
        path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)  # born 0600: no window with wider permissions
        try:
            self._listener.bind(str(path))
        finally:
            os.umask(old_umask)
        self._listener.listen(512)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()  # its descriptor now, not when the thread gets to it
        self._thread = threading.Thread(target=self._loop, name="sessions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def get(self, token: str) -> Session | None:
        """The open session with this token (None once its connection closed)."""
        with self._lock:
            return self._sessions.get(token)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def close(self) -> None:
        self._closed.set()
        self._wake_w.send(b"x")
        if self._thread.is_alive():  # not started when the daemon failed to start
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._listener.close()
        self.path.unlink(missing_ok=True)
        for sock in list(self._sockets):
            sock.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the selector thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        selector = self._selector
        selector.register(self._listener, selectors.EVENT_READ, "accept")
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        backoff, paused_until = BACKOFF_S[0], 0.0
        while not self._closed.is_set():
            wake_at = min([d for _, d in self._sending.values()] + ([paused_until] if paused_until else []),
                          default=None)
            timeout = max(0.0, wake_at - time.monotonic()) if wake_at is not None else None
            for key, _ in selector.select(timeout):
                try:
                    backoff, paused_until = self._event(selector, key, backoff, paused_until)
                except Exception:  # never let one event end the only thread that ends leases
                    log.exception("session event on %s failed; going on", self.path)
            now = time.monotonic()
            if paused_until and now >= paused_until:
                paused_until = 0.0
                selector.register(self._listener, selectors.EVENT_READ, "accept")
            for conn in [c for c, (_, deadline) in self._sending.items() if deadline <= now]:
                try:
                    self._give_up_sending(selector, conn, f"it did not read its answer within {SEND_TIMEOUT_S:g} s")
                except Exception:
                    log.exception("ending a session on %s failed; going on", self.path)
        selector.close()

    def _event(self, selector, key, backoff: float, paused_until: float) -> tuple[float, float]:
        """Handles one ready descriptor; returns the accept back-off state."""
        if key.data == "accept":
            error = self._accept(selector)
            if error is None:
                return BACKOFF_S[0], paused_until
            self.accept_errors += 1
            log.warning("accept() on %s failed: %s; accepting again in %.2fs", self.path, error, backoff)
            selector.unregister(self._listener)
            return min(backoff * 2, BACKOFF_S[1]), time.monotonic() + backoff
        if key.data == "wake":
            self._wake_r.recv(64)
            self._take_back(selector)
        elif key.data == "send":
            self._send_more(selector, key.fileobj)
        else:
            self._read(selector, key.fileobj)
        return backoff, paused_until

    def _accept(self, selector) -> OSError | None:
        """Accepts what is waiting; returns an error that should pause accepting (out of file
        descriptors or memory), None otherwise."""
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as e:
                if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                return e
            try:
                self._open(selector, conn)
            except OSError as e:
                log.warning("dropping a session connection on %s: %s", self.path, e)
                conn.close()

    def _open(self, selector, conn: socket.socket) -> None:
        pid, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        conn.setblocking(False)
        refusal = ""
        if uid not in (self.uid, 0):
            refusal = f"permission denied: this daemon serves uid {self.uid}; run your own with `preload daemon`"
            log.warning("refused a session of uid %d (pid %d): only uid %d may use this daemon", uid, pid, self.uid)
        elif len(self) >= self.max_sessions:
            refusal = (f"too many sessions: this daemon holds {self.max_sessions} (its --max-sessions); close idle "
                       "clients or raise the cap")
            log.warning("refused a session of pid %d: %d sessions open (the cap)", pid, self.max_sessions)
        start = process_start_time(pid) if not refusal else -1.0
        if not refusal and start < 0:
            refusal = f"pid {pid} has exited"
        if refusal:
            self.refused += 1
            _send_line(conn, f"ERR {refusal}")
            conn.close()
            return
        session = Session(secrets.token_hex(16), pid, uid, start)
        selector.register(conn, selectors.EVENT_READ, "session")  # first: if it fails, nothing is half made
        with self._lock:
            self._sessions[session.token] = session
            self._sockets[conn] = session
        _send_line(conn, f"OK {session.token}")
        log.debug("session of pid %d opened", pid)

    def _read(self, selector, conn: socket.socket) -> None:
        """Request bytes are buffered until a frame is whole; EOF or an error ends the session."""
        try:
            data = conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            selector.unregister(conn)
            self._end(conn)
        elif self._on_request is not None:  # without a handler, what a client sends is discarded
            buffer = self._buffers.setdefault(conn, bytearray())
            buffer += data
            self._dispatch(selector, conn)

    def _dispatch(self, selector, conn: socket.socket) -> None:
        """Hands a whole frame in conn's buffer to the pool (taking conn out of the selector until
        it is answered); a frame over MAX_REQUEST ends the session."""
        buffer = self._buffers.get(conn)
        if buffer is None or len(buffer) < FRAME.size:
            return
        length, kind = FRAME.unpack_from(buffer)
        if length > MAX_REQUEST:
            session = self._sockets[conn]
            log.warning("ending the session of pid %d: it sent a %d-byte request (at most %d)", session.pid,
                        length, MAX_REQUEST)
            error = f"InvalidRequestError: a {length}-byte request is over the limit of {MAX_REQUEST}".encode()
            _send_some(conn, memoryview(FRAME.pack(len(error), ERROR) + error))  # what the socket takes
            selector.unregister(conn)
            self._end(conn)
            return
        if len(buffer) < FRAME.size + length:
            return
        payload = bytes(buffer[FRAME.size:FRAME.size + length])
        del buffer[:FRAME.size + length]
        selector.unregister(conn)
        self._pool.submit(self._answer, conn, self._sockets[conn], kind, payload)

    def _answer(self, conn: socket.socket, session: Session, kind: int, payload: bytes) -> None:
        """On a pool thread: runs the request and sends its answer, then hands conn back."""
        try:
            out_kind, out = kind, self._on_request(session, kind, payload)
        except Exception as e:
            if not isinstance(e, PreloadError):
                log.exception("session request %r of pid %d failed", chr(kind), session.pid)
            out_kind, out = ERROR, (details(e) if isinstance(e, PreloadError) else
                                    "PreloadError: internal error; see the daemon log").encode()
        self._answered.put((conn, _send_some(conn, memoryview(FRAME.pack(len(out), out_kind) + out))))
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _take_back(self, selector) -> None:
        """Conns whose request was answered: back into the selector to read the next request, or to
        send the rest of the answer; ended if sending failed."""
        while True:
            try:
                conn, unsent = self._answered.get_nowait()
            except queue.Empty:
                return
            if conn not in self._sockets:
                continue
            try:
                if unsent is None:
                    self._end(conn)
                elif unsent:
                    self._sending[conn] = [unsent, time.monotonic() + SEND_TIMEOUT_S]
                    selector.register(conn, selectors.EVENT_WRITE, "send")
                    self._within_budget(selector)
                else:
                    selector.register(conn, selectors.EVENT_READ, "session")
                    self._dispatch(selector, conn)  # a frame that came in meanwhile
            except Exception:  # a session this thread does not watch would outlive its client unseen
                log.exception("taking back a session on %s failed; ending it", self.path)
                self._discard(selector, conn)

    def _within_budget(self, selector) -> None:
        """Unread answers held past UNSENT_BUDGET end the sessions that have held theirs longest. An
        answer holds its whole frame until it is sent (what is left is a view of it)."""
        unsent = sum(len(data.obj) for data, _ in self._sending.values())
        for conn in sorted(self._sending, key=lambda c: self._sending[c][1])[:-1]:
            if unsent <= UNSENT_BUDGET:
                return
            unsent -= len(self._sending[conn][0].obj)
            self._give_up_sending(selector, conn, f"unread answers held over {UNSENT_BUDGET >> 20} MiB of the "
                                                  "daemon's memory, and its answer had waited longest")

    def _send_more(self, selector, conn: socket.socket) -> None:
        """The client read some of its answer: sends what the socket takes now."""
        pending = self._sending[conn]
        pending[0] = _send_some(conn, pending[0])
        if pending[0] is None:
            self._give_up_sending(selector, conn, "its connection failed while it was sent an answer")
        elif not pending[0]:
            del self._sending[conn]
            selector.modify(conn, selectors.EVENT_READ, "session")
            self._dispatch(selector, conn)

    def _give_up_sending(self, selector, conn: socket.socket, why: str) -> None:
        """An answer the client did not read in time, or that could not be sent, ends the session."""
        log.warning("ending the session of pid %d: %s", self._sockets[conn].pid, why)
        self._discard(selector, conn)

    def _discard(self, selector, conn: socket.socket) -> None:
        """Ends a session whatever state it is in."""
        self._sending.pop(conn, None)
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        if conn in self._sockets:
            self._end(conn)

    def _end(self, conn: socket.socket) -> None:
        """Closes a session's connection (out of the selector already) and ends its leases."""
        conn.close()
        self._buffers.pop(conn, None)
        with self._lock:
            session = self._sockets.pop(conn)
            self._sessions.pop(session.token, None)
        log.debug("session of pid %d closed", session.pid)
        try:
            self._on_close(session)
        except Exception:
            log.exception("releasing the leases of pid %d failed", session.pid)


def _send_some(conn: socket.socket, data: memoryview) -> memoryview | None:
    """Sends what a non-blocking socket takes now; returns the rest (empty once all is sent), or
    None if the connection failed."""
    while data:
        try:
            data = data[conn.send(data):]
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            return None
    return data


def _send_line(conn: socket.socket, line: str) -> None:
    try:
        conn.send((line[:MAX_LINE - 1] + "\n").encode())  # a fresh socket's buffer takes one short line
    except OSError:
        pass


def session_path(socket_path: pathlib.Path) -> pathlib.Path:
    """The session socket beside a daemon's gRPC socket."""
    return socket_path.with_name(socket_path.name.replace("daemon-", "session-", 1))
