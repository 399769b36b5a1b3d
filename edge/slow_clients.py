"""Slow clients are timed out: a request's head and its body must arrive.

uvicorn closes a kept-alive connection that stays idle, but it waits for a
request's head forever: a client sending a byte of headers every few
seconds (slowloris), or opening a connection and sending nothing, holds a
socket and its buffers for as long as it likes. `guarded_protocol` makes
uvicorn's httptools protocol (its request parser costs the edge a third of
h11's CPU per request) close a connection whose request head has not
arrived within `header_timeout_s` of its first byte (of the connection's
opening, for the first request), answering 408 when part of a head came.
It also counts the head while it arrives: one larger than `max_head_bytes`
or with more than `max_headers` lines is answered 431 and its connection
closed as soon as it passes the limit, complete or not (without a limit,
each connection could make the edge buffer megabytes of unfinished headers).

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
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from edge.errors import RequestTimeout
from edge.limits import DEFAULT_MAX_HEAD_BYTES, ClientLimits
from edge.security_headers import security_headers

# The ASGI scope extension offering a GET request's response body as a
# `DirectBody`: {"sink": DirectBody}.
DIRECT_BODY = "keel.direct_body"


def guarded_protocol(limits: ClientLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline and a size limit for
    every request's head."""

    class Guarded(GuardedHeadProtocol):
        header_timeout_s = limits.header_timeout_s
        max_head_bytes = limits.max_head_bytes
        max_headers = limits.max_headers

    return Guarded


class GuardedHeadProtocol(HttpToolsProtocol):
    """The timer runs from the first byte of a head (the opening, for a new
    connection) until the parser has the whole head. Between requests
    uvicorn's keep-alive timeout closes an idle connection.

    The head's size is counted while it arrives, so a head that never ends
    is cut off as soon as it passes `max_head_bytes` (or `max_headers`
    lines), not buffered until it is whole: httptools hands a header over
    only once its line is complete, and keeps what came of it until then.
    What the parser handed over (the URL, whole header lines) is counted in
    its callbacks, exactly; while a head is still incomplete at the end of a
    read, every byte of that read was head, so later reads count whole. The
    count never exceeds the head's real size, so a head within the limit is
    never refused; one past it is refused within one read (at most 256 KiB).

    A refused head is answered 431 and the edge stops sending; what the
    client still sends is read and dropped (for at most `header_timeout_s`,
    or until it closes its side) rather than left unread, which would make
    the kernel reset the connection and could lose the answer."""

    header_timeout_s = 10.0
    max_head_bytes = DEFAULT_MAX_HEAD_BYTES
    max_headers = 100
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0  # received since the head timer started
    # The head being parsed: between its first byte and its last.
    _in_head = False
    _heads_begun = 0
    _head_parsed = 0  # what the parser handed over of it: URL, header lines
    _head_counted = 0  # its size as counted at the end of each read
    _header_lines = 0
    # Set once a head was refused: the rest of the connection is dropped.
    _refused: str | None = None
    _linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return  # what is left of a refused head: dropped
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            # The first bytes after an answer: the next head (or the rest of
            # a body the app did not read, which gets no more time either).
            self._arm_head_timer()
        self._head_bytes += len(data)
        was_in_head, heads_begun = self._in_head, self._heads_begun
        super().data_received(data)
        if self._refused is None and self._in_head:
            if was_in_head and heads_begun == self._heads_begun:
                self._head_counted += len(data)  # the whole read was this head
            else:
                self._head_counted = self._head_parsed  # it began in this read
            if self._head_counted > self.max_head_bytes:
                self._refuse(f"the request's head is larger than {self.max_head_bytes} bytes")
        if self._refused is not None and self._linger is None:
            self._answer_refusal()

    # Parser callbacks: a refused head is no longer collected.

    def on_message_begin(self) -> None:
        if self._refused is not None:
            return
        self._in_head = True
        self._heads_begun += 1
        # The request line's method, version and line ends.
        self._head_parsed = len("GET  HTTP/1.1\r\n")
        self._header_lines = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._refused is not None:
            return
        self._head_parsed += len(url)
        if self._head_parsed > self.max_head_bytes:
            self._refuse(f"the request's URL is longer than {self.max_head_bytes} bytes")
            return
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused is not None:
            return
        self._head_parsed += len(name) + len(value) + 4  # ": " and CRLF
        self._header_lines += 1
        if self._header_lines > self.max_headers:
            self._refuse(f"the request has more than {self.max_headers} header lines")
        elif self._head_parsed > self.max_head_bytes:
            self._refuse(f"the request's head is larger than {self.max_head_bytes} bytes")
        else:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._refused is not None:
            return  # no request starts
        self._stop_head_timer()  # a request started: its head is complete
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not before and cycle.scope["method"] == "GET":
            extensions = cycle.scope.setdefault("extensions", {})
            extensions[DIRECT_BODY] = {"sink": DirectBody(cycle)}

    def on_body(self, body: bytes) -> None:
        if self._refused is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused is None:
            super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self._refused is not None:
            # Malformed after it was refused (the parser read on): still a 431.
            self._answer_refusal()
            return
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

    def _refuse(self, message: str) -> None:
        """Marks the head refused; answered once the parser has returned."""
        self._refused = message

    def _answer_refusal(self) -> None:
        self._stop_head_timer()
        transport = self.transport
        if self._linger is not None or transport.is_closing():
            return  # answered already
        transport.write(closing_answer(431, "request_header_fields_too_large", self._refused or ""))
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        # Until the client closes its side (uvicorn's eof_received lets the
        # transport close), or this long at most.
        self._linger = self.loop.call_later(self.header_timeout_s, transport.close)

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
    return closing_answer(
        408,
        "request_timeout",
        f"the request's headers did not arrive within {header_timeout_s:g} s",
    )


def closing_answer(status: int, code: str, message: str) -> bytes:
    """A JSON refusal written straight to the connection, which then closes."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode(),
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
