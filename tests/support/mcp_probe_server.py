"""A minimal MCP stdio server that probes what its process may read.

    python3 mcp_probe_server.py

Standard library only, in one file, so any Python 3 runs it: a tool server
started as another uid (`nobody`) may not reach the test's interpreter or
its site-packages (a virtualenv under /root, say), and copying this file to
a directory every uid can read is all it needs. It speaks the part of MCP a
client uses for tools (`initialize`, `ping`, `tools/list`, `tools/call`),
one JSON-RPC message per line.

- `read {path}`: `{"path", "ok": true, "text"}` when the file could be read,
  `{"path", "ok": false, "error"}` when not.
- `identity {}`: the server's uid, gid, pid, working directory, HOME and
  capability sets.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

SOURCE = Path(__file__)
_STRING_PATH = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS = [
    {"name": "read", "description": "Reads a file, or says why not.", "inputSchema": _STRING_PATH},
    {
        "name": "identity",
        "description": "The server's uid, gid, pid, cwd and HOME.",
        "inputSchema": {"type": "object", "properties": {}},
    },
]


def read(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            text = handle.read(1 << 16).decode(errors="replace")
    except OSError as error:
        return {"path": path, "ok": False, "error": f"{type(error).__name__}: {error.strerror}"}
    return {"path": path, "ok": True, "text": text}


def identity() -> dict[str, Any]:
    return {
        "uid": os.getuid(),
        "gid": os.getgid(),
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "home": os.environ.get("HOME", ""),
        "capabilities": _capabilities(),
    }


def _capabilities() -> dict[str, int]:
    """CapEff, CapPrm, CapInh, CapBnd and CapAmb of this process, as numbers."""
    found: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.startswith("Cap"):
            found[name] = int(value.strip(), 16)
    return found


def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    if name == "read":
        body = read(str(arguments.get("path", "")))
    elif name == "identity":
        body = identity()
    else:
        text = f"unknown tool {name!r}"
        return {"content": [{"type": "text", "text": text}], "isError": True}
    return {"content": [{"type": "text", "text": json.dumps(body)}], "isError": False}


def answer(message: dict[str, Any]) -> dict[str, Any] | None:
    method = message.get("method")
    params = message.get("params") or {}
    if "id" not in message:
        return None  # a notification (`notifications/initialized`, cancellations)
    if method == "initialize":
        result: dict[str, Any] = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "keel-probe", "version": "1"},
        }
    elif method == "ping":
        result = {}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        result = call(str(params.get("name", "")), dict(params.get("arguments") or {}))
    else:
        error = {"code": -32601, "message": f"method not found: {method}"}
        return {"jsonrpc": "2.0", "id": message["id"], "error": error}
    return {"jsonrpc": "2.0", "id": message["id"], "result": result}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = answer(json.loads(line))
        if reply is not None:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
