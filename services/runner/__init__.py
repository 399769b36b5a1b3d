"""The runner: claims sessions and works on them, recovery-correct.

Public surface::

    RunnerServer, run_runner   a runtime plus its gRPC service
    Runtime                    the claim loop, drain and status
    RunnerConfig               frozen settings
    Attempt, CompactionHook    one claim's work; where compaction plugs in
    RunnerError …              the error tree (services.runner.errors)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_io.loadout import Loadout
    from services.runner.attempt import Attempt, CompactionHook
    from services.runner.config import RunnerConfig
    from services.runner.errors import Draining, InvalidDrain, RunnerError, SessionNotOwned
    from services.runner.runtime import Runtime
    from services.runner.server import RunnerServer, run_runner

__all__ = [
    "Attempt",
    "CompactionHook",
    "Draining",
    "InvalidDrain",
    "Loadout",
    "RunnerConfig",
    "RunnerError",
    "RunnerServer",
    "Runtime",
    "SessionNotOwned",
    "run_runner",
]

# name -> the module that defines it. Nothing is imported until a name is
# first read (PEP 562), so importing one small module of this package does
# not load the whole service; TYPE_CHECKING gives mypy and IDEs the names.
_EXPORTS: dict[str, str] = {
    "Loadout": "agent_io.loadout",
    "Attempt": "services.runner.attempt",
    "CompactionHook": "services.runner.attempt",
    "RunnerConfig": "services.runner.config",
    "Draining": "services.runner.errors",
    "InvalidDrain": "services.runner.errors",
    "RunnerError": "services.runner.errors",
    "SessionNotOwned": "services.runner.errors",
    "Runtime": "services.runner.runtime",
    "RunnerServer": "services.runner.server",
    "run_runner": "services.runner.server",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
