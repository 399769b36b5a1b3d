"""Free TCP ports on loopback for servers a test must name before they run."""

from __future__ import annotations

from services.cli import up_ports


def free_port() -> int:
    """A port nothing listens on now, below the kernel's ephemeral range so
    that no outgoing connection takes it before the server binds it."""
    return up_ports.free_port()
