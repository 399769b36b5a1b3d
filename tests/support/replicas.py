"""Replicas starting at the same moment, for races between processes' start-ups,
and replicas of the ledger as processes of their own."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from services.common.config import Settings
from tests.support.databases import settings_env
from tests.support.processes import ChildProcess

T = TypeVar("T")


def start_at_once(factory: Callable[[], T], count: int = 4) -> tuple[list[T], list[BaseException]]:
    """Runs `factory` on `count` threads released together, as replicas
    starting at the same moment; returns what they built and what they raised."""
    built: list[T] = []
    errors: list[BaseException] = []
    gate = threading.Barrier(count)

    def start() -> None:
        gate.wait()
        try:
            built.append(factory())
        except BaseException as exc:  # reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return built, errors


@contextmanager
def ledger_processes(settings: Settings, count: int = 2) -> Iterator[list[str]]:
    """`count` ledger processes on the database of `settings`, each on a port
    of its own: yields their addresses once all listen, kills them after."""
    env = settings_env(settings)
    children = [
        ChildProcess.python("-m", "services.ledger", "--address", "127.0.0.1:0", env=env)
        for _ in range(count)
    ]
    try:
        yield [child.wait_listening() for child in children]
    finally:
        for child in children:
            child.kill()
