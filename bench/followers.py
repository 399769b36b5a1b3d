"""Many SSE clients in one benchmark process, read by a single epoll loop.

An asyncio reader per connection costs the client some 40 µs per frame
(stream reader, line splitting, JSON): with 1000 clients on a 2-core machine
that is most of the figure being measured, and a raw asyncio server writing
the same frame to 1000 such readers already shows a p99 of about 45 ms. Here
each connection is a plain non-blocking socket; a frame is recognised by its
`event:` line without parsing it, and its arrival is the moment the loop
reads it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time

RECV_BYTES = 65536


def _open_stream(port: int, path: str, key: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # HTTP/1.0: the body is the bare event stream, no chunked framing.
    sock.sendall(
        f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        "Accept: text/event-stream\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("the edge closed an SSE request")
        head += chunk
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"SSE request refused: {head[:300]!r}")
    sock.setblocking(False)
    return sock


class Followers:
    """`count` SSE connections to one path of the edge."""

    def __init__(self, port: int, path: str, key: str, count: int) -> None:
        self._port = port
        self._key = key
        self._socks = [_open_stream(port, path, key) for _ in range(count)]
        self._by_fd = {sock.fileno(): sock for sock in self._socks}
        self._poll = select.epoll()
        for sock in self._socks:
            self._poll.register(sock.fileno(), select.EPOLLIN)
        # The tail of what each connection sent, so an `event:` line split
        # across two reads is still recognised.
        self._tails = {sock.fileno(): b"" for sock in self._socks}

    def post_and_time(
        self, path: str, body: bytes, event: str, deadline_s: float = 30.0
    ) -> list[float]:
        """POSTs `body` (JSON) to `path`, then the milliseconds from just before
        the POST until each connection has received a frame of `event`."""
        # sse-starlette ends lines with CRLF; either line ending is accepted.
        markers = (f"event: {event}\r\n".encode(), f"event: {event}\n".encode())
        waiting = {sock.fileno(): sock for sock in self._socks}
        arrivals: list[float] = []
        request = socket.create_connection(("127.0.0.1", self._port))
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        request.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {self._key}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        try:
            while waiting:
                if time.perf_counter() - started > deadline_s:
                    raise TimeoutError(f"{len(waiting)} clients did not get `{event}`")
                for fd, _ in self._poll.poll(1.0):
                    sock = waiting.get(fd)
                    if sock is None:  # counted already: later frames of the commit
                        self._by_fd[fd].recv(RECV_BYTES)
                        continue
                    data = sock.recv(RECV_BYTES)
                    if not data:
                        raise ConnectionError("the edge closed an SSE stream")
                    seen = self._tails[fd] + data
                    if any(marker in seen for marker in markers):
                        arrivals.append((time.perf_counter() - started) * 1000)
                        del waiting[fd]
                        self._tails[fd] = b""
                    else:
                        self._tails[fd] = seen[-len(markers[0]) :]
            status = request.recv(64)
            if b" 202 " not in status:
                raise RuntimeError(f"POST {path} failed: {status!r}")
        finally:
            request.close()
        self._drain()
        return arrivals

    def _drain(self) -> None:
        """Reads whatever else arrived (later frames of the same commit)."""
        for fd, _ in self._poll.poll(0):
            with contextlib.suppress(BlockingIOError):
                self._by_fd[fd].recv(RECV_BYTES)
        for fd in self._tails:
            self._tails[fd] = b""

    def close(self) -> None:
        self._poll.close()
        for sock in self._socks:
            sock.close()
