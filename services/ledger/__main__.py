"""`python -m services.ledger [--address HOST:PORT]`: the ledger alone (same as `keel ledger`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from services.common import telemetry
from services.common.config import Settings
from services.ledger.server import run_ledger


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.ledger")
    parser.add_argument("--address", default="127.0.0.1:7101")
    args = parser.parse_args()
    settings = Settings.from_env()
    telemetry.configure("ledger", settings)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_ledger(settings, args.address))


if __name__ == "__main__":
    main()
