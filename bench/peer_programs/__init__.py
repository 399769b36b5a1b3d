"""Programs `keel bench peers` runs inside its scratch environment.

They import the peers (LangGraph, DBOS) that Keel does not depend on, so
they never run in Keel's own environment: bench/peers.py starts them with
the scratch venv's interpreter. Keel's code is not importable there either,
so each program stands alone.
"""
