"""Handoff audit rows, written inside the transactions that cause them.

A draining runtime's release writes the row (`insert_handoff`) with no new
runtime: nobody has the session yet. The first claim of the session by
another runtime names it (`name_successor`), in the claim's own
transaction, so a row can never name a runtime that did not get the
session, nor miss the one that did.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernel.database import Tx


@dataclass(frozen=True)
class HandoffNote:
    """What the old runtime tells of a session it hands off."""

    # Runs in flight on the old runtime when its drain began.
    in_flight: int
    # The loadout revision the handed-off attempt pinned.
    loadout_revision: int


def insert_handoff(
    tx: Tx,
    old_runtime_id: str,
    new_runtime_id: str,
    note: HandoffNote,
    session_id: str,
    epoch: int,
    at_ms: int,
) -> int:
    row = tx.one(
        "INSERT INTO handoffs (old_runtime_id, new_runtime_id, loadout_revision, "
        "in_flight, session_id, epoch, at_ms) VALUES (%s, %s, %s, %s, %s, %s, %s) "
        "RETURNING handoff_id",
        (
            old_runtime_id,
            new_runtime_id,
            note.loadout_revision,
            note.in_flight,
            session_id,
            epoch,
            at_ms,
        ),
    )
    assert row is not None
    return int(row[0])


def name_successor(tx: Tx, session_id: str, new_runtime_id: str) -> None:
    """A claim after a handoff: its runtime is the handoff's new runtime.
    Rows still unnamed only, and never the old runtime itself (a draining
    runtime granted the session once more hands it straight back)."""
    tx.execute(
        "UPDATE handoffs SET new_runtime_id = %s WHERE session_id = %s "
        "AND new_runtime_id = '' AND old_runtime_id <> %s",
        (new_runtime_id, session_id, new_runtime_id),
    )
