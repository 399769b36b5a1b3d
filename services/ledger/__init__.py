"""The ledger service: every session's append-only, fenced, gap-free stream.

Public surface::

    LedgerClient        typed async gRPC client
    LedgerServer        the store served over gRPC (embedded or standalone)
    LedgerError …       the error tree (see services.ledger.errors)
"""

from services.ledger.client import FactToAppend, LedgerClient, SessionPage
from services.ledger.domain import Appended, OpenToolCall, SessionView
from services.ledger.errors import (
    FactTooLarge,
    IdempotencyConflict,
    InvalidCursor,
    InvalidFact,
    InvalidId,
    LedgerError,
    SessionExists,
    SessionNotFound,
    StaleEpoch,
    UnknownToolCall,
    WriteContention,
)
from services.ledger.facts import CommittedFact
from services.ledger.server import LedgerServer, run_ledger

__all__ = [
    "Appended",
    "CommittedFact",
    "FactToAppend",
    "FactTooLarge",
    "IdempotencyConflict",
    "InvalidCursor",
    "InvalidFact",
    "InvalidId",
    "LedgerClient",
    "LedgerError",
    "LedgerServer",
    "OpenToolCall",
    "SessionExists",
    "SessionNotFound",
    "SessionPage",
    "SessionView",
    "StaleEpoch",
    "UnknownToolCall",
    "WriteContention",
    "run_ledger",
]
