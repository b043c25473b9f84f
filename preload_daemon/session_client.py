"""The client side of a session (sessions.py has the protocol and the daemon's side): open one,
send a request on it and read the answer."""

import errno
import pathlib
import socket

from preload_daemon.errors import InvalidRequestError
from preload_daemon.runtime_dir import check_daemon_socket
from preload_daemon.sessions import ERROR, FRAME, MAX_LINE, MAX_REQUEST, MAX_RESPONSE


class SessionError(OSError):
    """The daemon refused a session, or did not answer."""


REFUSED = errno.EBUSY  # a SessionError's errno where a running daemon answered with a refusal (its reason)


def open_session(path: pathlib.Path, timeout: float = 5.0) -> tuple[socket.socket, str]:
    """Client side: connects to a daemon's session socket; returns the socket (keep it open for as
    long as the leases should live) and the token to name in Attach."""
    check_daemon_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        line = b""
        while not line.endswith(b"\n") and len(line) < MAX_LINE:
            chunk = sock.recv(MAX_LINE - len(line))
            if not chunk:
                break
            line += chunk
    except OSError as e:
        sock.close()
        raise SessionError(e.errno or 0, f"cannot open a session on {path}: {e.strerror or e}") from e
    status, _, rest = line.decode(errors="replace").strip().partition(" ")
    if status != "OK" or not rest:
        sock.close()
        code = errno.EACCES if "permission" in rest else REFUSED if rest else errno.ECONNREFUSED
        raise SessionError(code, rest or f"the daemon on {path} closed the session without an answer")
    return sock, rest


def request(sock: socket.socket, kind: int, payload: bytes, timeout: float) -> bytes:
    """Client side: sends one request frame on an open session and returns the answer's payload;
    raises SessionError if the daemon closed the session or did not answer within `timeout`, and
    SessionAnswerError (with the daemon's "ErrorClass: message") for an error answer. A payload
    over MAX_REQUEST is refused here with InvalidRequestError: the daemon would end the session."""
    if len(payload) > MAX_REQUEST:
        raise InvalidRequestError(f"the request is {len(payload)} bytes, over the session's limit of {MAX_REQUEST}; "
                                  "name fewer checkpoint files in it")
    sock.settimeout(timeout)
    try:
        sock.sendall(FRAME.pack(len(payload), kind) + payload)
        length, answer_kind = FRAME.unpack(_recv_exactly(sock, FRAME.size))
        if length > MAX_RESPONSE:
            raise SessionError(errno.EPROTO, f"the daemon answered with {length} bytes (at most {MAX_RESPONSE})")
        data = _recv_exactly(sock, length)
    except OSError as e:
        if isinstance(e, SessionError):
            raise
        raise SessionError(e.errno or errno.EPIPE, f"the session broke: {e.strerror or e}") from e
    if answer_kind == ERROR:
        raise SessionAnswerError(data.decode(errors="replace"))
    return data


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view, done = memoryview(out), 0
    while done < n:
        got = sock.recv_into(view[done:])
        if not got:
            raise SessionError(errno.EPIPE, "the daemon closed the session")
        done += got
    return bytes(out)


class SessionAnswerError(Exception):
    """The daemon answered a session request with an error ("ErrorClass: message")."""
