"""A kernel replica with its own claimers, as a separate OS process.

Started by the multi-process test: it serves a kernel on the shared
PostgreSQL schema (settings from `KEEL_*`), registers a runtime, prints
`ready`, waits for the go-file, then claims until a wait comes back empty.
Every claim is renewed (a lease that was also given to someone else would
fail there), then released (epochs 1-2, half the time) or finished.

Output lines: `claimed <session> <epoch>`, `lost <session> <epoch> <reason>`,
`done <count>`.

Run: `python -m tests.kernel.claimer_process NAME GO_FILE`.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

from kernel import EpochSuperseded, KernelClient, KernelConfig, KernelServer, LeaseLost
from services.common.config import Settings

CLAIMERS = 3


async def claimer(target: str, settings: Settings, runtime_id: str, seed: str) -> int:
    rng = random.Random(seed)
    count = 0
    async with KernelClient(target, settings) as client:
        while (lease := await client.claim(runtime_id, wait_ms=500)) is not None:
            count += 1
            print(f"claimed {lease.session_id} {lease.epoch}", flush=True)
            try:
                await client.renew(lease.session_id, lease.epoch, runtime_id)
            except (LeaseLost, EpochSuperseded) as error:
                print(f"lost {lease.session_id} {lease.epoch} {error.reason}", flush=True)
                continue
            if lease.epoch < 3 and rng.random() < 0.5:
                await client.release(lease.session_id, lease.epoch, runtime_id)
            else:
                await client.finish(lease.session_id, lease.epoch, runtime_id, read_through=1)
    return count


def wait_for_file(path: Path, within: float = 60.0) -> None:
    # Not tests.support.polling: every replica polls the go-file at 10 ms so
    # that they start claiming as nearly together as the race test needs.
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} within {within} s")
        time.sleep(0.01)


async def main(name: str, go_file: Path) -> None:
    settings = Settings.from_env()
    config = KernelConfig(recheck_ms=20, sweep_ms=50)
    server = await KernelServer(settings, config=config).start()
    try:
        runtime_id = f"proc-{name}"
        async with KernelClient(server.target, server.settings) as client:
            await client.register_runtime(runtime_id)
        print("ready", flush=True)
        await asyncio.to_thread(wait_for_file, go_file)
        counts = await asyncio.gather(
            *(claimer(server.target, settings, runtime_id, f"{name}-{n}") for n in range(CLAIMERS))
        )
        print(f"done {sum(counts)}", flush=True)
    finally:
        await server.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
