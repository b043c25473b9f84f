"""The snapshot control channel between `preload snapshot` and an engine: JSON messages, one per
line, over a Unix socket in the runtime directory, with file descriptors (the engine's standard
streams) passed alongside. Shared by both ends; imports nothing heavy.

The wrapper listens and the engine connects: the socket lives in `<runtime>/snapshots/`, a 0700
directory of the engine's own user, and each end checks the other's uid from the kernel
(SO_PEERCRED), so only the engine's own user (or root) can steer it.
"""

import array
import json
import os
import pathlib
import secrets
import select
import socket
import struct

from preload_daemon.runtime_dir import ensure_private_dir

MAX_MESSAGE = 1 << 20
MAX_FDS = 3
_CRED = struct.Struct("3i")


class ControlError(OSError):
    """The other end broke the protocol, went away, or is not who it should be."""


class NoConnection(ControlError):
    """Nobody connected to the control socket in time."""


def control_dir(runtime_dir: pathlib.Path) -> pathlib.Path:
    return ensure_private_dir(pathlib.Path(runtime_dir) / "snapshots")


def listen(runtime_dir: pathlib.Path) -> tuple[socket.socket, pathlib.Path]:
    """A listening socket at a fresh, unguessable path in the control directory."""
    path = control_dir(runtime_dir) / f"{secrets.token_hex(8)}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as e:
        sock.close()
        hint = "; a Unix socket's path holds at most 107 bytes: use a shorter runtime directory" \
            if len(os.fsencode(path)) > 107 else ""
        raise ControlError(f"cannot listen at {path} ({e.strerror or e}){hint}") from None
    finally:
        os.umask(old)
    sock.listen(1)
    return sock, path


def accept(server: socket.socket, timeout: float, expect_pid: int | None = None) -> socket.socket:
    """The engine's connection, once it comes: from our own user (or root), and from `expect_pid`
    when given (the process we woke, as this host's kernel numbers it)."""
    server.settimeout(timeout)
    try:
        conn, _ = server.accept()
    except TimeoutError:
        raise NoConnection(f"the engine did not connect within {timeout:g}s") from None
    pid, uid, _ = peer(conn)
    if uid not in (os.getuid(), 0) or (expect_pid is not None and pid != expect_pid):
        conn.close()
        raise ControlError(f"an unexpected process (pid {pid}, uid {uid}) connected to the control socket")
    return conn


def connect(path: str, runtime_dir: pathlib.Path, timeout: float = 10.0) -> socket.socket:
    """The engine's end: `path` must be a socket directly in this runtime's control directory, and
    the listener must be our own user (or root)."""
    path = pathlib.Path(path)
    if path.parent != control_dir(runtime_dir) or not path.name.endswith(".sock") or "/" in path.name:
        raise ControlError(f"control socket {str(path)!r} is not in {control_dir(runtime_dir)}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        _, uid, _ = peer(sock)
        if uid not in (os.getuid(), 0):
            raise ControlError(f"the control socket {path} belongs to uid {uid}")
    except BaseException:
        sock.close()
        raise
    return sock


def peer(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the other end, from the kernel."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if len(data) > MAX_MESSAGE:
        raise ControlError(f"control message of {len(data)} bytes is over the {MAX_MESSAGE}-byte limit")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive(sock: socket.socket, timeout: float) -> tuple[dict, list[int]]:
    """One message and the descriptors that came with it. Descriptors beyond MAX_FDS are closed."""
    sock.settimeout(timeout)
    data, fds = b"", []
    try:
        while not data.endswith(b"\n"):
            chunk, ancdata, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(MAX_FDS * 4))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[:len(payload) - len(payload) % 4]))
            if not chunk:
                raise ControlError("the other end closed the control connection")
            data += chunk
            if len(data) > MAX_MESSAGE:
                raise ControlError(f"control message over the {MAX_MESSAGE}-byte limit")
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ControlError("a control message must be a JSON object")
    except TimeoutError:
        _close(fds)
        raise ControlError(f"no answer on the control connection within {timeout:g}s") from None
    except ControlError:  # said precisely above: a closed connection, an oversized message
        _close(fds)
        raise
    except ValueError:
        _close(fds)
        raise ControlError(f"a malformed control message: {data[:200]!r}") from None
    if len(fds) > MAX_FDS:
        _close(fds[MAX_FDS:])
        fds = fds[:MAX_FDS]
    return message, fds


def wait_closed(sock: socket.socket, timeout: float) -> None:
    """Returns once the other end has closed the connection (it is done with it); anything it
    still sends is dropped."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        raise ControlError(f"the other end did not close the control connection within {timeout:g}s") from None


def wait_readable(fd: int, timeout: float | None) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
