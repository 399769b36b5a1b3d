"""The ledger's circuit breaker (services.common.pg_pool.OutageGate): while
the database is known to be away every caller is refused at once but one,
the probe, whose answer opens or re-closes the gate for all."""

from __future__ import annotations

import pytest

from services.common.errors import DatabaseUnavailable
from services.common.pg_pool import OutageGate


def test_after_a_failure_one_probe_goes_through_and_the_rest_are_refused() -> None:
    gate = OutageGate("test store", pause_s=0.0)
    gate.check()  # open: nothing known against the database
    gate.failed()
    gate.check()  # the probe
    for _ in range(3):
        with pytest.raises(DatabaseUnavailable):
            gate.check()
    gate.succeeded()
    gate.check()
    gate.check()


def test_a_failed_probe_closes_the_gate_for_the_pause() -> None:
    gate = OutageGate("test store", pause_s=3600.0)
    gate.failed()
    with pytest.raises(DatabaseUnavailable, match="test store unavailable"):
        gate.check()


def test_a_probe_that_learnt_nothing_lets_the_next_caller_probe() -> None:
    gate = OutageGate("test store", pause_s=0.0)
    gate.failed()
    gate.check()
    gate.released()
    gate.check()  # the next probe
    with pytest.raises(DatabaseUnavailable):
        gate.check()


def test_with_a_probe_of_its_own_the_gate_asks_the_database_not_the_caller() -> None:
    database_up = False
    probes = 0

    def probe() -> None:
        nonlocal probes
        probes += 1
        if not database_up:
            raise OSError("connection refused")

    gate = OutageGate("test store", pause_s=0.0, probe=probe)
    gate.check()
    assert probes == 0  # open: the probe is only for a gate that failed
    gate.failed()
    with pytest.raises(DatabaseUnavailable):
        gate.check()  # the probe failed: refused, and closed again
    database_up = True
    gate.check()  # the probe answered: open for everyone
    gate.check()
    assert probes == 2
