"""Keel compaction: bounded context without rewriting history.

Long sessions outgrow any context window. A compaction summarizes the oldest
part of a session and commits that summary as a `compaction` fact in the
ledger; nothing is edited or deleted, and every request can be rebuilt from
the ledger exactly as it was presented.

Modules (this package imports none of them, so the pure policy can be used
without gRPC, a database or a model). In the layer contract
(tests/test_import_directions.py) `compaction.policy` is a part of its own,
below `agent_io`, whose providers count tokens with it; the rest of this
package is above `agent_io`:

    compaction.policy       pure decision logic: when to compact, where to cut,
                            what to summarize, what a request presents
                            (pi-compatible; rules in COMPACTION.md)
    compaction.transcript   ledger facts -> context entries and the messages
                            a request presents (`request_messages`)
    compaction.conformance  runs the shared conformance cases through the policy
    compaction.summarizer   a prepared compaction -> its summary, through a model
    compaction.service      the gRPC servicer: Plan, Compact, GetContext
    compaction.server       CompactionServer / compaction_service (mountable in
                            another process's server) / run_compaction
    compaction.client       CompactionClient, the typed async client
    compaction.errors       CompactionError and its reasons

Run alone with `python -m compaction --ledger ADDR --kernel ADDR`
(`run_compaction` is what `keel compaction` serves); a runner without a
compaction address (KEEL_COMPACTION_ADDRESS) embeds the service and calls it
over loopback. The runner's hook is
`services.runner.compacting.ServiceCompaction`.
"""
