"""`keel bench tools`: what a tool call costs beyond the tool's own time
(SPEC §8: p50 ≤ 2 ms for MCP stdio and a gRPC ToolService).

Each source is built the way a runner builds it — a loadout document,
`SourceFactory` under an operator policy that allows it, the tenant's
`ToolRegistry` — and each call goes through `ToolRegistry.run`, the path an
attempt takes: name resolution, the argument check against the tool's
schema, the timeout, the source's transport and the result limit.

Sources: the built-in `clock` (in the runner's process), and an `echo` tool
served by `bench.tool_servers`: over MCP stdio (a child process of this
one, as a runner starts it) by a lean server that answers the protocol
directly (`mcp_stdio`: Keel's side of the path, the figure SPEC §8 is
about) and by a server written with the SDK (`mcp_stdio_sdk_server`: what a
typical Python MCP server adds of its own); over MCP streamable HTTP on
loopback (SDK server); and as a gRPC ToolService written with `keel_tools`.
Every echo reports the time its own body took (`tool_us`, microseconds),
which is taken out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from agent_io.loadout import Loadout
from agent_io.tools import CounterStore, ToolCall, ToolRegistry, builtin_tools, idempotency_key
from agent_io.tools.factory import SourceFactory, ToolDefaults
from bench.children import stop_child
from bench.turns import percentile
from services.common.secrets import SecretPolicy

TENANT = "bench"
SERVER_MODULE = "bench.tool_servers"
START_DEADLINE_S = 30.0
TARGET_P50_MS = 2.0


def _server_command(kind: str) -> list[str]:
    return [sys.executable, "-m", SERVER_MODULE, kind]


@contextlib.contextmanager
def _network_server(kind: str) -> Iterator[str]:
    """A tool server process of `kind`, and the address on its first line."""
    process = subprocess.Popen(
        _server_command(kind), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert process.stdout is not None
        address = process.stdout.readline().strip()
        if not address:
            raise RuntimeError(f"the {kind} tool server exited before it listened")
        yield address
    finally:
        stop_child(process, timeout_s=10)


def _own_time_ms(content: str) -> float:
    """The tool body's own time, as the echo reports it (0 for others)."""
    try:
        reported = json.loads(content)
    except json.JSONDecodeError:
        return 0.0
    if isinstance(reported, dict) and isinstance(reported.get("tool_us"), int | float):
        return float(reported["tool_us"]) / 1000
    return 0.0


async def _measure_source(
    registry: ToolRegistry, tool: str, arguments: Mapping[str, Any], calls: int, warmup: int
) -> dict[str, Any]:
    await registry.prepare()
    overheads: list[float] = []
    for index in range(warmup + calls):
        call_id = f"call-{index}"
        call = ToolCall(
            call_id,
            tool,
            arguments,
            idempotency_key(TENANT, "bench-session", call_id),
            session_id="bench-session",
            tenant_id=TENANT,
        )
        started = time.perf_counter()
        outcome = await registry.run(call)
        elapsed_ms = (time.perf_counter() - started) * 1000
        if outcome.is_error:
            raise RuntimeError(f"{tool} failed: {outcome.content}")
        if index >= warmup:
            overheads.append(elapsed_ms - _own_time_ms(outcome.content))
    return {
        "calls": calls,
        "overhead_p50_ms": round(statistics.median(overheads), 3),
        "overhead_p99_ms": round(percentile(overheads, 99), 3),
        "overhead_max_ms": round(max(overheads), 3),
    }


@contextlib.asynccontextmanager
async def _registry(
    document: Mapping[str, Any], policy: SecretPolicy, data_dir: Path
) -> AsyncIterator[ToolRegistry]:
    factory = SourceFactory(
        builtin_tools(CounterStore(data_dir / "counter.sqlite3")),
        policy,
        os.environ,
        ToolDefaults(),
    )
    registry = ToolRegistry(factory.slots(TENANT, Loadout.from_document(1, document)))
    try:
        yield registry
    finally:
        for slot in registry.slots:
            await slot.aclose()


async def _measure(calls: int, warmup: int) -> dict[str, Any]:
    echo = {"text": "hello"}
    stdio = _server_command("mcp-stdio-lean")
    stdio_sdk = _server_command("mcp-stdio")
    results: dict[str, Any] = {}
    with (
        TemporaryDirectory() as scratch,
        _network_server("mcp-http") as mcp_url,
        _network_server("grpc") as grpc_target,
    ):
        data_dir = Path(scratch)
        policy = (
            SecretPolicy()
            .with_command(stdio)
            .with_command(stdio_sdk)
            .with_tool_target(mcp_url.rsplit("/", 1)[0])
            .with_tool_target(grpc_target)
        )
        sources: list[tuple[str, dict[str, Any], str, Mapping[str, Any]]] = [
            ("builtin", {"source": "builtin", "names": ["clock"]}, "clock", {}),
            (
                "mcp_stdio",
                {"source": "mcp", "name": "tools", "transport": "stdio", "command": stdio},
                "tools.echo",
                echo,
            ),
            (
                "mcp_stdio_sdk_server",
                {"source": "mcp", "name": "tools", "transport": "stdio", "command": stdio_sdk},
                "tools.echo",
                echo,
            ),
            (
                "mcp_http",
                {"source": "mcp", "name": "tools", "transport": "http", "url": mcp_url},
                "tools.echo",
                echo,
            ),
            (
                "grpc",
                {"source": "grpc", "name": "tools", "target": grpc_target},
                "tools.echo",
                echo,
            ),
        ]
        for label, item, tool, arguments in sources:
            async with _registry({"tools": [item]}, policy, data_dir) as registry:
                results[label] = await _measure_source(registry, tool, arguments, calls, warmup)
    return results


def measure(calls: int = 500, warmup: int = 50) -> dict[str, Any]:
    sources = asyncio.run(_measure(calls, warmup))
    return {
        **sources,
        "targets": {"overhead_p50_ms": TARGET_P50_MS, "sources": ["mcp_stdio", "grpc"]},
        "met": all(
            sources[name]["overhead_p50_ms"] <= TARGET_P50_MS for name in ("mcp_stdio", "grpc")
        ),
    }
