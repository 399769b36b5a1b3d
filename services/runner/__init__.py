"""The runner: claims sessions and works on them, recovery-correct.

Public surface::

    RunnerServer, run_runner   a runtime plus its gRPC service
    Runtime                    the claim loop, drain and status
    RunnerConfig               frozen settings
    Attempt, CompactionHook    one claim's work; where compaction plugs in
    RunnerError …              the error tree (services.runner.errors)
"""

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
