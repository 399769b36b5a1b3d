"""The tools one loadout enables, with a hard timeout on every call."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from agent_io.tools.base import DEFAULT_TOOL_TIMEOUT_S, ToolCall, ToolOutcome, ToolSpec
from agent_io.tools.builtin import Tool

__all__ = ["ToolRegistry"]


class ToolRegistry:
    """The tools one loadout enables, with a hard timeout on every call."""

    def __init__(
        self, tools: Mapping[str, Tool], timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    ) -> None:
        self._tools = dict(tools)
        self._timeout_s = timeout_s

    @classmethod
    def for_loadout(
        cls, names: Sequence[str], available: Mapping[str, Tool], timeout_s: float
    ) -> ToolRegistry:
        return cls({n: available[n] for n in names if n in available}, timeout_s)

    def requires_approval(self, name: str) -> bool:
        """Whether a person must approve a call of `name` before it runs."""
        return False

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        return tuple(tool.spec for tool in self._tools.values())

    async def run(self, call: ToolCall) -> ToolOutcome:
        """Runs one call; every failure becomes an error result, never a crash."""
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolOutcome(f"unknown tool {call.name!r}", is_error=True)
        try:
            return await asyncio.wait_for(tool.run(call), self._timeout_s)
        except TimeoutError:
            return ToolOutcome(f"{call.name} timed out after {self._timeout_s:g} s", is_error=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a tool's bug is the agent's information, not our crash
            return ToolOutcome(f"{call.name} failed: {exc}", is_error=True)
