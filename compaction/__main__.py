"""`python -m compaction --ledger ADDR --kernel ADDR [--address HOST:PORT]`:
the compaction service alone (same as `keel compaction`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal

from services.common import telemetry
from services.common.config import Settings


async def _serve(settings: Settings, args: argparse.Namespace, window: int) -> None:
    # Imported after telemetry is configured, like every service entry point.
    from compaction.server import run_compaction

    main = asyncio.create_task(
        run_compaction(
            settings, args.address, args.ledger, args.kernel, default_context_window=window
        )
    )
    # SIGTERM stops the server cleanly (run_compaction's finally), as Ctrl-C does.
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, main.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await main


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m compaction")
    parser.add_argument("--ledger", required=True, help="ledger service address")
    parser.add_argument("--kernel", required=True, help="kernel service address")
    parser.add_argument("--address", default="127.0.0.1:7104")
    args = parser.parse_args()
    settings = Settings.from_env()
    telemetry.configure("compaction", settings)
    window = int(os.environ.get("KEEL_CONTEXT_WINDOW", "128000"))
    asyncio.run(_serve(settings, args, window))


if __name__ == "__main__":
    main()
