"""A data dir only its owner can read, and the internal token `keel up` keeps in it.

Keel's commands run with umask 077 (services/cli/main.py), so whatever they
create (SQLite files, blobs, the discovery file, the token) is 0600 in
folders of 0700; a data dir made before that is closed again when a command
starts on it.

`keel up` authenticates its own services to each other with a random token
made once per data dir (`<data dir>/internal-token`, 0600) and reused on
restart, so a restarted `keel up --processes` and its still-running children
agree. An explicit KEEL_INTERNAL_TOKEN wins over the file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from services.common.config import Settings
from services.common.internal_auth import MIN_TOKEN_CHARS, InternalAuthError

PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
TOKEN_FILE = "internal-token"


def close_data_dir(data_dir: Path) -> None:
    """Makes an existing data dir 0700 (one made under a looser umask, or by
    an older Keel); a missing one is left to be created under umask 077."""
    with contextlib.suppress(FileNotFoundError):
        if data_dir.is_dir() and stat.S_IMODE(data_dir.stat().st_mode) != PRIVATE_DIR_MODE:
            data_dir.chmod(PRIVATE_DIR_MODE)


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
    partial = data_dir / f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(token + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(partial, path)
        except FileExistsError:
            return _read_token(path)
        return token
    finally:
        partial.unlink(missing_ok=True)


def with_internal_token(settings: Settings) -> Settings:
    """`settings` with an internal token: its own (KEEL_INTERNAL_TOKEN) or
    the data dir's."""
    if settings.internal_token:
        return settings
    return settings.with_overrides(internal_token=data_dir_token(Path(settings.data_dir)))
