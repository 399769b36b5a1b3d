"""`keel up`'s default layout follows its database: on PostgreSQL a process
per service (the layout that answers more turns a second), on SQLite one
process (`make run`); `--embedded` and `--processes` choose either way.

The layout is read from outside: the OS processes `keel up` started, by
their command lines, and a turn answered through the edge either way."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.databases import drop_schema
from tests.support.keel_up import RunningKeel, keel_up
from tests.support.polling import eventually

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow

KEY = "layout-test-key-0123456789"


def service_children(keel: RunningKeel) -> list[str]:
    """The services `keel up` runs as processes of its own (`keel ledger`,
    `keel kernel`, …), by the subcommand in each child's command line."""
    pid = keel.child.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        children = [int(child) for child in listing.read().split()]
    services: list[str] = []
    for child in children:
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone between the listing and the read
        words = [word.decode() for word in argv if word]
        if "services.cli.main" in words:
            services.append(words[words.index("services.cli.main") + 1])
    return sorted(services)


async def a_turn_is_answered(keel: RunningKeel) -> None:
    async with httpx.AsyncClient(
        base_url=keel.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    ) as http:
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        posted = await http.post(f"/v1/sessions/{session}/inputs", json={"text": "hello layout"})
        assert posted.status_code == 202, posted.text
        seq = posted.json()["seq"]

        async def answered() -> bool | None:
            page = await http.get(f"/v1/sessions/{session}/events?format=json")
            facts = page.json()["facts"]
            done = any(
                f["kind"] == "assistant" and seq in f["data"].get("inputSeqs", []) for f in facts
            )
            return True if done else None

        await eventually(answered, "the input to be answered")


@pytest.fixture
def pg_env(postgres_url: str) -> Iterator[dict[str, str]]:
    schema = f"keel_t_{uuid.uuid4().hex[:12]}"
    yield {"KEEL_DATABASE_URL": postgres_url, "KEEL_PG_SCHEMA": schema}
    drop_schema(postgres_url, schema)


async def test_on_postgresql_keel_up_runs_a_process_per_service(
    tmp_path: Path, pg_env: dict[str, str]
) -> None:
    with keel_up(tmp_path / "data", KEY, env=pg_env) as keel:
        assert "starting Keel as separate processes:" in keel.child.output()
        assert service_children(keel) == ["compaction", "edge", "kernel", "ledger", "runner"]
        await a_turn_is_answered(keel)


async def test_on_postgresql_embedded_keeps_every_service_in_one_process(
    tmp_path: Path, pg_env: dict[str, str]
) -> None:
    with keel_up(tmp_path / "data", KEY, "--embedded", env=pg_env) as keel:
        assert service_children(keel) == []
        await a_turn_is_answered(keel)


async def test_on_sqlite_keel_up_stays_one_process_unless_asked(tmp_path: Path) -> None:
    with keel_up(tmp_path / "one", KEY) as keel:
        assert service_children(keel) == []
        await a_turn_is_answered(keel)
    with keel_up(tmp_path / "split", KEY, "--processes") as keel:
        assert "ledger" in service_children(keel)
        await a_turn_is_answered(keel)
