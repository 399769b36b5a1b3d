#!/usr/bin/env bash
# Every acceptance guarantee of SPEC §5 at once, against real services:
# request-id idempotency, SSE resume, blob resume, a 2000-event session,
# the SIGKILL crash matrix, lease takeover, drain and handoff, the cutover
# fence, and compaction conformance. Same environment as `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
make install >/dev/null
exec .venv/bin/pytest -q \
  tests/ledger \
  tests/kernel \
  tests/runner/test_crash_matrix.py tests/runner/test_drain.py tests/runner/test_turns.py \
  tests/compaction \
  tests/edge
