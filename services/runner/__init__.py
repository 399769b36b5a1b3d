"""The runner: claims sessions and works on them, recovery-correct.

Public surface::

    RunnerServer, run_runner   a runtime plus its gRPC service
    Runtime                    the claim loop, drain and status
    RunnerConfig               frozen settings
    Attempt, CompactionHook    one claim's work; where compaction plugs in
    RunnerError …              the error tree (services.runner.errors)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy_exports import lazy_exports

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

# name -> the module that defines it, imported when the name is first read
# (services/common/lazy_exports.py).
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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
