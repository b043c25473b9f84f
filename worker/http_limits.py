"""The HTTP connections of an engine and of the DP router, bounded: uvicorn keeps a connection that
never sends a request open for good, so 20,000 idle ones exhausted an engine's file descriptors
(its /health failed, and its log filled with a traceback per refused accept). Here a connection
past MAX_CONNECTIONS is answered 503 and closed at once, and one whose request (head and body) has
not arrived REQUEST_TIMEOUT_S after it began is closed then (uvicorn's own keep-alive timer covers
the wait between requests; h11 bounds the head's size, BodyBudget the body's). Bodies are bounded
each (MAX_BODY_BYTES: 413) and all together (BODY_BUDGET_BYTES: 503, retry), since every
connection may be sending one: 1,024 bodies of 64 MiB would be 64 GiB. Both servers' errors are
JSON in OpenAI's shape, as their clients read them (error), Starlette's own too (an unknown path, a
wrong method: json_errors)."""

import asyncio

import h11
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 1024
REQUEST_TIMEOUT_S = 30.0
MAX_BODY_BYTES = 64 << 20
"""Largest request body read (a prompt is at most 8 Mi characters: up to 32 MiB of UTF-8, more with
JSON's escapes)."""
BODY_BUDGET_BYTES = 256 << 20
"""Request bodies held at once, all requests together."""
DRAIN_BYTES = 256 << 20
"""What is read and discarded of a refused body before the connection is closed on the rest."""


def error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    """An error answer in OpenAI's JSON shape, which the engine's and the router's clients read."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers)


def json_errors(routes: list, server: str):
    """Starlette's exception handler for its own HTTP errors (HTTPException: 404 for a path none of
    `routes` serves, 405 for a method, with its Allow header), in OpenAI's JSON error shape."""

    async def handler(request, e):
        if e.status_code == 404:
            message = f"no such path {request.url.path!r}; this {server} serves {', '.join(r.path for r in routes)}"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(e.detail)
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(e.status_code, message, kind, e.headers)

    return handler


class BodyRefused(Exception):
    """A request body not read: too large (413), or too many bytes of bodies held already (503)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _too_large() -> BodyRefused:
    return BodyRefused(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB; send a shorter prompt")


class BodyBudget:
    """The bytes of request bodies held in memory at once, all requests together (one event loop:
    no lock). read() counts a body against it until release(len(body))."""

    def __init__(self, limit: int = BODY_BUDGET_BYTES):
        self.limit, self.held = limit, 0

    async def read(self, request) -> bytes:
        """A starlette request's whole body, counted as it arrives: BodyRefused past MAX_BODY_BYTES
        (413) or past the budget (503). A refused body's bytes are dropped and the rest of it read
        and discarded (at most DRAIN_BYTES), so that the client, still sending, gets the answer and
        not a reset connection. A body whose Content-Length is past what that can take is refused
        before a byte of it is read (a client that sent none of it waited out the request's deadline)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 18 or int(declared) > MAX_BODY_BYTES + DRAIN_BYTES):
            raise _too_large()
        chunks, size, refused, drained = [], 0, None, 0
        try:
            async for chunk in request.stream():
                if refused is not None:
                    drained += len(chunk)
                    if drained > DRAIN_BYTES:
                        break
                    continue
                chunks.append(chunk)
                size += len(chunk)
                self.held += len(chunk)
                if size > MAX_BODY_BYTES:
                    refused = _too_large()
                elif self.held > self.limit:
                    refused = BodyRefused(503, f"the server holds {self.limit >> 20} MiB of request bodies "
                                               "already; retry shortly")
                if refused is not None:
                    chunks.clear()
                    self.held -= size
                    size = 0
            if refused is not None:
                raise refused
            return b"".join(chunks)
        except ClientDisconnect:  # gone mid-body (or closed at the deadline): no one to answer, nothing to log
            self.held -= size
            raise BodyRefused(400, "the client closed the connection before its request body was whole") from None
        except BaseException:
            self.held -= size
            raise

    def release(self, nbytes: int) -> None:
        self.held -= nbytes


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a cap on open connections and a deadline on each request's
    arrival: pass it as uvicorn.Config(http=BoundedH11)."""

    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > MAX_CONNECTIONS:
            self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.transport.close()
            return
        self._timer = self.loop.call_later(REQUEST_TIMEOUT_S, self._timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        arriving = self._arriving() and not self.transport.is_closing()
        if not arriving and self._timer is not None:  # the request is in: the app's now
            self._timer.cancel()
            self._timer = None
        elif arriving and self._timer is None:  # the next request began
            self._timer = self.loop.call_later(REQUEST_TIMEOUT_S, self._timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def _arriving(self) -> bool:
        """The client has not sent all of a request: its head, or its body."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _timeout(self) -> None:
        self._timer = None
        if self._arriving():
            self.transport.close()
