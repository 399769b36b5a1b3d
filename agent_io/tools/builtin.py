"""The built-in tools: `clock`, `sleep` and `counter`.

`counter` is the model of an effectful tool under at-least-once execution:
its effect happens once per idempotency key, while it records how many times
it really ran, so tests can tell a repeated execution from a repeated effect.

Its once-per-key state must live where every runner of the deployment sees
it: a call redone by another runner (another pod, another data dir) must
find the effect already applied. So the runner hands `builtin_tools` a
`CounterEffects` store kept in the deployment's database (the runner's
services.runner.tool_state: PostgreSQL, or under SQLite the file
`CounterStore` keeps in the shared data dir). This package imports no
service: the store comes in through the protocol.

`BuiltinSource` serves the built-ins a loadout item enables as a ToolSource,
so the registry treats them like any other source (their names unprefixed).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent_io.tools.base import ToolCall, ToolOutcome, ToolSpec

__all__ = [
    "BUILTIN_NAMES",
    "BuiltinSource",
    "CounterEffects",
    "CounterStore",
    "Tool",
    "builtin_tools",
]

BUILTIN_NAMES = ("clock", "sleep", "counter")
MAX_SLEEP_S = 600.0

ToolFunction = Callable[[ToolCall], Awaitable[ToolOutcome]]


@dataclass(frozen=True)
class Tool:
    """A tool that runs inside the runner: its spec and its function."""

    spec: ToolSpec
    run: ToolFunction


class CounterEffects(Protocol):
    """Where `counter` keeps its effect, once per idempotency key (blocking
    calls: the tool runs them on a worker thread)."""

    def apply(self, key: str, idem_key: str) -> int:
        """Increments `key` unless `idem_key` was applied already; returns
        the value the call with `idem_key` produced (the same when redone)."""
        ...

    def value(self, key: str) -> int:
        """The counter's value (0: never incremented)."""
        ...

    def executions(self, key: str) -> int:
        """How many times a call of `key` really ran (a redone call counts)."""
        ...


class CounterStore:
    """The effect behind `counter` in a small SQLite file, shared by the
    runners of one host (one data dir).

    `effects` counts each key once per idempotency key (the effect);
    `executions` counts every time the tool really ran (at-least-once shows).
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._lock = threading.Lock()
        with self._connect() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS counter_effects ("
                " idem_key TEXT PRIMARY KEY, key TEXT NOT NULL, value INTEGER NOT NULL,"
                " executions INTEGER NOT NULL)"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, value INTEGER NOT NULL)"
            )

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self._path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    def apply(self, key: str, idem_key: str) -> int:
        with self._lock, self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute(
                "SELECT value FROM counter_effects WHERE idem_key = ?", (idem_key,)
            ).fetchone()
            if row is not None:
                conn.execute(
                    "UPDATE counter_effects SET executions = executions + 1 WHERE idem_key = ?",
                    (idem_key,),
                )
                conn.execute("COMMIT")
                return int(row[0])
            conn.execute(
                "INSERT INTO counters (key, value) VALUES (?, 1) "
                "ON CONFLICT(key) DO UPDATE SET value = value + 1",
                (key,),
            )
            value = int(
                conn.execute("SELECT value FROM counters WHERE key = ?", (key,)).fetchone()[0]
            )
            conn.execute(
                "INSERT INTO counter_effects (idem_key, key, value, executions) "
                "VALUES (?, ?, ?, 1)",
                (idem_key, key, value),
            )
            conn.execute("COMMIT")
            return value

    def value(self, key: str) -> int:
        with self._connect() as conn:
            row = conn.execute("SELECT value FROM counters WHERE key = ?", (key,)).fetchone()
            return int(row[0]) if row else 0

    def executions(self, key: str) -> int:
        with self._connect() as conn:
            row = conn.execute(
                "SELECT COALESCE(SUM(executions), 0) FROM counter_effects WHERE key = ?", (key,)
            ).fetchone()
            return int(row[0])


def _object(properties: Mapping[str, Any], required: Sequence[str] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": dict(properties), "required": list(required)}


async def _clock(call: ToolCall) -> ToolOutcome:
    return ToolOutcome(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


async def _sleep(call: ToolCall) -> ToolOutcome:
    seconds = call.arguments.get("seconds", 1)
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
        return ToolOutcome("sleep needs a non-negative number of seconds", is_error=True)
    await asyncio.sleep(min(float(seconds), MAX_SLEEP_S))
    return ToolOutcome(f"slept {seconds} s")


def builtin_tools(counter_store: CounterEffects) -> dict[str, Tool]:
    async def counter(call: ToolCall) -> ToolOutcome:
        key = call.arguments.get("key", "default")
        if not isinstance(key, str) or not key:
            return ToolOutcome("counter needs a string key", is_error=True)
        value = await asyncio.to_thread(counter_store.apply, key, call.idempotency_key)
        return ToolOutcome(json.dumps({"key": key, "value": value}))

    return {
        "clock": Tool(ToolSpec("clock", "The current UTC time.", _object({})), _clock),
        "sleep": Tool(
            ToolSpec(
                "sleep",
                "Wait for a number of seconds.",
                _object({"seconds": {"type": "number"}}, ["seconds"]),
            ),
            _sleep,
        ),
        "counter": Tool(
            ToolSpec(
                "counter",
                "Increment a named counter once per call; returns the new value.",
                _object({"key": {"type": "string"}}, ["key"]),
            ),
            counter,
        ),
    }


class BuiltinSource:
    """The built-ins one loadout item enables, as a ToolSource."""

    def __init__(self, tools: Mapping[str, Tool], names: Sequence[str], name: str = "builtin"):
        self._name = name
        self._tools = {n: tools[n] for n in names if n in tools}

    @property
    def name(self) -> str:
        return self._name

    async def list_tools(self) -> Sequence[ToolSpec]:
        return tuple(tool.spec for tool in self._tools.values())

    async def call(self, call: ToolCall, timeout_s: float) -> ToolOutcome:
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolOutcome(f"unknown tool {call.name!r}", is_error=True)
        try:
            return await asyncio.wait_for(tool.run(call), timeout_s)
        except TimeoutError:
            return ToolOutcome(f"{call.name} timed out after {timeout_s:g} s", is_error=True)

    async def aclose(self) -> None:
        """Nothing to close: the built-ins run inside the runner."""
