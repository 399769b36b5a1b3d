"""How CLI clients find a running `keel up`, and which key they use.

`keel up` writes `<data dir>/keel-up.json` = {"url", "grpc", "pid"} once it
serves and removes it when it stops, so `keel chat`, `keel loadout …` and
the rest work against it with no flags, whatever ports it chose (`--http-port
0` included). The file holds no secret: the key comes from --key or
KEEL_API_KEY.

Where a client goes, first match wins: --url, KEEL_URL,
the discovery file under --data-dir (default $KEEL_DATA_DIR or ./.keel),
the default URL.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from services.common import settings_registry as registry
from services.common.setting import read_text

# Every command's way out; defined with the service start-up, which uses them too.
from services.service_start import USAGE_EXIT as USAGE_EXIT
from services.service_start import fail as fail

DISCOVERY_FILE = "keel-up.json"
DEFAULT_URL = "http://127.0.0.1:8080"
NO_KEY = "keel: no API key: pass --key or set KEEL_API_KEY"


def default_data_dir() -> Path:
    return Path(read_text(os.environ, registry.KEEL_DATA_DIR))


def discovery_path(data_dir: Path | None = None) -> Path:
    return (data_dir if data_dir is not None else default_data_dir()) / DISCOVERY_FILE


def write_discovery(data_dir: Path, url: str, grpc_address: str = "") -> Path:
    """Announces a running `keel up` (its HTTP URL and gRPC address) to
    clients. Written to a temporary name then renamed, so a client never
    reads half a file."""
    path = discovery_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"url": url, "grpc": grpc_address, "pid": os.getpid()}
    partial = path.with_name(f".{DISCOVERY_FILE}.{os.getpid()}")
    partial.write_text(json.dumps(record) + "\n", encoding="utf-8")
    partial.replace(path)
    return path


def remove_discovery(data_dir: Path) -> None:
    """Removes the file if this process wrote it: a second `keel up` on the
    same data dir may have replaced it, and its announcement must stay."""
    path = discovery_path(data_dir)
    record = read_discovery(data_dir)
    if record is not None and record.get("pid") == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def read_discovery(data_dir: Path | None = None) -> dict[str, Any] | None:
    """The running `keel up`'s record, or None (no file, or an unreadable one)."""
    try:
        record = json.loads(discovery_path(data_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _discovered(data_dir: Path | None, name: str) -> str:
    record = read_discovery(data_dir) or {}
    value = record.get(name)
    return value if isinstance(value, str) else ""


def resolve_url(url: str | None = None, data_dir: Path | None = None) -> str:
    """The edge's HTTP base URL, without a trailing slash."""
    found = (
        url
        or read_text(os.environ, registry.KEEL_URL)
        or _discovered(data_dir, "url")
        or DEFAULT_URL
    )
    return found.rstrip("/")


def require_key(key: str | None = None) -> str:
    """--key, else KEEL_API_KEY; without either the command cannot run."""
    found = key or read_text(os.environ, registry.KEEL_API_KEY)
    if not found:
        fail(NO_KEY, USAGE_EXIT)
    return found
