"""A limit on the wait for a request's head, which uvicorn lacks (tandem serve's, given to
uvicorn as its HTTP protocol)."""

from __future__ import annotations


def guarded_h11(header_timeout_s: float):
    """uvicorn's h11 protocol, plus a limit on the wait for a request's headers. uvicorn's own
    timeout_keep_alive only runs between requests, and is disarmed by any byte received: a
    client that opens connections and sends nothing, or one header byte every few seconds,
    held each one forever (slowloris). The timer runs from the connection's start, and again
    from each answer, until h11 has read a whole request head; the body has its own limit
    (ServeConfig.body_timeout_s, in read_body)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from server.common import log

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer = None
            self._arm()

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
                self._disarm()  # the request line and headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._disarm()
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closed a connection that sent no request head within %g s", header_timeout_s)
                self.transport.close()

    return GuardedH11Protocol
