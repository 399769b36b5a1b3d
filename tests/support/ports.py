"""Free TCP ports on loopback for servers a test must name before they run."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the kernel may hand it out again later,
    so bind it soon)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
