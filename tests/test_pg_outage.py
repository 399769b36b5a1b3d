"""PostgreSQL goes away under load and comes back: `keel up --processes` on a
cluster of the test's own (tests/support/throwaway_pg.py), 20 sessions
taking inputs, some SSE streams open.

Two outages: one shorter than the lease TTL and one longer, so that every
lease held when it began has expired when it ends. The TTL is cut to
LEASE_MS (the default 30 s would make the long outage 45 s); the outages
scale with it: SHORT_OUTAGE_S < TTL < LONG_OUTAGE_S. KEEL_OUTAGE_LEASE_MS=30000
runs it at production scale (5 s and 45 s; scripts/acceptance-all.sh does).

During an outage an input POST is refused with 503 and Retry-After (never a
500, never a 202 for an input that is not durable), the public gRPC API
answers UNAVAILABLE with a RetryInfo, and an SSE stream stays open or ends
cleanly (the client resumes from its Last-Event-ID). Afterwards every service
is back on its own: no child of the supervisor was restarted, every input
acknowledged with 202 is answered exactly once, a POST refused during the
outage and sent again with its requestId commits once, and one acknowledged
before an outage and sent again after it is a duplicate (200, same seq).

Prints the recovery figures: from PostgreSQL's return to the first answer
any session got, and to a new input's 202 and its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from keel_client import AsyncKeelClient
from keel_client import Unavailable as ClientUnavailable
from kernel.database import Database
from services.common.config import Settings
from services.common.errors import DatabaseUnavailable
from services.ledger import facts as F
from services.ledger.store import LedgerStore
from services.session_invariants import check_session
from tests.support.keel_up import RunningKeel, keel_up
from tests.support.polling import eventually
from tests.support.throwaway_pg import ThrowawayPostgres, throwaway_postgres

KEY = "pg-outage-key-0123456789abcdef"
SESSIONS = 20
SSE_STREAMS = 5
LEASE_MS = int(os.environ.get("KEEL_OUTAGE_LEASE_MS", "6000"))
# At least this long: what the test checks during an outage (the first
# refusal waits out the event store's retries, ~4 s) may make it longer.
SHORT_OUTAGE_S = min(5.0, LEASE_MS / 3000)
LONG_OUTAGE_S = LEASE_MS * 1.5 / 1000
# How long each session waits between two inputs: steady load, not a flood.
PACE_S = 0.25
SETTLE_DEADLINE_S = 60.0 + 2 * LEASE_MS / 1000
POLL_S = 0.1
T = TypeVar("T")
_SPAWNED = re.compile(r"\s+([\w-]+): pid \d+$")


@dataclass
class Tally:
    """What clients saw: acknowledged inputs, refusals, anything unexpected."""

    acknowledged: dict[str, dict[str, int]] = field(default_factory=dict)
    # requestIds whose POST was refused or got no answer: sent again later.
    unsettled: dict[str, set[str]] = field(default_factory=dict)
    refusals: int = 0
    # POSTs that got no answer at all (the client's timeout ended them).
    unanswered: int = 0
    refusals_without_retry_after: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    sse_endings: list[str] = field(default_factory=list)


class Load:
    """Each session posts `/slow` inputs with request ids, one after another."""

    def __init__(self, http: httpx.AsyncClient, sessions: list[str], tally: Tally) -> None:
        self.http = http
        self.sessions = sessions
        self.tally = tally
        self.running = True
        self.outage = False
        self.refused_in_outage = asyncio.Event()
        # When PostgreSQL took connections again after each outage (Unix ms,
        # the clock the ledger stamps facts with: same host).
        self.back_at_ms: list[int] = []
        self.outages_s: list[float] = []

    async def post(self, session: str, request_id: str) -> int | None:
        """One input POST: its status, or None when no answer came."""
        body = {"text": f"/slow 0.2 {request_id}", "requestId": request_id}
        try:
            response = await self.http.post(f"/v1/sessions/{session}/inputs", json=body)
        except httpx.TransportError:
            self.tally.unanswered += 1
            self.tally.unsettled.setdefault(session, set()).add(request_id)
            return None
        if response.status_code in (200, 202):
            self.tally.acknowledged.setdefault(session, {})[request_id] = response.json()["seq"]
            self.tally.unsettled.get(session, set()).discard(request_id)
        elif response.status_code == 503:
            self.tally.refusals += 1
            if "retry-after" not in response.headers:
                self.tally.refusals_without_retry_after.append(response.text[:200])
            self.tally.unsettled.setdefault(session, set()).add(request_id)
            if self.outage:
                self.refused_in_outage.set()
        else:
            self.tally.unexpected.append(
                f"POST {session} {request_id}: {response.status_code} {response.text[:300]}"
            )
        return response.status_code

    async def session_loop(self, session: str) -> None:
        n = 0
        while self.running:
            n += 1
            await self.post(session, f"{session}-in-{n}")
            await asyncio.sleep(PACE_S)  # pacing the load, not synchronizing


class SseClient:
    """One SSE client as a browser's EventSource behaves: on a clean end, or
    a 503 when it reconnects, it comes back after the server's Retry-After
    with `Last-Event-ID`, so it should see every fact once, in order."""

    def __init__(self, http: httpx.AsyncClient, session: str, tally: Tally) -> None:
        self.http = http
        self.session = session
        self.tally = tally
        self.seqs: list[int] = []

    async def run(self) -> None:
        while True:
            headers = {"Last-Event-ID": str(self.seqs[-1])} if self.seqs else {}
            wait_s = 0.0
            try:
                await self._read(headers)
            except httpx.RemoteProtocolError as error:
                # A stream cut mid-chunk is not an end a client can trust.
                self.tally.sse_endings.append(f"{self.session}: cut: {error}")
            except httpx.TransportError as error:
                self.tally.sse_endings.append(f"{self.session}: {type(error).__name__}")
            except _Refused as refused:
                wait_s = refused.retry_after_s
            await asyncio.sleep(max(wait_s, POLL_S))  # the client's reconnection delay

    async def _read(self, headers: dict[str, str]) -> None:
        path = f"/v1/sessions/{self.session}/events"
        async with self.http.stream("GET", path, headers=headers) as response:
            if response.status_code == 503 and "retry-after" in response.headers:
                raise _Refused(float(response.headers["retry-after"]))
            if response.status_code != 200:
                body = (await response.aread())[:200]
                self.tally.sse_endings.append(f"{self.session}: {response.status_code} {body!r}")
                return
            async for line in response.aiter_lines():
                if line.startswith("id:"):
                    self.seqs.append(int(line[3:].strip()))
        self.tally.sse_endings.append(f"{self.session}: ended cleanly")


class _Refused(Exception):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"503, retry after {retry_after_s}s")
        self.retry_after_s = retry_after_s


async def _facts(http: httpx.AsyncClient, session: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    after = 0
    while True:
        response = await http.get(
            f"/v1/sessions/{session}/events", params={"format": "json", "after": after}
        )
        response.raise_for_status()
        page = response.json()
        found.extend(page["facts"])
        if not page["facts"] or page["next"] >= page["headSeq"]:
            return found
        after = page["next"]


async def _answered(http: httpx.AsyncClient, session: str, seq: int) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        for fact in await _facts(http, session):
            if fact["kind"] == "assistant" and seq in (fact["data"].get("inputSeqs") or ()):
                return True
    return False


async def _grpc_refuses_unavailable(grpc_address: str, session: str) -> None:
    async with AsyncKeelClient(grpc_address, KEY) as client:
        with pytest.raises(ClientUnavailable) as refused:
            await client.send_input(session, "/slow 0.1 over grpc", request_id=f"{session}-grpc")
        assert refused.value.code is not None and refused.value.code.name == "UNAVAILABLE"
        assert refused.value.retry_after_s, refused.value.metadata


@contextlib.asynccontextmanager
async def _outage(pg: ThrowawayPostgres, load: Load, seconds: float) -> AsyncIterator[None]:
    """PostgreSQL stopped for `seconds` (the fault's length, not a wait for
    anything); the body runs while it is down."""
    await asyncio.to_thread(pg.stop)
    load.outage = True
    load.refused_in_outage.clear()
    down_at = time.monotonic()
    try:
        yield
        await asyncio.sleep(max(0.0, seconds - (time.monotonic() - down_at)))
    finally:
        load.outage = False
        await asyncio.to_thread(pg.start)
        load.back_at_ms.append(int(time.time() * 1000))
        load.outages_s.append(round(time.monotonic() - down_at, 2))


async def _first_answer_after(http: httpx.AsyncClient, session: str, tag: str) -> dict[str, float]:
    """From now: seconds until an input of `session` is accepted (202), and
    until it is answered."""
    started = time.monotonic()
    request_id = f"{session}-{tag}"
    body = {"text": f"first after {tag}", "requestId": request_id}

    async def committed() -> int | None:
        with contextlib.suppress(httpx.TransportError):
            response = await http.post(f"/v1/sessions/{session}/inputs", json=body)
            if response.status_code in (200, 202):
                return int(response.json()["seq"])
        return None

    seq = await eventually(committed, f"an input accepted after {tag}", SETTLE_DEADLINE_S)
    accepted_s = time.monotonic() - started
    await eventually(
        lambda: _answered(http, session, seq), f"an answer after {tag}", SETTLE_DEADLINE_S
    )
    return {
        "accepted_s": round(accepted_s, 3),
        "answered_s": round(time.monotonic() - started, 3),
    }


async def _run(up: RunningKeel, pg: ThrowawayPostgres, grpc_address: str) -> dict[str, Any]:
    tally = Tally()
    figures: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=up.url, headers=headers, timeout=20) as http:
        sessions = []
        for i in range(SESSIONS):
            created = await http.post("/v1/sessions", json={"id": f"busy-{i}"})
            assert created.status_code == 201, created.text
            sessions.append(created.json()["id"])
        probe = sessions[0]
        load = Load(http, sessions[1:], tally)
        workers = [asyncio.create_task(load.session_loop(s)) for s in load.sessions]
        sse_clients = [
            SseClient(http, s, tally) for s in random.Random(5).sample(load.sessions, SSE_STREAMS)
        ]
        streams = [asyncio.create_task(c.run()) for c in sse_clients]
        await eventually(
            lambda: _answered(http, load.sessions[0], 1 + 1), "the load being answered", 30
        )
        for name, seconds in (("short", SHORT_OUTAGE_S), ("long", LONG_OUTAGE_S)):
            async with _outage(pg, load, seconds):
                await asyncio.wait_for(load.refused_in_outage.wait(), seconds + 10)
                await _grpc_refuses_unavailable(grpc_address, probe)
                shown = await http.get(f"/v1/sessions/{probe}")
                assert shown.status_code == 503 and shown.headers["Retry-After"], shown.text
            figures[f"recover_{name}"] = await _first_answer_after(http, probe, f"after-{name}")
        load.running = False
        await asyncio.gather(*workers)
        # Every refused (or unanswered) POST is sent again with its requestId.
        for session, request_ids in list(tally.unsettled.items()):
            for request_id in sorted(request_ids):
                status = await load.post(session, request_id)
                assert status in (200, 202), (session, request_id, status)
        # An input acknowledged before an outage, sent again after it: the
        # same seq, as a duplicate (200), nothing new committed.
        for session, acknowledged in tally.acknowledged.items():
            request_id, seq = next(iter(acknowledged.items()))
            body = {"text": f"/slow 0.2 {request_id}", "requestId": request_id}
            again = await http.post(f"/v1/sessions/{session}/inputs", json=body)
            assert again.status_code == 200 and again.json()["seq"] == seq, again.text
        await _settled(http, sessions)
        figures["ledger"] = {s: await _facts(http, s) for s in sessions}
        for client in sse_clients:
            head = figures["ledger"][client.session][-1]["seq"]

            async def caught_up(client: SseClient = client, head: int = head) -> bool:
                return bool(client.seqs) and client.seqs[-1] >= head

            await eventually(caught_up, f"SSE of {client.session} at {head}", SETTLE_DEADLINE_S)
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        figures["sse_seqs"] = {c.session: c.seqs for c in sse_clients}
        figures["outages_s"] = load.outages_s
        figures["first_answer_after_restart_s"] = [
            _first_answer_s(figures["ledger"].values(), back) for back in load.back_at_ms
        ]
        figures["violations"] = [
            v.to_json()
            for s, facts in figures["ledger"].items()
            for v in check_session(s, facts, settled=True)
        ]
    figures["tally"] = tally
    return figures


def _first_answer_s(ledgers: Iterable[list[dict[str, Any]]], back_at_ms: int) -> float:
    """Seconds from PostgreSQL's return to the first answer any session got."""
    first = min(
        fact["timestamp"]
        for facts in ledgers
        for fact in facts
        if fact["kind"] == "assistant" and fact["timestamp"] >= back_at_ms
    )
    return round((first - back_at_ms) / 1000, 3)


