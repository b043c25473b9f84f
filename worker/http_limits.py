"""The HTTP connections of an engine and of the DP router, bounded: uvicorn keeps a connection that
never sends a request open for good, so 20,000 idle ones exhausted an engine's file descriptors
(its /health failed, and its log filled with a traceback per refused accept). Here a connection
past MAX_CONNECTIONS is answered 503 and closed at once, and one whose request (head and body) has
not arrived REQUEST_TIMEOUT_S after it began is closed then (uvicorn's own keep-alive timer covers
the wait between requests; h11 bounds the head's size, the server the body's)."""

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 1024
REQUEST_TIMEOUT_S = 30.0


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
