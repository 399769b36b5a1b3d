"""Replicas starting at the same moment, for races between processes' start-ups."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

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