async def _settled(http: httpx.AsyncClient, sessions: list[str]) -> None:
    views: list[httpx.Response] = []

    async def all_settled() -> bool:
        views[:] = [await http.get(f"/v1/sessions/{s}") for s in sessions]
        return all(v.status_code == 200 and not v.json()["owedInputs"] for v in views)

    try:
        await eventually(all_settled, "every input answered", SETTLE_DEADLINE_S)
    except AssertionError as late:
        # What the sessions still owing say of themselves (status, owner).
        owing = [v.text[:400] for v in views if v.status_code != 200 or v.json()["owedInputs"]]
        raise AssertionError(f"{late}; still owing: {owing}") from None


# A child's log line as `keel up --processes` forwards it: "[kernel 4242] {json}".
_CHILD_LOG = re.compile(r"^\[(?P<child>\S+) \d+\] (?P<record>\{.*\})$")
# One warning per attempt that an outage stopped: an event of each session's
# own (bounded by the run slots), not a line per retry.
_PER_ATTEMPT = "attempt on "
# The pool's own per-retry warnings, which Keel's outage logs replace.
_POOL_RETRY = ("error connecting in ", "reconnection attempt in pool ", "discarding ")


def quiet_outage_logs(output: list[str], outages_s: list[float]) -> None:
    """Each outage is said once when it begins and once when it ends (and
    summed up every 30 s between) by each process's loops, never a line or
    a traceback per failed retry or per refused request (issue 24, point 17:
    a 10 s outage used to print 232 lines, 22 a second)."""
    assert not [line for line in output if "Traceback" in line], "a traceback in an outage"
    warnings: Counter[tuple[str, str]] = Counter()
    for line in output:
        matched = _CHILD_LOG.match(line)
        if matched is None:
            continue
        record = json.loads(matched["record"])
        if record["level"] != "warning":
            continue
        message = str(record["msg"])
        assert not (record["logger"] == "psycopg.pool" and message.startswith(_POOL_RETRY)), line
        if not message.startswith(_PER_ATTEMPT):
            warnings[(matched["child"], record["logger"])] += 1
    # Gone and back for each outage, and a summary per 30 s it lasted.
    allowed = 2 * len(outages_s) + sum(int(seconds // 30) for seconds in outages_s)
    loud = {source: count for source, count in warnings.items() if count > allowed}
    assert loud == {}, f"more than {allowed} warnings from one logger: {loud}"


@pytest.mark.slow
@pytest.mark.outage
def test_postgres_outages_under_load_lose_nothing_and_heal_by_themselves(tmp_path: Path) -> None:
    with (
        throwaway_postgres() as pg,
        keel_up(
            tmp_path / "data",
            KEY,
            "--processes",
            "--runners",
            "2",
            env={"KEEL_DATABASE_URL": pg.url, "KEEL_LEASE_MS": str(LEASE_MS)},
        ) as up,
    ):
        grpc_address = json.loads(up.discovery_file.read_text())["grpc"]
        figures = asyncio.run(_run(up, pg, grpc_address))
        output = list(up.child.lines)
    tally: Tally = figures["tally"]
    # The recovery figure: PostgreSQL back -> first input accepted / answered.
    print(
        json.dumps(
            {
                "outages_s": figures["outages_s"],
                "first_answer_after_restart_s": figures["first_answer_after_restart_s"],
                "recover_short": figures["recover_short"],
                "recover_long": figures["recover_long"],
                "refusals": tally.refusals,
                "sse": tally.sse_endings,
            }
        )
    )
    # The supervisor announces each child it starts ("  kernel: pid 4242"),
    # and each restart: every service rode out both outages in its process.
    spawned = Counter(m.group(1) for m in map(_SPAWNED.match, output) if m)
    assert set(spawned) >= {"ledger", "kernel", "compaction", "runner-1", "runner-2", "edge"}
    assert set(spawned.values()) == {1}, spawned
    assert [line for line in output if "restarting" in line] == []
    quiet_outage_logs(output, figures["outages_s"])
    assert tally.unexpected == [], tally.unexpected
    assert tally.refusals > 0 and tally.refusals_without_retry_after == []
    assert figures["violations"] == []
    # Each requestId is one input in the ledger, at the seq its 202 named.
    for session, facts in figures["ledger"].items():
        inputs: dict[str, list[int]] = {}
        for fact in facts:
            if fact["kind"] == "input":
                inputs.setdefault(fact["data"]["requestId"], []).append(fact["seq"])
        assert all(len(seqs) == 1 for seqs in inputs.values()), session
        for request_id, seq in tally.acknowledged.get(session, {}).items():
            assert inputs[request_id] == [seq], (session, request_id)
    assert all("cut" not in ending for ending in tally.sse_endings), tally.sse_endings
    # Each SSE client, reconnecting as EventSource does, saw every fact once.
    for session, seqs in figures["sse_seqs"].items():
        assert seqs == list(range(1, len(seqs) + 1)), (session, seqs)
        assert seqs[-1] == figures["ledger"][session][-1]["seq"]
    # No POST hung until the client gave up: each got an answer.
    assert tally.unanswered == 0


def _past_the_gate(call: Callable[[], T]) -> T:
    """`call`'s result once its store's gate lets it through: only the
    gate's own refusal ("a moment ago") is waited out, never a failure."""
    # Not tests.support.polling: this waits for one particular refusal to stop,
    # and any other exception must surface at once rather than be polled past.
    deadline = time.monotonic() + 5
    while True:
        try:
            return call()
        except DatabaseUnavailable as refused:
            if "a moment ago" not in refused.message or time.monotonic() > deadline:
                raise
        time.sleep(0.05)  # polling the gate's pause, with a deadline


def _an_input(request_id: str) -> list[F.NewFact]:
    return [F.NewFact(F.INPUT, {"text": "hello", "requestId": request_id})]


@pytest.mark.outage
def test_the_stores_refuse_while_postgres_is_down_and_work_at_once_when_it_is_back(
    tmp_path: Path,
) -> None:
    """The kernel's and the ledger's stores, with connections in their pools
    when the server goes: refused as UNAVAILABLE meanwhile, and the first
    call after the server is back succeeds (no dead pooled connection handed
    out, no reconnection backing off past the outage)."""
    with throwaway_postgres() as pg:
        settings = Settings().with_overrides(database_url=pg.url, data_dir=tmp_path)
        kernel_db = Database(settings)
        ledger = LedgerStore(settings)
        try:
            ledger.create_session("t:s", "t")
            ledger.append("t:s", _an_input("before"), 0)
            assert kernel_db.run(lambda tx: tx.one("SELECT 1")) == (1,)

            pg.stop()
            # Each refused call also makes the pools try (and fail) to
            # reconnect. The ledger first: it refuses without asking for a
            # moment after a failure (OutageGate), over by the time the
            # kernel has waited out its pool.
            with pytest.raises(DatabaseUnavailable):
                ledger.view("t:s")
            with pytest.raises(DatabaseUnavailable):
                kernel_db.run(lambda tx: tx.one("SELECT 1"))
            pg.start()

            # Each store refuses without asking for a moment after its last
            # failure (OutageGate); the first call it lets through succeeds.
            assert _past_the_gate(lambda: kernel_db.run(lambda tx: tx.one("SELECT 1"))) == (1,)
            assert _past_the_gate(lambda: ledger.append("t:s", _an_input("after"), 0))[0].seq == 3
            assert ledger.view("t:s").head_seq == 3
        finally:
            ledger.close()
            kernel_db.close()
