"""A turn's Finish, done by the ledger's append (PostgreSQL only).

The runner's last append of a successful attempt may carry the Finish that
would follow it (services/common/turn_settlement.py says why). The ledger
then calls the function created here in the statement that inserts the
answer, so the answer and the lease's settlement commit together, or
neither does.

The function is a second writer of the lease tables, so it settles only the
one case whose outcome `kernel.domain.finish` leaves no room for: a success
asking for a sticky window, whose lease of that epoch the runtime still
holds, with no input newer than `read_through`, the runtime not draining and
no other session of the tenant queued and due (nobody for whom the freed
slot must wake a claim: this process would not hear of it). Its writes are
the ones `finish` decides for that case: the session kept (`sticky`) for
the granted window, the failure counts cleared, out of the queue, and the
tenant's slot returned. Every other case is left alone and the runner
sends its Finish. `tests/kernel/test_turn_settlement.py` holds the two
writers to the same outcome.

Locks: a session row already locked is skipped (its Finish comes the usual
way), so the ledger's statement never waits on a session row; the tenants'
slot counters are taken last, in tenant order, as `kernel.admission` takes
them, so no kernel transaction and this one wait on each other in a cycle.
"""

from __future__ import annotations

from kernel.domain import DrainMode, LeaseState
from kernel.sticky import MAX_STICKY_MS
from services.common.turn_settlement import FUNCTION

# `SET search_path FROM CURRENT`: the kernel's schema, as the connection
# creating the function has it, whatever the caller's search path.
CREATE_FUNCTION = f"""
CREATE OR REPLACE FUNCTION {FUNCTION}(
    p_sessions text[], p_epochs bigint[], p_runtimes text[],
    p_read_through bigint[], p_sticky_ms bigint[], p_now bigint)
RETURNS TABLE (settled_session text, settled_until_ms bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $settle$
DECLARE
    i integer;
    rec kernel_sessions%ROWTYPE;
    until_ms bigint;
    freed text[] := '{{}}';
    tenant text;
    n bigint;
BEGIN
    FOR i IN
        SELECT o.i FROM generate_subscripts(p_sessions, 1) AS o(i) ORDER BY p_sessions[o.i]
    LOOP
        SELECT * INTO rec FROM kernel_sessions s
            WHERE s.session_id = p_sessions[i] FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        CONTINUE WHEN rec.state <> '{LeaseState.HELD}' OR rec.epoch <> p_epochs[i]
            OR rec.runtime_id <> p_runtimes[i] OR rec.expires_at_ms <= p_now
            OR rec.input_seq > p_read_through[i] OR p_sticky_ms[i] <= 0;
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM runtime_instances r
            WHERE r.runtime_id = rec.runtime_id AND r.drain_mode <> '{DrainMode.NONE}');
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM kernel_sessions w
            WHERE w.tenant_id = rec.tenant_id AND w.queued = 1 AND w.parked = 0
              AND w.state <> '{LeaseState.HELD}' AND w.not_before_ms <= p_now
              AND w.session_id <> rec.session_id);
        until_ms := p_now + LEAST(p_sticky_ms[i], {MAX_STICKY_MS});
        UPDATE kernel_sessions s
            SET state = '{LeaseState.STICKY}', expires_at_ms = until_ms, expired_by = '',
                failures = 0, rate_limits = 0, last_error = '', not_before_ms = 0, queued = 0
            WHERE s.session_id = rec.session_id;
        freed := freed || rec.tenant_id;
        settled_session := rec.session_id;
        settled_until_ms := until_ms;
        RETURN NEXT;
    END LOOP;
    FOR tenant, n IN
        SELECT f.t, COUNT(*) FROM unnest(freed) AS f(t) GROUP BY f.t ORDER BY f.t
    LOOP
        UPDATE kernel_slots k SET in_use = k.in_use - n WHERE k.tenant_id = tenant;
    END LOOP;
END
$settle$
"""
