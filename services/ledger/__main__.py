"""`python -m services.ledger …`: the ledger service alone, started as `keel ledger …`
starts it (the same options and start-up checks: internal credentials,
private files, free ports), without loading the rest of the CLI."""

from __future__ import annotations

from services.ledger.command import ledger
from services.service_start import run_alone

if __name__ == "__main__":
    run_alone(ledger, "python -m services.ledger")
