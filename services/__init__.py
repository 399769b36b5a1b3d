"""Keel's services: the ledger, the runner, and what they share."""
