"""A real ToolService for tests, built with keel_tools as a user would.

    python -m tests.support.tool_service --port 0 --effects PATH [--token T]

prints its address (`127.0.0.1:PORT`) as its first stdout line. Tools:
`echo {text}`; `apply {key}`, an effect that honours the idempotency key (it
applies once per key, counts every execution in the `--effects` JSON file,
and logs `idempotencyKey=<key>` on stderr); `slow {seconds}`; `big {size}`
(a text of that many characters); `boom` (raises); `die` (the process exits
mid-call). `launch()` starts it as a child process of the test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel_tools import ToolServer
from tests.support.processes import ChildProcess

_ADDRESS = re.compile(r"^127\.0\.0\.1:\d+$")
_effects_lock = threading.Lock()
_effects_path = Path("effects.json")


def read_effects(path: Path) -> dict[str, Any]:
    """{"executions": n, "applied": {key: count}, "keys": [idempotency keys]}."""
    if not path.exists():
        return {"executions": 0, "applied": {}, "keys": []}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _write_effects(path: Path, data: dict[str, Any]) -> None:
    # Replace, never rewrite in place: a kill mid-write leaves the old file.
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


def echo(text: str) -> str:
    """Returns the text it was given."""
    return text


def apply(key: str, *, idempotency_key: str, session_id: str) -> dict[str, Any]:
    """Adds one to the counter `key`, once per idempotency key."""
    print(
        f"apply key={key} idempotencyKey={idempotency_key} session={session_id}",
        file=sys.stderr,
        flush=True,
    )
    with _effects_lock:
        data = read_effects(_effects_path)
        data["executions"] += 1
        first = idempotency_key not in data["keys"]
        if first:
            data["keys"].append(idempotency_key)
            data["applied"][key] = data["applied"].get(key, 0) + 1
        _write_effects(_effects_path, data)
    return {"key": key, "count": data["applied"][key], "applied": first}


async def slow(seconds: float) -> str:
    """Waits `seconds`, then says so."""
    print(f"slow started for {seconds:g} s", file=sys.stderr, flush=True)
    await asyncio.sleep(seconds)
    return f"slept {seconds:g} s"


def big(size: int) -> str:
    """A text of `size` characters."""
    return "x" * size


def boom() -> str:
    """Always fails."""
    raise RuntimeError("boom: the tool broke on purpose")


def die() -> str:
    """Ends the whole service in the middle of the call."""
    print("die: exiting mid-call", file=sys.stderr, flush=True)
    os._exit(3)


TOOLS = (echo, apply, slow, big, boom, die)


@dataclass
class RunningToolService:
    """The child process and the address it serves on."""

    process: ChildProcess
    address: str
    effects: Path

    def stop(self) -> None:
        self.process.kill()


def launch(effects: Path, token: str | None = None) -> RunningToolService:
    """Starts the service as a child process on a free loopback port."""
    args = ["-m", "tests.support.tool_service", "--port", "0", "--effects", str(effects)]
    if token is not None:
        args += ["--token", token]
    env = {k: v for k, v in os.environ.items() if k != "KEEL_TOOL_TOKEN"}
    process = ChildProcess.python(*args, env=env)
    address = process.wait_for_line(lambda line: bool(_ADDRESS.match(line)))
    return RunningToolService(process, address, effects)


@contextmanager
def launched(effects: Path, token: str | None = None) -> Iterator[RunningToolService]:
    """`launch`, stopped when the block ends."""
    service = launch(effects, token)
    try:
        yield service
    finally:
        service.stop()


async def _main(args: argparse.Namespace) -> None:
    server = ToolServer(TOOLS, token=args.token)
    await server.start("127.0.0.1", args.port)
    print(server.address, flush=True)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop()


def main() -> None:
    global _effects_path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--effects", type=Path, required=True)
    parser.add_argument("--token", default=None, help="required x-keel-tool-token")
    args = parser.parse_args()
    _effects_path = args.effects
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
