"""The daemon's public Unix socket. gRPC Python cannot tell who is on the other end of a Unix
connection, so the daemon accepts connections itself, reads the peer's pid and uid with
SO_PEERCRED, and relays the bytes to the gRPC server's internal socket from a client socket bound to
an abstract name that identifies the connection. The servicer looks that name up in `peers`:
leases are bound to the kernel's word for the pid, not the client's."""

import dataclasses
import logging
import os
import pathlib
import secrets
import socket
import struct
import threading

log = logging.getLogger(__name__)
_CRED = struct.Struct("3i")


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int


class PeerCredRelay:
    def __init__(self, public_path: pathlib.Path, internal_path: pathlib.Path):
        self.public_path = public_path
        self.internal_path = internal_path
        self._tag = secrets.token_hex(6)
        self._seq = 0
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        public_path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600, no window with wider permissions
        try:
            self._listener.bind(str(public_path))
        finally:
            os.umask(old_umask)
        self._listener.listen(128)
        self._thread = threading.Thread(target=self._accept_loop, name="peercred-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def peer(self, grpc_peer: str) -> Peer | None:
        """The peer behind a gRPC context.peer() string, if it came through this relay."""
        with self._lock:
            return self._peers.get(grpc_peer.removeprefix("unix-abstract:"))

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self.public_path.unlink(missing_ok=True)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            try:
                self._relay(conn)
            except OSError as e:
                log.warning("dropping a connection on %s: %s", self.public_path, e)
                conn.close()

    def _relay(self, conn: socket.socket) -> None:
        pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        with self._lock:
            self._seq += 1
            name = f"preload-{self._tag}-{self._seq}"
            self._peers[name] = Peer(pid, uid, gid)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.bind("\0" + name)
            upstream.connect(str(self.internal_path))
        except OSError:
            upstream.close()
            self._forget(name)
            raise
        done = threading.Barrier(2, action=lambda: self._finish(name, conn, upstream))
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pump, args=(src, dst, done), name=f"relay-{self._seq}", daemon=True).start()

    def _finish(self, name: str, conn: socket.socket, upstream: socket.socket) -> None:
        conn.close()
        upstream.close()
        self._forget(name)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._peers.pop(name, None)


PUMP_BYTES = 256 << 10


def _pump(src: socket.socket, dst: socket.socket, done: threading.Barrier) -> None:
    buffer = bytearray(PUMP_BYTES)  # one buffer per direction, reused: no allocation per read
    view = memoryview(buffer)
    try:
        while n := src.recv_into(buffer):
            dst.sendall(view[:n])
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            done.wait()
        except threading.BrokenBarrierError:
            pass
