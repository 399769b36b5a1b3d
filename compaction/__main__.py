"""`python -m compaction …`: the compaction service alone, started as `keel compaction …`
starts it (the same options and start-up checks: internal credentials,
private files, free ports), without loading the rest of the CLI."""

from __future__ import annotations

from compaction.command import compaction
from services.service_start import run_alone

if __name__ == "__main__":
    run_alone(compaction, "python -m compaction")
