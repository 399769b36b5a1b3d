"""A real MCP server for tests, written with the `mcp` SDK's `MCPServer`.

    python -m tests.support.mcp_server --transport stdio|http [--port N]
        [--effects PATH] [--log PATH] [--require-header NAME:VALUE]
        [--handshake-only [--unknown-session-400]]

Over http it serves streamable HTTP on 127.0.0.1 and prints its URL as the
first line of stdout, so a test knows when it can connect; with
`--handshake-only` it speaks only the protocol's handshake era, where a
client holds a session (Mcp-Session-Id) that a restart of the server ends;
a request naming an unknown session is answered 404 (the spec), or with
`--unknown-session-400` 400, as servers built on other SDKs do. Its tools cover
every shape of result Keel maps and every way a call can go wrong:

- `echo {text}` text; `add {a, b}` structured content and text; `fail {}` a
  result with isError; `image {}` a small PNG; `resources {}` an embedded
  binary resource, an embedded text resource and a resource link;
  `big {bytes}` a text of that size; `malformed {}` structured content that
  breaks the tool's own output schema (the client rejects it);
  `undecodable {}` an image whose data is not base64.
- `apply {key}` an effect that honours the idempotency key of the request
  `_meta` (`keel/idempotencyKey`): it applies once per key and counts every
  execution, both kept in the `--effects` SQLite file, and logs
  `idempotencyKey=<key>` on stderr and in `--log`.
- `slow {seconds}` sleeps; `die {}` ends the server process mid-call.
- `environment {}` the server's pid and the names of its environment
  variables (to check what a child process of the runner can see).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import select
import socket
import sqlite3
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import anyio
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import (
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

IDEMPOTENCY_META_KEY = "keel/idempotencyKey"
ROOT = Path(__file__).resolve().parent.parent.parent
START_DEADLINE_S = 20.0
# Bytes the `resources` tool embeds as a binary resource (tests compare them).
RESOURCE_BYTES = b"\x00\x01keel-binary-resource\xff"

log = logging.getLogger("mcp_test_server")


def tiny_png() -> bytes:
    """A valid 1x1 PNG, built rather than pasted so its bytes are explained."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)  # 1x1, 8-bit RGB
    pixels = zlib.compress(b"\x00\xff\x80\x00")  # filter byte + one orange pixel
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


class EffectStore:
    """Applied keys and execution counts in a SQLite file shared across restarts."""

    def __init__(self, path: Path) -> None:
        self._path = path
        with self._connect() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS effects"
                " (key TEXT PRIMARY KEY, applied INTEGER NOT NULL, executions INTEGER NOT NULL)"
            )

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self._path, timeout=10, isolation_level="IMMEDIATE")

    def apply(self, key: str) -> bool:
        """Counts one execution for `key`; True when this one applied the effect."""
        with self._connect() as db:
            row = db.execute("SELECT applied FROM effects WHERE key = ?", (key,)).fetchone()
            if row is None:
                db.execute("INSERT INTO effects VALUES (?, 1, 1)", (key,))
                return True
            db.execute("UPDATE effects SET executions = executions + 1 WHERE key = ?", (key,))
            return False


def read_effects(path: Path) -> dict[str, tuple[int, int]]:
    """key -> (times applied, times executed), as the server recorded them."""
    if not path.exists():
        return {}
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT key, applied, executions FROM effects").fetchall()
    return {key: (applied, executions) for key, applied, executions in rows}


class Sum(BaseModel):
    sum: int


class Count(BaseModel):
    count: int


