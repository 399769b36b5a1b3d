"""The floor under `keel bench ledger`'s one-session figure: what a Python
gRPC round trip costs with nothing behind it, and with nothing behind it but
the one durable write.

A one-session append loop waits for each append's reply before it sends the
next, so it can go no faster than one bidirectional-stream round trip
between two Python processes plus one INSERT + COMMIT. Two stand-ins measure
that, each serving as its own OS process on loopback like the ledger:

- `echo`: answers each message with its own bytes (the gRPC round trip);
- `commit`: INSERTs each message as a ledger-shaped row and COMMITs it on
  psycopg's async connection, on the server's event loop, before answering:
  the least a ledger written in Python could do per append (no fence, no
  dedup, no batching, no thread hop);
- `thread`: the same write on psycopg's blocking connection in one writer
  thread, as the ledger's store does it: the thread hop against the async
  driver's own cost.

The client is this process, one message in flight, as the ledger bench's
single session is.

    python -m bench.grpc_floor serve echo|commit|thread [URL SCHEMA]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import psycopg
from psycopg import sql

_METHOD = "/keel.bench.Floor/Stream"
_READY = "floor listening on "


def _identity(data: bytes) -> bytes:
    return data


def _floor_table(url: str, schema: str) -> sql.Composed:
    """A fresh ledger-shaped table in `schema`; the INSERT into it."""
    table = sql.Identifier(schema, f"floor_events_{time.time_ns()}")
    with psycopg.connect(url) as connection:
        connection.execute(
            sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
                table, sql.Identifier(schema, "ledger_events")
            )
        )
    return sql.SQL(
        "INSERT INTO {} (originator_id, originator_version, topic, state) VALUES (%s, %s, %s, %s)"
    ).format(table)


async def _serve(mode: str, url: str, schema: str) -> None:
    insert = _floor_table(url, schema) if mode != "echo" else None
    on_loop: psycopg.AsyncConnection[Any] | None = None
    blocking: psycopg.Connection[Any] | None = None
    writer = concurrent.futures.ThreadPoolExecutor(1)
    if mode == "commit":
        on_loop = await psycopg.AsyncConnection.connect(url)
    elif mode == "thread":
        blocking = psycopg.connect(url)
    version = 0

    def write_blocking(row: tuple[str, int, str, bytes]) -> None:
        assert blocking is not None and insert is not None
        blocking.execute(insert, row, prepare=True)
        blocking.commit()

    async def stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        nonlocal version
        loop = asyncio.get_running_loop()
        async for message in requests:
            version += 1
            row = ("floor-session", version, "input", message)
            if on_loop is not None and insert is not None:
                await on_loop.execute(insert, row, prepare=True)
                await on_loop.commit()
            elif blocking is not None:
                await loop.run_in_executor(writer, write_blocking, row)
            yield message

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        stream, request_deserializer=_identity, response_serializer=_identity
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("keel.bench.Floor", {"Stream": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"{_READY}127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


async def _round_trips(target: str, count: int, payload: bytes) -> float:
    """Messages per second with one in flight at a time."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.stream_stream(
            _METHOD, request_serializer=_identity, response_deserializer=_identity
        )()  # type: ignore[call-arg]  # no iterator: written to with call.write
        for _ in range(50):  # warm-up: the connection, prepared statements
            await call.write(payload)
            await call.read()
        started = time.perf_counter()
        for _ in range(count):
            await call.write(payload)
            await call.read()
        elapsed = time.perf_counter() - started
        await call.done_writing()
        return count / elapsed


def measure_floor(mode: str, count: int, payload: bytes, url: str = "", schema: str = "") -> float:
    """Round trips per second against a `mode` stand-in in its own process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_floor", "serve", mode, url, schema],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith(_READY):
            raise RuntimeError(f"the {mode} stand-in did not start")
        return asyncio.run(_round_trips(line[len(_READY) :].strip(), count, payload))
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        raise SystemExit(__doc__)
    args = [*sys.argv[2:], "", ""]
    asyncio.run(_serve(args[0], args[1], args[2]))
