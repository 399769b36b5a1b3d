"""Slow clients are timed out: a request's head and its body must arrive.

uvicorn closes a kept-alive connection that stays idle, but it waits for a
request's head forever: a client sending a byte of headers every few
seconds (slowloris), or opening a connection and sending nothing, holds a
socket and its buffers for as long as it likes. `guarded_protocol` makes
uvicorn's httptools protocol (its request parser costs the edge a third of
h11's CPU per request) close a connection whose request head has not
arrived within `header_timeout_s` of its first byte (of the connection's
opening, for the first request), answering 408 when part of a head came.

The body is watched where it is read, in the app (`BodyDeadline`): a body
that stalls between chunks for `body_timeout_s`, or takes longer in all than
`body_timeout_s` plus a second per `body_min_bytes_per_s` bytes received, is
answered 408 and the connection closed (`RequestTimeout`).

A slow reader is the other kind of slow client: the protocol offers each GET
request's response body as a `DirectBody` (ASGI scope extension
`DIRECT_BODY`), which the SSE fan-out writes live frames to without a task
per client; it refuses to write once the connection's send buffer is full,
and the stream's own task, which waits for the buffer to drain, takes over.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from edge.errors import RequestTimeout
from edge.limits import ClientLimits
from edge.security_headers import security_headers

# The ASGI scope extension offering a GET request's response body as a
# `DirectBody`: {"sink": DirectBody}.
DIRECT_BODY = "keel.direct_body"


def guarded_protocol(limits: ClientLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline for every request's head."""

    class Guarded(HeadDeadlineProtocol):
        header_timeout_s = limits.header_timeout_s

    return Guarded


class HeadDeadlineProtocol(HttpToolsProtocol):
    """The timer runs from the first byte of a head (the opening, for a new
    connection) until the parser has the whole head. Between requests
    uvicorn's keep-alive timeout closes an idle connection."""

    header_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0  # of the head being waited for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            # The first bytes after an answer: the next head (or the rest of
            # a body the app did not read, which gets no more time either).
            self._arm_head_timer()
        self._head_bytes += len(data)
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._stop_head_timer()  # a request started: its head is complete
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not before and cycle.scope["method"] == "GET":
            extensions = cycle.scope.setdefault("extensions", {})
            extensions[DIRECT_BODY] = {"sink": DirectBody(cycle)}

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a malformed request, with the headers of every answer.
        head = [
            b"HTTP/1.1 400 Bad Request",
            b"content-type: text/plain; charset=utf-8",
            b"content-length: " + str(len(msg)).encode(),
            b"connection: close",
            *(name + b": " + value for name, value in security_headers("")),
        ]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + msg.encode("ascii"))
        self.transport.close()

    def _arm_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_bytes:
            # Part of a head came: say why the connection closes.
            self.transport.write(timeout_answer(self.header_timeout_s))
        self.transport.close()


class DirectBody:
    """A response body written to the connection at once, without the ASGI
    send chain (its middlewares only ever look at a response's start).

    Only once the response has started (its headers went through the app's
    send), and never to a connection that is closing or whose send buffer is
    full: then `write` returns False and the response's own task, whose send
    waits for the buffer to drain, writes instead. The body is framed as
    uvicorn frames it, in chunks; a response with a Content-Length (never an
    event stream) is left to its own task.
    """

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def write(self, data: bytes) -> bool:
        cycle = self._cycle
        if (
            not cycle.response_started
            or not cycle.chunked_encoding
            or cycle.response_complete
            or cycle.disconnected
            or cycle.flow.write_paused
            or cycle.transport.is_closing()
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True


def timeout_answer(header_timeout_s: float) -> bytes:
    """The 408 of a head that did not arrive in time."""
    body = json.dumps(
        {
            "error": {
                "code": "request_timeout",
                "message": f"the request's headers did not arrive within {header_timeout_s:g} s",
            }
        }
    ).encode()
    head = [
        b"HTTP/1.1 408 Request Timeout",
        b"content-type: application/json",
        b"content-length: " + str(len(body)).encode(),
        b"connection: close",
        *(name + b": " + value for name, value in security_headers("")),
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class BodyDeadline:
    """Times the reading of each request's body (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: ClientLimits) -> None:
        self.app = app
        self.stall_s = limits.body_timeout_s
        self.min_rate = limits.body_min_bytes_per_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _TimedBody(receive, self.stall_s, self.min_rate)

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                body.answered = True
            await send(message)

        await self.app(scope, body.receive, noting_send)


class _TimedBody:
    __slots__ = (
        "_done",
        "_min_rate",
        "_receive",
        "_received",
        "_stall_s",
        "_started",
        "answered",
    )

    def __init__(self, receive: Receive, stall_s: float, min_rate: int) -> None:
        self._receive = receive
        self._stall_s = stall_s
        self._min_rate = min_rate
        self._started = 0.0
        self._received = 0
        self._done = False
        # The answer has started: a stalled body can no longer be a 408.
        self.answered = False

    async def receive(self) -> Message:
        if self._done:
            # The body is in: what is left is waiting for a disconnect (an
            # SSE stream listens for one for hours).
            return await self._receive()
        now = time.monotonic()
        if not self._started:
            self._started = now  # from when the app starts reading
        deadline = self._started + self._stall_s + self._received / self._min_rate
        wait = min(self._stall_s, deadline - now)
        try:
            if wait <= 0:
                raise TimeoutError
            async with asyncio.timeout(wait):
                message = await self._receive()
        except TimeoutError:
            if self.answered:
                # E.g. an SSE stream's disconnect listener reading a body the
                # route never wanted: the client is treated as gone.
                self._done = True
                return {"type": "http.disconnect"}
            raise RequestTimeout(
                f"the request body stopped arriving (more than {self._stall_s:g} s without "
                f"data, or slower than {self._min_rate} bytes/s); the connection is closed"
            ) from None
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            self._done = not message.get("more_body", False)
        else:
            self._done = True
        return message
