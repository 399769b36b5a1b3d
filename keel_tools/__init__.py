"""Keel's helper for teams' own tools: plain Python functions served as a
`keel.tools.v1.ToolService` that Keel's runners call (see keel_tools.server).

    from keel_tools import serve_tools

    def lookup(order_id: str) -> dict[str, str]:
        \"\"\"The state of one order.\"\"\"
        return {"order_id": order_id, "state": "shipped"}

    serve_tools([lookup], port=7000)
"""

from keel_tools.server import (
    TOKEN_ENV,
    TOKEN_METADATA,
    ToolDefinition,
    ToolServer,
    UnsafeToolServer,
    define_tool,
    schema_of,
    serve_tools,
)

__all__ = [
    "TOKEN_ENV",
    "TOKEN_METADATA",
    "ToolDefinition",
    "ToolServer",
    "UnsafeToolServer",
    "define_tool",
    "schema_of",
    "serve_tools",
]
