"""A benchmark's own child processes (a `keel up`, a ledger, a tool server):
started until they say they serve, and stopped without leaving one behind."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence


def start_until_ready(
    command: Sequence[str], env: Mapping[str, str] | None, ready: str, what: str
) -> tuple[subprocess.Popen[str], str]:
    """Starts `command` (stdout read, stderr dropped) and reads its output up
    to the first line that starts with `ready`: the process, and that line.
    Raises RuntimeError, naming `what`, when it ends its output before."""
    proc = subprocess.Popen(
        list(command),
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(ready):
            return proc, line
    raise RuntimeError(f"{what} did not start")


def stop_child(proc: subprocess.Popen[str], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout_s`; its
    stdout pipe is closed either way."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
