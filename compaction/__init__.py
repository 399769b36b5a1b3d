"""Keel compaction: bounded context without rewriting history.

`compaction.policy` holds the pure decision logic (when to compact, where to
cut, what to summarize, what a request presents); `compaction.conformance`
runs the shared conformance cases through it.
"""
