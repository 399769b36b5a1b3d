#!/usr/bin/env bash
# Every acceptance guarantee of SPEC §5 at once, against real services:
#   1. the suites: request-id idempotency, SSE resume, blob resume, a
#      2000-event session (edge, client); the SIGKILL crash matrix, lease
#      takeover, drain and handoff at every safe point (ledger, kernel,
#      runner, the handoff matrix); the cutover fence; compaction
#      conformance; the deploy manifests, the image and the rolling-update
#      simulator; every service SIGKILLed under load, with replicas; request
#      and fact limits; `keel chaos`'s checks; PostgreSQL stopped for 5 s
#      and for 45 s under load.
#   2. `keel chaos`, many rounds of crash, handoff and stale (a runner
#      SIGSTOPped until its sessions are taken over, then resumed: its
#      writes must be refused), against a `keel up --processes` this script
#      starts (and stops) with a short lease, so a stale round takes seconds.
# Same environment as `make test` (PostgreSQL at KEEL_TEST_DATABASE_URL).
#
#   CHAOS_ROUNDS (10), CHAOS_SESSIONS (8), CHAOS_SEED (random), CHAOS_RUNNERS (2),
#   CHAOS_SCENARIOS (crash,handoff,stale), CHAOS_LEASE_MS (2000)
#   ACCEPTANCE_SKIP_SUITES=1 runs only the chaos part.
set -euo pipefail
cd "$(dirname "$0")/.."
make install >/dev/null

if [[ "${ACCEPTANCE_SKIP_SUITES:-0}" != 1 ]]; then
  echo "== acceptance suites"
  .venv/bin/pytest -q \
    tests/ledger \
    tests/kernel \
    tests/runner \
    tests/runner/test_crash_matrix.py \
    tests/runner/test_cutover.py \
    tests/runner/test_handoff_matrix.py \
    tests/compaction \
    tests/edge \
    tests/client \
    tests/deploy \
    tests/deploy/test_rollout.py \
    tests/test_service_kills.py \
    tests/test_limits.py \
    tests/test_chaos.py
  # PostgreSQL outages at production scale: 5 s and 45 s against a 30 s TTL.
  KEEL_OUTAGE_LEASE_MS=30000 .venv/bin/pytest -q tests/test_pg_outage.py
fi

echo "== keel chaos against keel up --processes"
work="$(mktemp -d)"
up_pid=""
cleanup() {
  if [[ -n "$up_pid" ]] && kill -0 "$up_pid" 2>/dev/null; then
    kill -TERM "$up_pid"
    wait "$up_pid" || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

key="keel-acceptance-$(.venv/bin/python -c 'import secrets; print(secrets.token_hex(16))')"
# Its own SQLite data dir and internal token: nothing of the caller's
# environment points it elsewhere.
env -u KEEL_DATABASE_URL -u KEEL_INTERNAL_TOKEN -u KEEL_DATA_DIR -u KEEL_URL -u KEEL_API_KEY \
  KEEL_DEV_KEY="$key" PYTHONUNBUFFERED=1 KEEL_LEASE_MS="${CHAOS_LEASE_MS:-2000}" \
  .venv/bin/keel up --processes --runners "${CHAOS_RUNNERS:-2}" \
  --data-dir "$work/data" --http-port 0 --grpc-port 0 >"$work/up.log" 2>&1 &
up_pid=$!

# `keel up` announces itself in its discovery file once it serves.
for _ in $(seq 1 600); do
  if [[ -s "$work/data/keel-up.json" ]]; then break; fi
  if ! kill -0 "$up_pid" 2>/dev/null; then
    echo "keel up exited before it served:" >&2
    cat "$work/up.log" >&2
    exit 1
  fi
  sleep 0.2
done
url="$(.venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1]))["url"])' \
  "$work/data/keel-up.json")"

seed="${CHAOS_SEED:-$RANDOM}"
status=0
.venv/bin/keel chaos --url "$url" --key "$key" \
  --scenarios "${CHAOS_SCENARIOS:-crash,handoff,stale}" \
  --rounds "${CHAOS_ROUNDS:-10}" --sessions "${CHAOS_SESSIONS:-8}" --seed "$seed" || status=$?
if [[ $status -ne 0 ]]; then
  echo "keel chaos failed (exit $status, seed $seed); keel up's output:" >&2
  tail -n 50 "$work/up.log" >&2
fi
exit $status
