"""Tools an agent can call: built-ins, MCP servers and gRPC ToolServices.

agent_io.tools.base      ToolSpec, ToolCall, ToolOutcome, the ToolSource protocol
agent_io.tools.builtin   clock, sleep, counter (and the counter's effect store)
agent_io.tools.registry  the tools of one tenant's loadout revision
"""

from agent_io.tools.base import ToolCall, ToolOutcome, ToolSource, ToolSpec, idempotency_key
from agent_io.tools.builtin import CounterStore, Tool, builtin_tools
from agent_io.tools.registry import ToolRegistry

__all__ = [
    "CounterStore",
    "Tool",
    "ToolCall",
    "ToolOutcome",
    "ToolRegistry",
    "ToolSource",
    "ToolSpec",
    "builtin_tools",
    "idempotency_key",
]
