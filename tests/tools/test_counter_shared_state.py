"""The built-in `counter` applies its effect once per idempotency key across
runners that share a PostgreSQL deployment but not a data dir (pods with an
`emptyDir` each).

Runner A (data dir A) answers a first `counter` call, then runs a second
one and is SIGKILLed right after the call ran, before its result was
committed (fault point `mid_tool`). Runner B (data dir B) takes the session
over and calls again with the same idempotency key: the effect is not
applied again (the result B commits is the value A's run produced), and the
deployment's store counts the extra execution.
"""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.common.config import Settings
from services.runner.tool_state import counter_store
from tests.support.cluster import Cluster, running_cluster
from tests.support.polling import eventually

SESSION = "shared-counter"
CALL = '/tool counter {"key": "K"}'
DEADLINE_S = 60.0


@pytest.fixture
async def cluster(pg_settings: Settings) -> AsyncIterator[Cluster]:
    async with running_cluster(pg_settings, backoff_base_ms=100, max_attempts=3) as running:
        yield running


async def results(cluster: Cluster) -> list[dict[str, object]]:
    facts = await cluster.facts(SESSION)
    return [json.loads(f.data["content"]) for f in facts if f.kind == "tool_result"]


@pytest.mark.slow
async def test_a_call_redone_by_a_runner_of_another_data_dir_is_not_applied_again(
    cluster: Cluster, tmp_path: Path
) -> None:
    await cluster.new_session(SESSION)
    first = cluster.start_runner(KEEL_DATA_DIR=str(tmp_path / "a"), KEEL_FAULT_POINT="mid_tool@2")
    await cluster.runner_ready(first)
    await cluster.send(SESSION, CALL, "r1")
    await cluster.settled(SESSION, deadline_s=DEADLINE_S)
    assert await results(cluster) == [{"key": "K", "value": 1}]

    # The second call runs (value 2) and its runner dies before the result is committed.
    await cluster.send(SESSION, CALL, "r2")
    await first.line(lambda line: line == "FAULT mid_tool", deadline_s=DEADLINE_S)
    first.kill()
    assert first.proc.returncode == -signal.SIGKILL

    successor = cluster.start_runner(KEEL_DATA_DIR=str(tmp_path / "b"))
    await cluster.runner_ready(successor)
    await cluster.settled(SESSION, deadline_s=DEADLINE_S)

    async def both_results() -> list[dict[str, object]] | None:
        found = await results(cluster)
        return found if len(found) == 2 else None

    found = await eventually(both_results, "both tool results", DEADLINE_S)
    # The redone call found its effect: the value A's run produced, not a new one.
    assert found == [{"key": "K", "value": 1}, {"key": "K", "value": 2}]
    counters = counter_store(cluster.settings)
    assert counters.value("K") == 2, "the redone call applied its effect again"
    assert counters.executions("K") == 3, "the redone call ran (at least once), once more"
    assert not (tmp_path / "b" / "counter.sqlite3").exists()
