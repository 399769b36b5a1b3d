"""A data dir only its owner can read, and the internal token `keel up` keeps in it.

Keel's commands run with umask 077 (services/cli/main.py), so whatever they
create (SQLite files, blobs, the discovery file, the token) is 0600 in
folders of 0700; a data dir made before that is closed again when a command
starts on it.

`keel up` authenticates its own services to each other with a random token
made once per data dir (`<data dir>/internal-token`, 0600) and reused on
restart, so a restarted `keel up --processes` and its still-running children
agree. An explicit KEEL_INTERNAL_TOKEN wins over the file.

One `keel up` at a time per data dir: it holds an exclusive flock on
`<data dir>/keel-up.lock` (which names its pid) for as long as it runs; the
kernel drops the lock when the process ends, however it ends (SIGKILL
included), so a lock is never left behind. The dev key `keel up` made is
kept in `<data dir>/dev-key` (0600) and used again on the next start, so
restarts do not pile up operator keys (services/cli/up.py bootstrap_tenant).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from services.common.config import Settings
from services.common.internal_auth import MIN_TOKEN_CHARS, InternalAuthError

TOKEN_FILE = "internal-token"
LOCK_FILE = "keel-up.lock"
DEV_KEY_FILE = "dev-key"


class DataDirInUse(Exception):
    """Another `keel up` runs on this data dir (its message is the line to show)."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        self.pid = pid
        holder = f"pid {pid}" if pid else "a process that is starting"
        super().__init__(
            f"{data_dir} is in use by another keel up ({holder}): stop it, "
            "or give this one another --data-dir"
        )


def _read_token(path: Path) -> str:
    # O_NOFOLLOW: a symlink planted at the token's name is refused, not followed.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, encoding="ascii") as handle:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
        token = handle.read().strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise InternalAuthError(
            f"{path} holds no usable internal token (fewer than {MIN_TOKEN_CHARS} characters): "
            "delete it and `keel up` makes a new one"
        )
    return token


def data_dir_token(data_dir: Path) -> str:
    """The internal token of `data_dir`, made (random, 0600) if there is none.

    Written to a private temporary file, then linked to its name: the link
    fails if another `keel up` got there first (its token is used), and a
    reader never sees half a token."""
    path = data_dir / TOKEN_FILE
    with contextlib.suppress(FileNotFoundError):
        return _read_token(path)
    token = secrets.token_urlsafe(32)
    try:
        _write_private(path, token, os.link)
    except FileExistsError:
        return _read_token(path)
    return token


def _write_private(path: Path, text: str, publish: Callable[[Path, Path], None]) -> None:
    """Writes `text` (0600) to a private temporary file beside `path`, then
    `publish`es it there (os.link: only if none is there; os.replace: over
    it), so a reader never sees half of it."""
    partial = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(text + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        publish(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def with_internal_token(settings: Settings) -> Settings:
    """`settings` with an internal token: its own (KEEL_INTERNAL_TOKEN) or
    the data dir's."""
    if settings.internal_token:
        return settings
    return settings.with_overrides(internal_token=data_dir_token(Path(settings.data_dir)))


def lock_data_dir(data_dir: Path) -> int:
    """Takes the data dir for this process's life (the returned descriptor
    stays open until it exits); raises DataDirInUse when another `keel up`
    holds it. The descriptor is not inherited by children, so the lock is
    this process's alone and goes when it does."""
    path = data_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise DataDirInUse(data_dir, int(holder) if holder.isdigit() else None) from None
    except BaseException:
        os.close(fd)
        raise
    # Who holds it, for the line a second `keel up` shows.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd


def stored_dev_key(data_dir: Path) -> str:
    """The dev key kept by the last `keel up` on `data_dir`, or ""."""
    try:
        fd = os.open(data_dir / DEV_KEY_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return ""
    with os.fdopen(fd, encoding="ascii") as handle:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
        return handle.read().strip()


def store_dev_key(data_dir: Path, key: str) -> None:
    """Keeps `key` (0600) for the next `keel up` on `data_dir`; written to a
    private temporary file, then renamed over the old one."""
    _write_private(data_dir / DEV_KEY_FILE, key, os.replace)
