"""A runtime process that takes leases and then just holds them.

Used by the kernel benchmark and the kernel's kill tests: it registers,
opens its Attach stream, waits until the kernel confirmed it, claims
`--sessions` leases, prints one `holding <session> <epoch>` line per lease
and then `holder ready`, and holds everything until it is killed.

Run: `python -m bench.kernel_holder KERNEL_TARGET RUNTIME_ID --sessions 1`.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from kernel.client import KernelClient
from kernel.domain import Lease
from services.common.config import Settings


async def hold(target: str, runtime_id: str, sessions: int, wait_ms: int) -> None:
    async with KernelClient(target, Settings.from_env()) as client:
        ttl_ms = await client.register_runtime(runtime_id, pid=os.getpid(), role="runner")
        attachment = client.attach(runtime_id)
        await attachment.wait_connected()
        leases: list[Lease] = []
        for _ in range(sessions):
            lease = await client.claim(runtime_id, wait_ms=wait_ms)
            if lease is None:
                print("holder found nothing to claim", flush=True)
                return
            leases.append(lease)
            print(f"holding {lease.session_id} {lease.epoch}", flush=True)
        print("holder ready", flush=True)
        # Renewing keeps the leases alive for as long as this process lives,
        # so only its death (not the TTL) can end them.
        while True:
            await asyncio.sleep(ttl_ms / 3000)
            for lease in leases:
                await client.renew(lease.session_id, lease.epoch, runtime_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target")
    parser.add_argument("runtime_id")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--wait-ms", type=int, default=10_000)
    args = parser.parse_args()
    asyncio.run(hold(args.target, args.runtime_id, args.sessions, args.wait_ms))


if __name__ == "__main__":
    main()
