"""An edge whose kernel is stopped refuses every request that needs it: each
refusal is counted (`keel_edge_requests_total{status="503"}`), and the log
says once that the kernel is away and once that it is back (edge.refusals,
the wake-ups of edge.inputs), never a line per refused request."""

from __future__ import annotations

import logging

import pytest

from kernel import KernelServer
from tests.support.edge_stack import Stack
from tests.support.polling import eventually

DEADLINE_S = 60.0
REFUSED = 3


def warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What the edge said at WARNING or above (its revocation watch says at
    INFO that it reconnects, with a backoff of its own)."""
    return [r for r in caplog.records if r.name.startswith("edge") and r.levelno >= logging.WARNING]


async def test_an_edge_whose_kernel_is_away_says_so_once_and_counts_its_refusals(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    session = await stack.new_session()
    cluster = stack.cluster
    address = cluster.kernel_server.target
    caplog.set_level(logging.INFO, logger="edge")
    await cluster.kernel_server.stop(grace=0.1)
    try:
        for number in range(REFUSED):
            posted = await stack.post_input(session, f"hello {number}", f"r-{number}")
            assert posted.status_code == 503, posted.text
            status = await stack.http.get("/v1/runtime/status")
            assert status.status_code == 503, status.text
        refused = [r.getMessage() for r in warnings(caplog)]
        assert len(refused) == 2, refused
        assert sum("unreachable" in line for line in refused) == 2, refused
    finally:
        cluster.kernel_server = await KernelServer(
            cluster.settings, address, ledger_target=cluster.ledger_server.target
        ).start()

    async def back() -> list[str] | None:
        answered = await stack.post_input(session, "hello again", "r-again")
        said = [r.getMessage() for r in warnings(caplog)]
        backs = [line for line in said if "is back after" in line]
        return backs if answered.status_code in (200, 202) and len(backs) == 2 else None

    backs = await eventually(back, "the edge to say its kernel is back", DEADLINE_S)
    assert any(f"; {REFUSED} requests refused (503) meanwhile" in line for line in backs), backs
    # Each input posted while the kernel was away is committed, not woken.
    assert any("wake-ups of committed inputs failed meanwhile" in line for line in backs), backs
    said = warnings(caplog)
    assert len(said) == 4 and not any(r.exc_info for r in said), [r.getMessage() for r in said]