def build_server(effects: EffectStore | None) -> MCPServer:
    server: MCPServer = MCPServer("keel-test-tools")

    @server.tool(description="Returns the text it is given.")
    def echo(text: str) -> str:
        return text

    @server.tool(description="Adds two integers.")
    def add(a: int, b: int) -> CallToolResult:
        total = a + b
        return CallToolResult(
            content=[TextContent(text=f"{a} + {b} = {total}")],
            structured_content={"sum": total},
        )

    @server.tool(description="Always fails, as a result with isError.")
    def fail() -> CallToolResult:
        return CallToolResult(content=[TextContent(text="this tool always fails")], is_error=True)

    @server.tool(description="Applies an effect once per idempotency key.")
    def apply(key: str, ctx: Context) -> CallToolResult:
        meta = ctx.request_context.meta or {}
        idem = meta.get(IDEMPOTENCY_META_KEY)
        log.info("apply key=%s idempotencyKey=%s", key, idem)
        if not isinstance(idem, str) or effects is None:
            return CallToolResult(
                content=[TextContent(text="apply needs an idempotency key and --effects")],
                is_error=True,
            )
        applied = effects.apply(idem)
        return CallToolResult(
            content=[TextContent(text=f"{key}: {'applied' if applied else 'already applied'}")],
            structured_content={"applied": applied},
        )

    @server.tool(description="Sleeps for the given seconds.")
    async def slow(seconds: float) -> str:
        await anyio.sleep(seconds)
        return f"slept {seconds} s"

    @server.tool(description="Returns a small PNG image.")
    def image() -> CallToolResult:
        data = base64.b64encode(tiny_png()).decode()
        return CallToolResult(content=[ImageContent(data=data, mime_type="image/png")])

    @server.tool(description="Returns embedded resources and a resource link.")
    def resources() -> CallToolResult:
        blob = BlobResourceContents(
            uri="mem://blob.bin",
            mime_type="application/octet-stream",
            blob=base64.b64encode(RESOURCE_BYTES).decode(),
        )
        text = TextResourceContents(uri="mem://note.txt", mime_type="text/plain", text="a note")
        link = ResourceLink(name="report", uri="https://example.invalid/report.pdf")
        return CallToolResult(
            content=[EmbeddedResource(resource=blob), EmbeddedResource(resource=text), link]
        )

    @server.tool(description="Returns a text of the given size in bytes.")
    def big(bytes: int) -> str:
        return "x" * bytes

    @server.tool(description="Returns a count as a string: its output schema says integer.")
    def malformed() -> Annotated[CallToolResult, Count]:
        return CallToolResult(content=[], structured_content={"count": "7"})

    @server.tool(description="Returns an image whose data is not base64.")
    def undecodable() -> CallToolResult:
        return CallToolResult(content=[ImageContent(data="not base64!", mime_type="image/png")])

    @server.tool(description="Ends the server process in the middle of the call.")
    def die() -> str:
        log.info("dying mid-call")
        logging.shutdown()
        os._exit(3)

    @server.tool(description="The server's pid and the names of its environment variables.")
    def environment() -> CallToolResult:
        body: dict[str, Any] = {"pid": os.getpid(), "names": sorted(os.environ)}
        return CallToolResult(content=[TextContent(text=json.dumps(body))], structured_content=body)

    return server


class RequireHeader:
    """Answers 401 to any request without the header the server was told to expect."""

    def __init__(self, app: ASGIApp, name: str, value: str) -> None:
        self._app = app
        self._name = name.lower().encode()
        self._value = value.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (self._name, self._value) not in scope["headers"]:
            log.info("refused a request without header %s", self._name.decode())
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"missing header"})
            return
        await self._app(scope, receive, send)


