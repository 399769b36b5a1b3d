"""`FactKind`, the type a writer names a kind with, lists exactly the kinds
the ledger knows (those written by clients and runners, and the two it
writes itself): a kind added to one and not the other fails here."""

from __future__ import annotations

from typing import get_args

from services.ledger.facts import APPENDABLE_KINDS, FORKED_FROM, SESSION_CREATED, FactKind


def test_the_fact_kind_type_lists_every_kind() -> None:
    assert set(get_args(FactKind)) == APPENDABLE_KINDS | {SESSION_CREATED, FORKED_FROM}
