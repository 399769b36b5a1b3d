"""What runs on this host: each runner and edge process records itself.

A runtime writes `<data dir>/runtimes/<runtime id>.json` = {runtimeId, role,
pid, address, startedAtMs} once it serves, and removes it when it stops, so
`keel drain --local` finds the processes of its own pod (or host) without
asking anyone: the runner's internal gRPC address, the edge's HTTP address,
both as this host dials them (a wildcard bind becomes loopback).

A process killed with SIGKILL leaves its record behind: the next runtime to
record itself under the same data dir deletes the records of processes
that are gone, and readers skip (and delete) any left, without a word (a
gone process has nothing to drain). A record naming a live pid is checked
against the runtime that answers at its address before use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

RECORDS_DIR = "runtimes"
# The edge's local drain endpoint (loopback only, internal token).
LOCAL_DRAIN_PATH = "/internal/v1/drain"
ROLES = ("runner", "edge")
_WILDCARDS = {"", "0.0.0.0", "::", "[::]", "*"}


@dataclass(frozen=True)
class RuntimeRecord:
    runtime_id: str
    role: str
    pid: int
    # host:port this host dials to reach the runtime (gRPC for a runner,
    # HTTP for an edge).
    address: str
    started_at_ms: int
    path: Path

    def alive(self) -> bool:
        """Whether a process with the recorded pid exists (it may be another
        process that reused the pid: the address check tells them apart)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # someone else's process: exists, not ours to drain
        return True


def split_host_port(address: str) -> tuple[str, int]:
    """("10.0.0.5", 7105) of "10.0.0.5:7105"; IPv6 hosts keep their brackets."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host, int(port)


def is_wildcard(host: str) -> bool:
    return host in _WILDCARDS


def local_dial_address(bind_host: str, port: int) -> str:
    """How a process on this host reaches a server bound to `bind_host`:
    the host itself, or loopback when it listens on every interface."""
    if is_wildcard(bind_host):
        return f"[::1]:{port}" if bind_host in ("::", "[::]") else f"127.0.0.1:{port}"
    return f"{bind_host}:{port}"


def records_dir(data_dir: Path) -> Path:
    return Path(data_dir) / RECORDS_DIR


def record_runtime(data_dir: Path, runtime_id: str, role: str, address: str) -> Path | None:
    """Records this process's runtime; written to a temporary name, then
    renamed, so a reader never sees half a record. None when the data dir
    cannot be written: the runtime serves anyway, only a local drain will
    not find it (said in the log)."""
    try:
        return _write_record(data_dir, runtime_id, role, address)
    except OSError as error:
        log.warning("could not record runtime %s under %s: %s", runtime_id, data_dir, error)
        return None


def _write_record(data_dir: Path, runtime_id: str, role: str, address: str) -> Path:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    folder = records_dir(data_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    # What earlier, killed runs left here points at nothing any more.
    live_runtimes(data_dir)
    path = folder / f"{runtime_id}.json"
    record = {
        "runtimeId": runtime_id,
        "role": role,
        "pid": os.getpid(),
        "address": address,
        "startedAtMs": time.time_ns() // 1_000_000,
    }
    partial = folder / f".{runtime_id}.{os.getpid()}.json"
    partial.write_text(json.dumps(record) + "\n", encoding="utf-8")
    partial.replace(path)
    return path


def forget_runtime(path: Path) -> None:
    """Removes a record this process wrote (and only such a record)."""
    record = _read(path)
    if record is not None and record.pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def local_runtimes(data_dir: Path) -> list[RuntimeRecord]:
    """Every readable record under `data_dir`, oldest first."""
    folder = records_dir(data_dir)
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError:
        return []
    records = [r for r in map(_read, paths) if r is not None]
    return sorted(records, key=lambda r: (r.started_at_ms, r.runtime_id))


def live_runtimes(data_dir: Path) -> list[RuntimeRecord]:
    """The records under `data_dir` whose process still exists, oldest
    first; the others are deleted on the way."""
    live = []
    for record in local_runtimes(data_dir):
        if record.alive():
            live.append(record)
        else:
            with contextlib.suppress(OSError):
                record.path.unlink()
    return live


def _read(path: Path) -> RuntimeRecord | None:
    if path.name.startswith("."):
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        record = RuntimeRecord(
            runtime_id=str(raw["runtimeId"]),
            role=str(raw["role"]),
            pid=int(raw["pid"]),
            address=str(raw["address"]),
            started_at_ms=int(raw.get("startedAtMs", 0)),
            path=path,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if record.role in ROLES else None
