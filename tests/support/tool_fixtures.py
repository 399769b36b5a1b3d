"""Tool servers for runner tests, and what they recorded.

`start_tool_servers()` gives a tenant two tool sources that honour the
idempotency key: the MCP test server over stdio (`files`, a child process of
each runner that uses it) and the gRPC test ToolService (`billing`, a child
process of the test). `ToolServers` holds the operator policy that lets
runners reach them, the loadout naming them, and reads what each server
recorded: how often an effect was applied, and the idempotency key of every
execution as the server's own log has it.

The /proc probes at the end tell a runner's child processes apart from the
orphans a killed runner may leave behind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.secrets import SecretPolicy
from tests.support import mcp_server, tool_service
from tests.support.tool_service import RunningToolService

MCP_SOURCE = "files"
GRPC_SOURCE = "billing"
SOURCES = (MCP_SOURCE, GRPC_SOURCE)
# Both servers log each execution of `apply` as `... idempotencyKey=<key> ...`.
_LOGGED_KEY = re.compile(r"\bapply key=\S+ idempotencyKey=(\S+)")


@dataclass(frozen=True)
class ToolServers:
    """A tenant's MCP stdio server and gRPC ToolService, as runners see them."""

    tenant: str
    token: str
    mcp_command: tuple[str, ...]
    mcp_effects: Path
    mcp_log: Path
    grpc: RunningToolService

    @property
    def policy(self) -> SecretPolicy:
        """The operator allows exactly this command and this target, for the tenant."""
        return (
            SecretPolicy()
            .with_command(self.mcp_command, self.tenant)
            .with_tool_target(self.grpc.address, self.tenant)
        )

    def runner_env(self) -> dict[str, str]:
        """What a runner process needs in its environment to call both sources."""
        return {**self.policy.to_env(), "KEEL_TOOL_TOKEN": self.token}

    def loadout(self) -> dict[str, Any]:
        mcp = {
            "source": "mcp",
            "name": MCP_SOURCE,
            "transport": "stdio",
            "command": list(self.mcp_command),
        }
        grpc = {"source": "grpc", "name": GRPC_SOURCE, "target": self.grpc.address}
        return {"tools": [mcp, grpc]}

    def logged_keys(self, source: str) -> list[str]:
        """The idempotency key of every `apply` the source's server executed,
        in order, from the server's own log (the MCP server's `--log` file; the
        ToolService's stderr, which the test reads)."""
        if source == MCP_SOURCE:
            text = self.mcp_log.read_text() if self.mcp_log.exists() else ""
            lines = text.splitlines()
        else:
            lines = list(self.grpc.process.lines)
        return [m.group(1) for line in lines if (m := _LOGGED_KEY.search(line))]

    def times_applied(self, source: str, idempotency_key: str, key: str) -> int:
        """How often the effect of `apply {key}` under `idempotency_key` was applied."""
        if source == MCP_SOURCE:
            applied, _ = mcp_server.read_effects(self.mcp_effects).get(idempotency_key, (0, 0))
            return applied
        # The ToolService counts by the tool's own `key` argument.
        count: int = tool_service.read_effects(self.grpc.effects)["applied"].get(key, 0)
        return count

    def stop(self) -> None:
        self.grpc.stop()


def start_tool_servers(directory: Path, tenant: str, token: str) -> ToolServers:
    """Starts the ToolService (the MCP server starts with each runner's first use)."""
    effects = directory / "mcp-effects.sqlite3"
    log = directory / "mcp-server.log"
    command = mcp_server.server_command("--effects", str(effects), "--log", str(log))
    grpc = tool_service.launch(directory / "grpc-effects.json", token=token)
    return ToolServers(tenant, token, command, effects, log, grpc)


# -- /proc probes --


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running (a zombie has exited; only its entry waits to be reaped)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP), until a SIGCONT."""
    stat = _stat(pid)
    return stat is not None and stat[0] == "T"


def parent_of(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[1]


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid`."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            child = int(entry.name)
            if alive(child) and parent_of(child) == pid:
                found.append(child)
    return found


def mcp_children_of(pid: int) -> list[int]:
    """The MCP test servers among `pid`'s live children."""
    return [c for c in children_of(pid) if "tests.support.mcp_server" in command_line(c)]
