"""The ledger service: every session's append-only, fenced, gap-free stream.

Public surface::

    LedgerClient        typed async gRPC client
    LedgerServer        the store served over gRPC (embedded or standalone)
    LedgerError …       the error tree (see services.ledger.errors)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from services.ledger.client import FactToAppend, LedgerClient, SessionPage
    from services.ledger.errors import (
        FactTooLarge,
        IdempotencyConflict,
        InvalidCursor,
        InvalidFact,
        InvalidId,
        InvalidSettlement,
        LedgerError,
        SessionBusy,
        SessionExists,
        SessionNotFound,
        StaleEpoch,
        UnknownToolCall,
        WriteContention,
    )
    from services.ledger.facts import CommittedFact
    from services.ledger.server import LedgerServer, run_ledger
    from services.ledger.views import Appended, OpenToolCall, SessionView, Settlement

__all__ = [
    "Appended",
    "CommittedFact",
    "FactToAppend",
    "FactTooLarge",
    "IdempotencyConflict",
    "InvalidCursor",
    "InvalidFact",
    "InvalidId",
    "InvalidSettlement",
    "LedgerClient",
    "LedgerError",
    "LedgerServer",
    "OpenToolCall",
    "SessionBusy",
    "SessionExists",
    "SessionNotFound",
    "SessionPage",
    "SessionView",
    "Settlement",
    "StaleEpoch",
    "UnknownToolCall",
    "WriteContention",
    "run_ledger",
]

# name -> the module that defines it, imported when the name is first read
# (services/common/lazy_exports.py).
_EXPORTS: dict[str, str] = {
    "FactToAppend": "services.ledger.client",
    "LedgerClient": "services.ledger.client",
    "SessionPage": "services.ledger.client",
    "Appended": "services.ledger.views",
    "OpenToolCall": "services.ledger.views",
    "SessionView": "services.ledger.views",
    "Settlement": "services.ledger.views",
    "FactTooLarge": "services.ledger.errors",
    "IdempotencyConflict": "services.ledger.errors",
    "InvalidCursor": "services.ledger.errors",
    "InvalidFact": "services.ledger.errors",
    "InvalidId": "services.ledger.errors",
    "InvalidSettlement": "services.ledger.errors",
    "LedgerError": "services.ledger.errors",
    "SessionBusy": "services.ledger.errors",
    "SessionExists": "services.ledger.errors",
    "SessionNotFound": "services.ledger.errors",
    "StaleEpoch": "services.ledger.errors",
    "UnknownToolCall": "services.ledger.errors",
    "WriteContention": "services.ledger.errors",
    "CommittedFact": "services.ledger.facts",
    "LedgerServer": "services.ledger.server",
    "run_ledger": "services.ledger.server",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
