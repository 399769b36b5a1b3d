"""`python -m services.runner …`: the runner service alone, started as `keel runner …`
starts it (the same options and start-up checks: internal credentials,
private files, free ports), without loading the rest of the CLI."""

from __future__ import annotations

from services.runner.command import runner
from services.service_start import run_alone

if __name__ == "__main__":
    run_alone(runner, "python -m services.runner")
