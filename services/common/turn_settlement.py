"""The SQL function through which the ledger settles a turn for the kernel.

A warm turn of a sticky session used to end with two commits in a row: the
runner's answer in the ledger, then its Finish in the kernel (a hop and a
transaction of their own, every turn). Where both services keep their tables
in one PostgreSQL database, the answer's append carries the Finish instead
and one statement commits both. The kernel owns what a Finish decides, so it
creates this function with its tables (kernel/turn_settlement.py); the
ledger only calls it, by the name and signature below, in the statement that
inserts the answer. This module is that contract, and all the two share.

The function settles only the plain case (the lease held, nothing newer,
no drain, nobody of the tenant waiting for a slot) and returns the sessions
it settled; for every other one the runner sends its Finish as before.
"""

from __future__ import annotations

# keel_settle_turns(session ids, epochs, runtime ids, read_through,
# sticky_ms, now_ms) -> TABLE (session_id, sticky_until_ms); the arrays are
# parallel, one element per turn to settle.
FUNCTION = "keel_settle_turns"
ARGUMENT_TYPES = "text[], bigint[], text[], bigint[], bigint[], bigint"
SIGNATURE = f"{FUNCTION}({ARGUMENT_TYPES})"
