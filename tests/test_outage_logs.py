"""An outage is said once when it begins, once when it ends, and summed up
between: never a line (or a traceback) per failed attempt.

`OutageLog` (services.common.outage_log) is driven by an injected clock. A
real runner process whose kernel process is SIGKILLed, then started again on
the same port, logs one line when the kernel goes away and one when it is
back, however many claims failed meanwhile (its metrics port counts them:
the test waits for several before it brings the kernel back). The edge's
side is tests/edge/test_refusal_logs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import Settings
from services.common.outage_log import OutageLog
from services.ledger import LedgerServer
from tests.support.databases import settings_env
from tests.support.polling import eventually
from tests.support.ports import free_port
from tests.support.processes import ChildProcess

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow

KEEL = str(Path(sys.executable).with_name("keel"))
# Claims that must fail, quietly, before the kernel comes back.
FAILED_CLAIMS = 5
DEADLINE_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines() -> Iterator[tuple[logging.Logger, list[str]]]:
    logger = logging.getLogger("keel.test.outage")
    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Collect(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield logger, said
    finally:
        logger.removeHandler(handler)


def test_an_outage_is_said_when_it_begins_every_30_s_and_when_it_ends(
    lines: tuple[logging.Logger, list[str]],
) -> None:
    logger, said = lines
    clock = Clock()
    outage = OutageLog(logger, "kernel", attempts="claims failed", clock=clock)
    outage.succeeded()
    assert said == [] and not outage.away

    # Two claims a second for 75 s: three lines, not 150.
    for _ in range(150):
        outage.failed(ConnectionError("connection refused"))
        clock.now += 0.5
    assert outage.away and outage.failures == 150
    assert said == [
        "kernel unreachable: connection refused (said again every 30 s until it is back)",
        "kernel still unreachable for 30 s; 61 claims failed",
        "kernel still unreachable for 60 s; 121 claims failed",
    ]
    outage.succeeded()
    outage.succeeded()
    assert said[3:] == ["kernel is back after 75 s; 150 claims failed meanwhile"]
    assert not outage.away and outage.failures == 0

    # The next outage is a new one, said again from its start.
    outage.failed("refused")
    assert said[4:] == ["kernel unreachable: refused (said again every 30 s until it is back)"]


def claim_failures(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "keel_runner_claim_failures_total"
        and sample.labels.get("why") == "unavailable"
    )


@contextlib.asynccontextmanager
async def ledger_of(settings: Settings) -> AsyncIterator[LedgerServer]:
    ledger = await LedgerServer(settings).start()
    try:
        yield ledger
    finally:
        await ledger.stop(grace=0.2)


async def test_a_runner_says_once_that_its_kernel_is_away_and_once_that_it_is_back(
    sqlite_settings: Settings,
) -> None:
    settings = sqlite_settings
    env = settings_env(settings)
    kernel_address = f"127.0.0.1:{free_port()}"
    metrics_port = free_port()
    async with ledger_of(settings) as ledger:
        kernel_args = [KEEL, "kernel", "--address", kernel_address, "--ledger", ledger.target]
        kernel = ChildProcess(kernel_args, env=env)
        runner_args = [KEEL, "runner", "--ledger", ledger.target, "--kernel", kernel_address]
        runner: ChildProcess | None = None
        try:
            # A runner registers with its kernel at start: the kernel first.
            await asyncio.to_thread(kernel.wait_listening)
            runner = ChildProcess([*runner_args, "--metrics-port", str(metrics_port)], env=env)
            await asyncio.to_thread(runner.wait_listening)
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            await runner.line(lambda line: metrics_url in line)
            before = len(runner.lines)
            kernel.kill()

            async def many_failed() -> bool | None:
                failed = await asyncio.to_thread(claim_failures, metrics_url)
                return True if failed >= FAILED_CLAIMS else None

            await eventually(many_failed, f"{FAILED_CLAIMS} failed claims", DEADLINE_S)
            kernel = ChildProcess(kernel_args, env=env)
            await asyncio.to_thread(kernel.wait_listening)
            back = await runner.line(lambda line: "kernel is back after" in line, DEADLINE_S)
            said = runner.lines[before:]
        finally:
            if runner is not None:
                runner.kill()
            kernel.kill()
    output = "\n".join(said)
    assert "Traceback" not in output, output
    assert sum("kernel unreachable" in line for line in said) == 1, output
    assert sum("kernel is back after" in line for line in said) == 1, output
    assert len(said) <= 4, output
    # The "back" line counts what was not said one by one.
    failed = int(back.split("; ")[1].split(" claims failed")[0])
    assert failed >= FAILED_CLAIMS, back
