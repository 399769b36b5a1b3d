"""`keel up` and the `keel` CLI as real OS processes, for tests of what users run.

`keel up` listens on a port it picks (--http-port 0) and is found the way
CLI clients find it: through the discovery file it writes in its data dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.cli import up_ports
from tests.support.polling import eventually_sync
from tests.support.processes import ROOT, ChildProcess

KEEL = Path(sys.executable).with_name("keel")
START_DEADLINE_S = 60.0
CLI_DEADLINE_S = 60.0
# What a test's surroundings might set that would point a child elsewhere
# (a test that wants one sets it itself).
_FOREIGN_ENV = (
    "KEEL_DATABASE_URL",
    "KEEL_URL",
    "KEEL_GRPC",
    "KEEL_API_KEY",
    "KEEL_DATA_DIR",
    # `keel up` makes its own internal token unless one is given.
    "KEEL_INTERNAL_TOKEN",
    "KEEL_GRPC_TLS_CERT",
    "KEEL_GRPC_TLS_KEY",
    "KEEL_GRPC_TLS_CA",
    "KEEL_GRPC_TLS_SERVER_NAME",
    "KEEL_DEV_KEY",
    "KEEL_GRPC_BASE_PORT",
    "KEEL_METRICS_PORT",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


@dataclass(frozen=True)
class RunningKeel:
    url: str
    data_dir: Path
    key: str
    child: ChildProcess

    @property
    def discovery_file(self) -> Path:
        return self.data_dir / "keel-up.json"


def _discovered(path: Path, child: ChildProcess) -> dict[str, Any]:
    def record() -> dict[str, Any] | None:
        if child.proc.poll() is not None:
            raise AssertionError(f"keel up exited with {child.proc.returncode}:\n{child.output()}")
        with contextlib.suppress(OSError, ValueError):
            written: dict[str, Any] = json.loads(path.read_text())
            # Not one a killed `keel up` left behind.
            if written.get("pid") == child.proc.pid:
                return written
        return None

    return eventually_sync(
        record, f"keel up to write {path.name}", START_DEADLINE_S, detail=child.output
    )


_UP_LINE = re.compile(r"^Keel is up: (http://\S+)/#key=(\S+)$")


@contextlib.contextmanager
def keel_up(
    data_dir: Path, key: str | None, *args: str, env: Mapping[str, str] | None = None
) -> Iterator[RunningKeel]:
    """`keel up --http-port 0 ARGS` with dev key `key` (None: no KEEL_DEV_KEY,
    the key is the one `keel up` announces), once it serves."""
    fixed = {} if key is None else {"KEEL_DEV_KEY": key}
    child = ChildProcess(
        [
            *(str(KEEL), "up", "--data-dir", str(data_dir), "--http-port", "0"),
            # Any free gRPC port too (a test's own --grpc-port in ARGS wins).
            *("--grpc-port", "0", *args),
        ],
        env=clean_env(**fixed, **(env or {})),
    )
    try:
        line = child.wait_for_line(lambda text: bool(_UP_LINE.match(text)), START_DEADLINE_S)
        announced = _UP_LINE.match(line)
        assert announced is not None
        # The announcement's last line: all of it (dev key, model) is read.
        child.wait_for_line(lambda text: text.startswith("  try: curl "), START_DEADLINE_S)
        record = _discovered(data_dir / "keel-up.json", child)
        yield RunningKeel(record["url"], data_dir, announced.group(2), child)
    finally:
        child.terminate_or_kill(timeout=30)


def keel_up_processes(data_dir: Path, key: str, http_port: int, grpc_port: int) -> ChildProcess:
    """`keel up --processes` (each service its own OS process) with dev key
    `key` on the given ports, started but not yet waited for; its database is
    its data dir's own, whatever KEEL_DATABASE_URL the test run has."""
    env = dict(os.environ, KEEL_DEV_KEY=key, PYTHONUNBUFFERED="1")
    env.pop("KEEL_DATABASE_URL", None)
    return ChildProcess(
        [
            *(str(KEEL), "up", "--processes", "--data-dir", str(data_dir)),
            *("--http-port", str(http_port), "--grpc-port", str(grpc_port)),
        ],
        env=env,
    )


def free_port_run(count: int, attempts: int = 50) -> int:
    """The first of `count` consecutive loopback ports nothing listens on now
    (for `--grpc-base-port`), below the kernel's ephemeral range so that no
    outgoing connection takes one of them before its service binds it."""
    for _ in range(attempts):
        first = up_ports.free_port()
        if first + count - 1 > 65535:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise AssertionError(f"no {count} consecutive free ports found")


def run_keel(
    *args: str, env: Mapping[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """One `keel ARGS` command to its end (the caller's env is not inherited
    beyond what clean_env keeps)."""
    return subprocess.run(
        [str(KEEL), *args],
        cwd=ROOT,
        env=clean_env(**(env or {})),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=CLI_DEADLINE_S,
        check=False,
    )


async def keel_cli(
    *args: str, env: Mapping[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`run_keel` without blocking the event loop."""
    return await asyncio.to_thread(run_keel, *args, env=env, stdin=stdin)


# `keel up --processes` announces each child start and readiness on lines of
# its own: "  ledger-2: pid 4242", "  ledger-2 (pid 4242) is ready".
def _started(name: str) -> re.Pattern[str]:
    return re.compile(rf"^\s*{re.escape(name)}: pid (\d+)$")


def _ready(name: str) -> re.Pattern[str]:
    return re.compile(rf"^\s*{re.escape(name)} \(pid (\d+)\) is ready$")


def child_pid(up: RunningKeel, name: str) -> int:
    """The pid of `keel up --processes`'s child `name` as last started."""
    pattern = _started(name)
    pids = [int(m.group(1)) for line in list(up.child.lines) if (m := pattern.match(line))]
    if not pids:
        raise AssertionError(f"keel up started no child {name!r}:\n{up.child.output()}")
    return pids[-1]


async def restarted_child(up: RunningKeel, name: str, old_pid: int, deadline_s: float = 60) -> int:
    """The pid of `name`'s replacement once the supervisor reports it ready
    (a new pid: the dead one is never revived)."""
    pattern = _ready(name)

    def replaced(line: str) -> bool:
        found = pattern.match(line)
        return found is not None and int(found.group(1)) != old_pid

    line = await up.child.line(replaced, deadline_s)
    found = pattern.match(line)
    assert found is not None
    return int(found.group(1))
