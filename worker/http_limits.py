"""The HTTP connections of an engine and of the DP router, bounded: uvicorn keeps a connection that
never sends a request open for good, so 20,000 idle ones exhausted an engine's file descriptors
(its /health failed, and its log filled with a traceback per refused accept). Here a connection
past MAX_CONNECTIONS is closed at once, and one whose request head has not arrived HEAD_TIMEOUT_S
after it began is closed then (uvicorn's own keep-alive timer covers the wait between requests;
h11 bounds the head's size)."""

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 1024
HEAD_TIMEOUT_S = 30.0


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a cap on open connections and a deadline on each request head:
    pass it as uvicorn.Config(http=BoundedH11)."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > MAX_CONNECTIONS:
            self.transport.close()
            return
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not waiting and self._head_timer is not None:  # the head is in: the request is the app's now
            self._head_timer.cancel()
            self._head_timer = None
        elif waiting and self._head_timer is None:  # the next request's head began
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE:
            self.transport.close()
