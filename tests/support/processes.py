"""Real OS processes for tests: start, wait until ready, SIGKILL, reap."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"listening on ([\w.\-\[\]:]+:\d+)")


class ChildProcess:
    """A child whose stdout lines are collected by a reader thread."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.proc = subprocess.Popen(
            self.args,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def python(cls, *args: str, env: dict[str, str] | None = None) -> ChildProcess:
        return cls([sys.executable, *args], env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_line(self, predicate: Callable[[str], bool], timeout: float = 30.0) -> str:
        """The first output line matching `predicate`; fails at the deadline."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if predicate(line):
                        return line
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and seen == len(self.lines)):
                    break
                self._changed.wait(min(remaining, 0.5))
        raise AssertionError(
            f"{self.args!r} printed no matching line within {timeout}s "
            f"(exit={self.proc.poll()}); output:\n" + "\n".join(self.lines[-40:])
        )

    async def line(self, predicate: Callable[[str], bool], deadline_s: float = 30.0) -> str:
        """`wait_for_line` without blocking the event loop (servers may share it)."""
        return await asyncio.to_thread(self.wait_for_line, predicate, deadline_s)

    def wait_listening(self, timeout: float = 30.0) -> str:
        line = self.wait_for_line(lambda text: bool(_LISTENING.search(text)), timeout)
        match = _LISTENING.search(line)
        assert match is not None
        return match.group(1)

    def send_line(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """A real SIGKILL, then reap."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(OSError):
                    pipe.close()

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        self._close_pipes()
        return code

    def terminate_or_kill(self, timeout: float = 30.0) -> None:
        """`terminate`; when that fails (the child outlived `timeout`), SIGKILL
        it and raise what failed: a child that does not stop is a finding."""
        try:
            self.terminate(timeout=timeout)
        except Exception:
            self.kill()
            raise

    def output(self) -> str:
        return "\n".join(self.lines)
