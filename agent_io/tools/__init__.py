"""Tools an agent can call: built-ins, MCP servers and gRPC ToolServices.

agent_io.tools.base         ToolSpec, ToolCall, ToolOutcome, the ToolSource protocol
agent_io.tools.builtin      clock, sleep, counter (and the counter's effect store)
agent_io.tools.registry     the tools of one tenant's loadout revision: naming,
                            routing, argument checks, timeouts, result limits
agent_io.tools.catalog      one registry per tenant and revision, and when its
                            sources are closed
agent_io.tools.factory      a loadout's sources, built under the operator's policy
agent_io.tools.mcp          MCP servers (stdio children, streamable HTTP)
agent_io.tools.grpc_source  internal gRPC ToolServices

The factory (and with it the MCP SDK) is imported by whoever builds sources,
not by this package, so reading a ToolCall does not load every client.
"""

from agent_io.tools.base import (
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_TOOL_TIMEOUT_S,
    ToolCall,
    ToolOutcome,
    ToolSource,
    ToolSpec,
    idempotency_key,
    limit_result,
)
from agent_io.tools.builtin import BUILTIN_NAMES, BuiltinSource, CounterStore, Tool, builtin_tools
from agent_io.tools.catalog import ToolCatalog
from agent_io.tools.registry import SourceRefused, SourceSettings, SourceSlot, ToolRegistry

__all__ = [
    "BUILTIN_NAMES",
    "DEFAULT_MAX_RESULT_BYTES",
    "DEFAULT_TOOL_TIMEOUT_S",
    "BuiltinSource",
    "CounterStore",
    "SourceRefused",
    "SourceSettings",
    "SourceSlot",
    "Tool",
    "ToolCall",
    "ToolCatalog",
    "ToolOutcome",
    "ToolRegistry",
    "ToolSource",
    "ToolSpec",
    "builtin_tools",
    "idempotency_key",
    "limit_result",
]
