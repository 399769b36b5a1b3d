"""Garbage-collector settings for Keel's long-running processes.

Measured on `keel up` serving 1000 SSE clients: CPython's full (generation 2)
collections stopped the event loop for 50-210 ms every few seconds, and every
client and turn waited through each one. A full collection walks the whole
heap, most of which is what start-up imported (grpc, protobuf, eventsourcing,
starlette...) and will live as long as the process. Freezing the heap once
the imports are done takes those objects out of every later collection, and
higher thresholds make full collections rare. Reference counting still frees
almost everything at once; only cyclic garbage waits for a collection, and
the younger generations still collect it often.
"""

from __future__ import annotations

import gc

# Generation 0 is collected every 10,000 net allocations (default 700), and a
# full collection needs 50 * 100 younger ones first (default 10 * 10).
THRESHOLDS = (10_000, 50, 100)


def settle_heap() -> None:
    """Call once the process has imported what it runs."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
