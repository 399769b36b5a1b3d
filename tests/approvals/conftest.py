"""The approval tests run on the edge tests' stack (tests/edge/conftest.py):
in-process ledger, kernel, compaction and edge on PostgreSQL, with runners
started as real OS processes by each test."""

from tests.edge.conftest import stack

__all__ = ["stack"]
