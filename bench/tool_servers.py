"""The tool servers `keel bench tools` calls: one `echo` tool per kind of source.

    python -m bench.tool_servers mcp-stdio          an MCP server on stdio (the SDK's)
    python -m bench.tool_servers mcp-stdio-lean     the same protocol, answered directly
    python -m bench.tool_servers mcp-http           streamable HTTP on loopback
    python -m bench.tool_servers grpc               a ToolService (keel_tools)

The network servers print their address as the first line of stdout once
they listen. Each `echo` reports how long its own body took (`tool_us`), so
the benchmark can take the tool's own time out of what it measures; an echo
body takes microseconds, so nearly all of a call is the path to the tool and
back, which is what the benchmark is about.

A server written with the SDK spends most of a millisecond of its own on
each request (validating and converting it through its models), which is
the server's time, not Keel's. `mcp-stdio-lean` answers the same JSON-RPC
messages (initialize, tools/list, tools/call) in a few lines with no
framework, so what remains of a call to it is Keel's side of the path: the
registry, the SDK's client and the pipe. The benchmark reports both.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from typing import Any

ECHO_DESCRIPTION = "Returns the text it is given."


def _timed_echo(text: str) -> dict[str, object]:
    started = time.perf_counter_ns()
    result: dict[str, object] = {"text": text}
    result["tool_us"] = (time.perf_counter_ns() - started) / 1000
    return result


def _mcp_server() -> object:
    from mcp.server.mcpserver import MCPServer

    server: MCPServer = MCPServer("keel-bench-tools")

    @server.tool(description=ECHO_DESCRIPTION)
    def echo(text: str) -> dict[str, object]:
        return _timed_echo(text)

    return server


async def _serve_mcp_http() -> None:
    import uvicorn

    server = _mcp_server()
    app = server.streamable_http_app(host="127.0.0.1")  # type: ignore[attr-defined]
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP; without it a response in two writes waits for a delayed ACK (~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    print(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", flush=True)
    await uvicorn.Server(config).serve(sockets=[sock])


async def _serve_grpc() -> None:
    from keel_tools import ToolServer

    def echo(text: str) -> dict[str, object]:
        """Returns the text it is given."""
        return _timed_echo(text)

    server = ToolServer([echo])
    await server.start("127.0.0.1", 0)
    print(server.address, flush=True)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop()


def _lean_result(message: dict[str, Any]) -> dict[str, Any]:
    method = message.get("method")
    params = message.get("params") or {}
    if method == "initialize":
        return {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "keel-bench-lean", "version": "1"},
        }
    if method == "tools/list":
        schema = {"type": "object", "properties": {"text": {"type": "string"}}}
        return {"tools": [{"name": "echo", "description": ECHO_DESCRIPTION, "inputSchema": schema}]}
    if method == "tools/call":
        text = json.dumps(_timed_echo(str((params.get("arguments") or {}).get("text", ""))))
        return {"content": [{"type": "text", "text": text}], "isError": False}
    return {}


def _serve_lean_stdio() -> None:
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message or "method" not in message:
            continue  # a notification, or a response to nothing we asked
        answer = {"jsonrpc": "2.0", "id": message["id"], "result": _lean_result(message)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    kind = (argv if argv is not None else sys.argv[1:] or [""])[0]
    if kind == "mcp-stdio":
        import anyio

        anyio.run(_mcp_server().run_stdio_async)  # type: ignore[attr-defined]
    elif kind == "mcp-stdio-lean":
        _serve_lean_stdio()
    elif kind == "mcp-http":
        asyncio.run(_serve_mcp_http())
    elif kind == "grpc":
        asyncio.run(_serve_grpc())
    else:
        raise SystemExit(
            "usage: python -m bench.tool_servers mcp-stdio|mcp-stdio-lean|mcp-http|grpc"
        )


if __name__ == "__main__":
    main()