class HandshakeOnly:
    """Refuses `server/discover`, as a server of the handshake era (the
    protocol before 2026-07-28, spoken by most servers in use) does: clients
    fall back to `initialize`, and the server keeps a session for them, named
    by the Mcp-Session-Id header, that a restart forgets. With `status_400`
    an unknown session is answered 400 rather than 404."""

    def __init__(self, app: ASGIApp, status_400: bool = False) -> None:
        self._app = app
        self._status_400 = status_400

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self._app(scope, receive, send)
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = json.loads(body or b"null")
        if isinstance(request, dict) and request.get("method") == "server/discover":
            error = {"code": -32601, "message": "Method not found: server/discover"}
            reply = json.dumps({"jsonrpc": "2.0", "id": request.get("id"), "error": error})
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": reply.encode()})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        named = any(name == b"mcp-session-id" for name, _ in scope["headers"])
        await self._app(scope, replay, self._unknown_as_400(send) if named else send)

    def _unknown_as_400(self, send: Send) -> Send:
        """`send`, with a 404 for an unknown session turned into the 400 a
        TypeScript SDK server gives."""
        rewriting = False

        async def rewritten(message: Message) -> None:
            nonlocal rewriting
            if message["type"] == "http.response.start" and message["status"] == 404:
                rewriting = self._status_400
            if not rewriting:
                await send(message)
                return
            if message["type"] == "http.response.start":
                error = {"code": -32000, "message": "Bad Request: No valid session ID provided"}
                body = json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
                headers = [(b"content-type", b"application/json")]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({"type": "http.response.start", "status": 400, "headers": headers})
                await send({"type": "http.response.body", "body": body})

        return rewritten


async def serve_http(
    server: MCPServer,
    port: int,
    require_header: str | None,
    handshake_only: bool = False,
    unknown_session_400: bool = False,
) -> None:
    app: ASGIApp = server.streamable_http_app(host="127.0.0.1")
    if handshake_only:
        app = HandshakeOnly(app, unknown_session_400)
    if require_header:
        name, _, value = require_header.partition(":")
        app = RequireHeader(app, name.strip(), value.strip())
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP; without it a response in two writes waits for a delayed ACK (~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    # Listening before the URL is printed: a client that connects at once
    # (a test restarting the server on the same port) waits in the backlog
    # until uvicorn accepts, rather than being refused.
    sock.listen(128)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    http = uvicorn.Server(config)
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    await http.serve(sockets=[sock])


def configure_logging(log_path: Path | None) -> None:
    # Plain lines on stderr (the runner logs them) and in the log file; set
    # before MCPServer exists, so its own logging setup finds handlers already.
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path is not None:
        handlers.append(logging.FileHandler(log_path))
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", handlers=handlers)


def server_command(*options: str) -> tuple[str, ...]:
    """The command line that runs this server (stdio unless `options` say otherwise)."""
    return (sys.executable, "-m", "tests.support.mcp_server", *options)


def server_env() -> dict[str, str]:
    """What the server needs in its environment to import this module."""
    return {"PYTHONPATH": str(ROOT)}


class HttpMcpServer:
    """This server over streamable HTTP, as a process of the test: started,
    its URL read from its first stdout line, and stopped."""

    def __init__(self, options: Sequence[str] = ()) -> None:
        self.proc = subprocess.Popen(
            server_command("--transport", "http", *options),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url = self._first_line()

    def _first_line(self) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if readable:
                line = self.proc.stdout.readline().strip()
                if line:
                    return line
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"the MCP test server printed no URL (exit code {self.proc.poll()})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.mcp_server")
    parser.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--effects", type=Path)
    parser.add_argument("--log", type=Path)
    parser.add_argument("--require-header", help="NAME:VALUE every HTTP request must carry")
    parser.add_argument(
        "--handshake-only",
        action="store_true",
        help="refuse server/discover: clients use initialize and a session (HTTP)",
    )
    parser.add_argument(
        "--unknown-session-400",
        action="store_true",
        help="with --handshake-only, answer 400 (not 404) to an unknown session",
    )
    args = parser.parse_args(argv)
    configure_logging(args.log)
    server = build_server(EffectStore(args.effects) if args.effects else None)
    if args.transport == "stdio":
        anyio.run(server.run_stdio_async)
    else:
        anyio.run(
            serve_http,
            server,
            args.port,
            args.require_header,
            args.handshake_only,
            args.unknown_session_400,
        )


if __name__ == "__main__":
    main()
