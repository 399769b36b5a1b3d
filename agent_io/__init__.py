"""The agent's outside world: model providers and tools.

    agent_io.providers  the offline scripted model, OpenAI-compatible chat
                        completions and Anthropic messages, behind one Provider
    agent_io.tools      built-ins, MCP servers and gRPC ToolServices, behind one
                        registry per tenant and loadout revision
    agent_io.loadout    what an attempt reads of a tenant's loadout document

A leaf: both the runner and the compaction service depend on it, and it
imports neither of them, nor the kernel or the edge (tests/test_import_directions.py
pins the allowed directions). It may use the pure compaction policy and the
settings and secret policy of services.common.
"""
