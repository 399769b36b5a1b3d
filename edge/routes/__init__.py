"""The edge's HTTP routes, one module per part of the API (SPEC §7)."""
