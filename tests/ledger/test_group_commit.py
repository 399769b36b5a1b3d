"""Group commit: many sessions in one transaction; one conflict fails no one."""

from __future__ import annotations

import pytest

from services.common.config import Settings
from services.ledger import facts as F
from services.ledger.group_commit import PendingAppend
from services.ledger.store import LedgerStore


def an_input(request_id: str) -> list[F.NewFact]:
    return [F.NewFact(F.INPUT, {"text": "hello", "requestId": request_id})]


def test_concurrent_appends_of_many_sessions_share_transactions(settings: Settings) -> None:
    store = LedgerStore(settings)
    try:
        sessions = [f"s{i}" for i in range(64)]
        for session_id in sessions:
            store.create_session(session_id, "t")
        before = store.batches
        # Hold the writer at its first batch so the other appends queue up
        # behind it, as they do under real concurrent load.
        with store._lock:
            futures = [store.submit(s, an_input("r1"), 0) for s in sessions]
        results = [f.result(timeout=30) for f in futures]
        assert all(r[0].seq == 2 and not r[0].duplicate for r in results)
        assert store.batches - before <= 2  # one transaction per append would be 64
        assert all(store.read(s, 0, 10)[-1].seq == 2 for s in sessions)
    finally:
        store.close()


@pytest.mark.parametrize("settings", ["postgres"], indirect=True)
def test_a_conflict_in_one_session_does_not_fail_the_others(settings: Settings) -> None:
    mine, other_process = LedgerStore(settings), LedgerStore(settings)
    try:
        for session_id in ("x", "y", "z"):
            mine.create_session(session_id, "t")
        # Another ledger process appends to x: my cached copy of x is stale.
        assert other_process.append("x", an_input("theirs"), 0)[0].seq == 2

        batch = [PendingAppend(s, an_input("mine"), 0) for s in ("x", "y", "z")]
        assert mine._commit_batch(batch) == []
        outcomes = {p.session_id: p.future.result(timeout=10)[0].seq for p in batch}
        assert outcomes == {"x": 3, "y": 2, "z": 2}
        assert [f.data["requestId"] for f in mine.read("x", 1, 10)] == ["theirs", "mine"]
        # The stale copy was replaced: dedup sees the other process's input.
        assert mine.append("x", an_input("theirs"), 0)[0].duplicate
    finally:
        mine.close()
        other_process.close()


def test_a_refused_request_leaves_its_session_untouched(settings: Settings) -> None:
    store = LedgerStore(settings)
    try:
        store.create_session("s", "t")
        store.append("s", an_input("r1"), 0)
        with pytest.raises(Exception, match="another input"):
            # The second fact conflicts after the first was decided.
            store.append(
                "s",
                [
                    F.NewFact(F.INPUT, {"text": "new", "requestId": "r2"}),
                    F.NewFact(F.INPUT, {"text": "changed", "requestId": "r1"}),
                ],
                0,
            )
        assert [f.seq for f in store.read("s", 0, 10)] == [1, 2]
        assert store.append("s", an_input("r3"), 0)[0].seq == 3
        assert store.view("s").owed_input_seqs == (2, 3)
    finally:
        store.close()


def test_a_bug_in_one_batch_does_not_stop_the_writer(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.common.errors import InternalError
    from services.ledger.domain import SessionStream

    store = LedgerStore(settings)
    try:
        store.create_session("s", "t")
        record = SessionStream.record

        def broken(self: SessionStream, *args: object, **kwargs: object) -> object:
            raise RuntimeError("a bug")

        monkeypatch.setattr(SessionStream, "record", broken)
        with pytest.raises(InternalError):
            store.append("s", an_input("r1"), 0)
        monkeypatch.setattr(SessionStream, "record", record)
        assert store.append("s", an_input("r1"), 0)[0].seq == 2
    finally:
        store.close()
