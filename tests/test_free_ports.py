"""The ports `keel up --processes` chooses for its services (and tests for
their servers) lie below the kernel's ephemeral range.

A port from bind(0) is inside that range: between the choice and the
service's own bind (after the services before it are ready), any outgoing
connection, such as a pool's connection to PostgreSQL, may be given it, and
`keel up` then stops with "port … is in use". Below the range only an
explicit bind can take it.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.cli import up_ports


def ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_free_ports_are_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    low, _ = ephemeral_range()
    ports = [up_ports.free_port() for _ in range(200)]
    assert all(port < low for port in ports), [p for p in ports if p >= low]
    assert len(set(ports)) == len(ports)
    for port in ports[:20]:
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen(1)


def test_a_port_something_listens_on_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    low, _ = ephemeral_range()
    monkeypatch.setattr(up_ports, "_FREE_SPAN", 40)
    monkeypatch.setattr(up_ports, "_given", set())
    held: list[socket.socket] = []
    try:
        for port in range(low - 40, low - 10):  # all but ten of the span listen
            server = socket.socket()
            try:
                server.bind(("127.0.0.1", port))
            except OSError:
                server.close()  # something of this machine's holds it: fine too
                continue
            server.listen(1)
            held.append(server)
        chosen = {up_ports.free_port() for _ in range(3)}
    finally:
        for server in held:
            server.close()
    assert len(chosen) == 3 and all(low - 10 <= port < low for port in chosen), chosen
