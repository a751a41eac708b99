"""What ``hf-alibi serve`` bounds below the ASGI app, on each connection of transformers' uvicorn server: a serving
shim (uvicorn 0.3x-0.5x's h11 protocol; checked on 0.54), installed by :func:`bound_connections` before transformers
builds its ``uvicorn.Config``.

- a connection that sends nothing is closed after ``idle_timeout`` seconds, before its first request as between
  requests (uvicorn arms its keep-alive timer only after a response);
- a request's headers must arrive within ``read_timeout`` seconds of its first byte, or the server answers 408 in
  OpenAI's shape and closes the connection (uvicorn waits for them forever);
- a connection the app closes while its client is still sending a body (a 413 answered from the Content-Length) is
  half-closed: the answer and an end of stream go out, what the client still sends is read and dropped, unparsed
  and unstored, for at most :data:`LINGER_SECONDS`, then the socket closes. Closed at once, the unread bytes make
  the kernel reset the connection, and the client, still writing, never reads the 413.

The body's own bound and timeout are the app's (:class:`hf_alibi.serve.guard.RequestGuard`), where the request is
known.
"""

from __future__ import annotations

import json

from .request_checks import Limits, openai_error

LINGER_SECONDS = 2.0


def late_headers_answer(read_timeout: float) -> bytes:
    """The raw 408 answer to a request whose headers did not arrive in time (no request exists yet to answer)."""
    body = json.dumps(
        openai_error(
            f"the request's headers did not arrive within {read_timeout:g} s (--read-timeout)",
            408,
            code="request_timeout",
        )  # fmt: skip
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def bounded_protocol(limits: Limits) -> type:
    """uvicorn's h11 protocol with the idle and header timeouts and the lingering close of this module."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            self._headers_timer = None
            self._discarding = False
            super().connection_made(_LingeringTransport(transport, self))
            idle = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
            self.timeout_keep_alive_task = idle  # uvicorn's own timer, armed before any request

        def data_received(self, data: bytes) -> None:
            if self._discarding:  # lingering: read and dropped
                return
            if self._headers_timer is None and self.conn.their_state is h11.IDLE:
                self._headers_timer = self.loop.call_later(limits.read_timeout, self._headers_late)
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._cancel_headers_timer()

        def _cancel_headers_timer(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_late(self) -> None:
            self._headers_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(late_headers_answer(limits.read_timeout))
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._cancel_headers_timer()
            super().connection_lost(exc)

    return BoundedH11Protocol


class _LingeringTransport:
    """The connection's transport, whose ``close()`` lingers while the client is still sending a request body."""

    def __init__(self, transport, protocol):
        self._transport, self._protocol, self._closing = transport, protocol, False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        import h11

        if self._protocol.conn.their_state is not h11.SEND_BODY or not self._transport.can_write_eof():
            self._transport.close()
            return
        try:
            self._transport.write_eof()  # after the answer: the client reads it, then the end of the stream
        except OSError:  # the client has gone already
            self._transport.close()
            return
        self._protocol._discarding = True
        self._transport.resume_reading()
        self._protocol.loop.call_later(LINGER_SECONDS, self._transport.close)


def bound_connections(limits: Limits) -> None:
    """Every ``uvicorn.Config`` made in this process from now on (transformers' server makes one) uses
    :func:`bounded_protocol` and keeps idle connections ``limits.idle_timeout`` seconds."""
    import uvicorn

    original = getattr(uvicorn.Config, "_hf_alibi_original", uvicorn.Config)

    class BoundedConfig(original):
        _hf_alibi_original = original

        def __init__(self, app, *args, **kwargs):
            kwargs.setdefault("http", bounded_protocol(limits))
            kwargs.setdefault("timeout_keep_alive", limits.idle_timeout)
            super().__init__(app, *args, **kwargs)

    uvicorn.Config = BoundedConfig
