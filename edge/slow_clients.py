"""Slow clients are timed out: a request's head and its body must arrive.

uvicorn closes a kept-alive connection that stays idle, but it waits for a
request's head forever: a client sending a byte of headers every few
seconds (slowloris), or opening a connection and sending nothing, holds a
socket and its buffers for as long as it likes. `guarded_protocol` makes
uvicorn's h11 protocol close a connection whose request head has not
arrived within `header_timeout_s` of its first byte (of the connection's
opening, for the first request), answering 408 when part of a head came.

The body is watched where it is read, in the app (`BodyDeadline`): a body
that stalls between chunks for `body_timeout_s`, or takes longer in all than
`body_timeout_s` plus a second per `body_min_bytes_per_s` bytes received, is
answered 408 and the connection closed (`RequestTimeout`).
"""

from __future__ import annotations

import asyncio
import json
import time

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from edge.errors import RequestTimeout
from edge.limits import ClientLimits
from edge.security_headers import security_headers


def guarded_protocol(limits: ClientLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for every request's head."""

    class Guarded(HeadDeadlineProtocol):
        header_timeout_s = limits.header_timeout_s

    return Guarded


class HeadDeadlineProtocol(H11Protocol):
    header_timeout_s = 10.0

    # The timer runs from the first byte of a head (the opening, for a new
    # connection) until the request it starts exists (`self.cycle` changes).
    # Between requests uvicorn's keep-alive timeout closes an idle connection.
    _head_timer: asyncio.TimerHandle | None = None
    _head_after: object = None

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
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._head_after:
            self._stop_head_timer()  # a request started: its head is complete

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a malformed request, with the headers of every answer.
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"connection", b"close"),
            *security_headers(""),
        ]
        event = h11.Response(status_code=400, headers=headers, reason=STATUS_PHRASES[400])
        self.transport.write(self.conn.send(event) or b"")
        self.transport.write(self.conn.send(h11.Data(data=msg.encode("ascii"))) or b"")
        self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        self.transport.close()

    def _arm_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_after = self.cycle
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.cycle is not self._head_after:
            return
        buffered, _ = self.conn.trailing_data
        if buffered and self.conn.our_state is h11.IDLE:
            # Part of a head came: say why the connection closes.
            self.transport.write(self._timeout_answer())
        self.transport.close()

    def _timeout_answer(self) -> bytes:
        body = json.dumps(
            {
                "error": {
                    "code": "request_timeout",
                    "message": f"the request's headers did not arrive within "
                    f"{self.header_timeout_s:g} s",
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
