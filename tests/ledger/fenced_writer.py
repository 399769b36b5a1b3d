"""A runner-like writer process for the fencing race test.

Usage: fenced_writer.py TARGET SESSION EPOCH COUNT
Waits for "go" on stdin, claims the fence with epoch_started{EPOCH}, then
appends COUNT assistant facts under that epoch until the ledger fences it off.
"""

from __future__ import annotations

import asyncio
import sys

from services.common.config import Settings
from services.ledger import LedgerClient, StaleEpoch


async def main(target: str, session_id: str, epoch: int, count: int) -> None:
    # KEEL_INTERNAL_TOKEN (and any TLS) of the test's ledger, from the parent.
    async with LedgerClient(target, Settings.from_env()) as client:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        written = 0
        try:
            await client.append_one(
                session_id,
                "epoch_started",
                {
                    "epoch": epoch,
                    "runtimeId": f"p{epoch}",
                    "attemptId": f"a{epoch}",
                    "watermark": 0,
                },
                epoch=epoch,
            )
            for i in range(count):
                await client.append_one(
                    session_id, "assistant", {"generationId": f"g-{epoch}-{i}"}, epoch=epoch
                )
                written += 1
        except StaleEpoch:
            print(f"fenced after {written}", flush=True)
            return
        print(f"done {written}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
