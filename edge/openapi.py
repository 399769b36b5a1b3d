"""The OpenAPI 3.1 document of the edge's HTTP API (served at /openapi.json).

Response schemas are closed (`additionalProperties: false`) wherever the edge
builds the body, so a renamed or stray field is a difference from this
document that tests/edge/test_openapi.py catches on real responses. Fact
`data` and context messages stay open: their shape is the ledger's (§4).
"""

from __future__ import annotations

from typing import Any

from edge.session_status import SESSION_STATUSES
from services.ledger.facts import MULTITASK_MODES

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: list[str], properties: dict[str, Schema]) -> Schema:
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": False,
    }


def _json(schema: Schema, description: str, headers: dict[str, Any] | None = None) -> Schema:
    response: Schema = {
        "description": description,
        "content": {"application/json": {"schema": schema}},
    }
    if headers:
        response["headers"] = headers
    return response


def _error(description: str) -> Schema:
    return _json(_ref("Error"), description)


def _body(schema: Schema) -> Schema:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _optional_body(schema: Schema) -> Schema:
    return {"required": False, "content": {"application/json": {"schema": schema}}}


_INT = {"type": "integer"}
_SEQ = {"type": "integer", "minimum": 1}
_COUNT = {"type": "integer", "minimum": 0}
_STRING = {"type": "string"}
# Session ids are per tenant: two tenants may each have a session "s-1".
_SESSION_ID_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.\\-]{0,63}$"}
_REQUEST_ID_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.:\\-]{0,127}$"}
_SESSION_ID = {"name": "id", "in": "path", "required": True, "schema": _SESSION_ID_SCHEMA}
_BLOB_ID = {"name": "id", "in": "path", "required": True, "schema": _STRING}
_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "The requestId, as a header. If the body has one too, they must be equal.",
    "schema": _REQUEST_ID_SCHEMA,
}
_TENANT_ID_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.\\-]{0,63}$"}
_ETAG = {
    "ETag": {
        "description": 'The loadout\'s revision, quoted ("3"); send it back as If-Match',
        "required": True,
        "schema": _STRING,
    }
}
_UPLOAD_OFFSET = {
    "Upload-Offset": {
        "description": "How many bytes the upload has reached",
        "required": True,
        "schema": _COUNT,
    }
}

_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds until a key from this address is checked again",
        "schema": {"type": "integer", "minimum": 1},
    }
}
_UNAVAILABLE_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before sending the request again",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    }
}
# Every route with a key can answer these; a 408 and a 413 wherever a body is read.
_AUTHENTICATED = {
    "401": _error(
        "Missing or unknown API key, or a key in the URL (`access_token` is accepted "
        "only on GET /v1/sessions/{id}/events)"
    ),
    "429": _json(
        _ref("Error"),
        "Too many unknown keys from this client address: no key (except one already "
        "accepted from it) is checked until Retry-After; `too_many_failed_keys`",
        _RETRY_AFTER,
    ),
    "503": _json(
        _ref("Error"),
        "A Keel service (or its database) is unavailable; nothing was done. "
        "Retry after Retry-After seconds",
        _UNAVAILABLE_RETRY_AFTER,
    ),
}
_BAD = {"400": _error("Bad input (the message names what)")}
_TOO_LARGE = {
    "408": _error("The body stopped arriving (stalled, or too slow); the connection is closed"),
    "413": _error(
        "The body is larger than the edge's limit (KEEL_EDGE_MAX_BODY_BYTES, default 1 MiB; "
        "the message names it), or a fact it would write is over the ledger's "
        "(KEEL_MAX_FACT_BYTES); `payload_too_large`"
    ),
}
_NO_SESSION = {"404": _error("No such session (or another tenant's)")}

_SCHEMAS: dict[str, Schema] = {
    "Error": _object(
        ["error"],
        {
            "error": _object(
                ["code", "message"],
                {
                    "code": {"type": "string", "description": "machine-readable"},
                    "message": {"type": "string"},
                },
            )
        },
    ),
    "SessionCreate": _object([], {"id": _SESSION_ID_SCHEMA}),
    "SessionCreated": _object(["id"], {"id": _SESSION_ID_SCHEMA}),
    "SessionSummary": _object(["id", "headSeq"], {"id": _SESSION_ID_SCHEMA, "headSeq": _COUNT}),
    "SessionList": _object(
        ["sessions", "next"],
        {
            "sessions": {"type": "array", "items": _ref("SessionSummary")},
            "next": {
                "type": ["string", "null"],
                "description": "Pass as ?after= for the next page; null on the last page",
            },
        },
    ),
    "Session": _object(
        ["id", "headSeq", "status", "owedInputs", "latestCompactionSeq", "pendingApprovals"],
        {
            "id": _SESSION_ID_SCHEMA,
            "headSeq": _COUNT,
            "status": {
                "enum": list(SESSION_STATUSES),
                "description": "awaiting_approval: nothing runs and a tool call waits for a "
                "decision; inputs sent meanwhile stay owed until the call has its result",
            },
            "owedInputs": {"type": "array", "items": _SEQ},
            "latestCompactionSeq": _COUNT,
            "pendingApprovals": {"type": "array", "items": _ref("PendingApproval")},
            "parkedOn": {
                "type": "array",
                "items": _SEQ,
                "description": "when parked: the inputs the session failed on (what a skip "
                "settles); inputs sent since are owed and not batched with them",
            },
            "parkedReason": {"type": "string", "description": "when parked: why"},
        },
    ),
    "PendingApproval": _object(
        ["toolCallId", "name", "arguments", "seq"],
        {
            "toolCallId": _STRING,
            "name": {"type": "string", "description": "the tool, as the model called it"},
            "arguments": {"type": "object"},
            "seq": {"allOf": [_SEQ], "description": "its approval_requested fact"},
        },
    ),
    "ApprovalDecision": _object(
        ["toolCallId", "approve"],
        {
            "toolCallId": _REQUEST_ID_SCHEMA,
            "approve": {
                "type": "boolean",
                "description": "true runs the call; false commits an error result for it",
            },
            "note": {
                "type": "string",
                "maxLength": 4096,
                "description": "kept with the decision; a denial's note reaches the model",
            },
        },
    ),
    "ApprovalDecided": _object(
        ["seq", "toolCallId", "approve", "by"],
        {
            "seq": {"allOf": [_SEQ], "description": "the approval fact"},
            "toolCallId": _STRING,
            "approve": {"type": "boolean"},
            "by": {"type": "string", "description": "who decided: the caller's key"},
        },
    ),
    "Input": _object(
        ["text"],
        {
            "text": {"type": "string", "maxLength": 256 * 1024},
            "requestId": _REQUEST_ID_SCHEMA,
            "blobs": {"type": "array", "items": _STRING, "description": "complete blobs' ids"},
            "multitask": {
                "enum": list(MULTITASK_MODES),
                "description": "what this input asks of work under way: enqueue (answered "
                "next), reject (409 session_busy while work is owed; nothing committed), "
                "interrupt (the running attempt stops; the next answers every owed input), "
                "rollback (the owed inputs are withdrawn; only this one is answered). "
                "Absent: the tenant's loadout `multitask`, else enqueue",
            },
        },
    ),
    "Retry": _object(["seq"], {"seq": _SEQ, "requestId": _REQUEST_ID_SCHEMA}),
    "Committed": _object(
        ["seq", "requestId", "retrySafe"],
        {
            "seq": _SEQ,
            "requestId": _REQUEST_ID_SCHEMA,
            "retrySafe": {
                "type": "boolean",
                "description": "false when the edge made the requestId: resending would "
                "commit a second input",
            },
        },
    ),
    "Cancelled": _object(
        ["seq", "cancelled", "inputSeqs"],
        {
            "seq": _SEQ,
            "cancelled": {"const": True},
            "inputSeqs": {
                "type": "array",
                "items": _SEQ,
                "description": "the inputs it settles: every input owed when it was committed",
            },
        },
    ),
    "NothingToCancel": _object(["cancelled"], {"cancelled": {"const": False}}),
    "Fork": _object(
        ["at"],
        {
            "at": {"allOf": [_SEQ], "description": "the parent's last fact the fork keeps"},
            "id": {
                "allOf": [_SESSION_ID_SCHEMA],
                "description": "the fork's id; absent: a new one",
            },
        },
    ),
    "Edit": _object(
        ["seq", "text"],
        {
            "seq": {"allOf": [_SEQ], "description": "the input to edit"},
            "text": {"type": "string", "maxLength": 256 * 1024},
            "requestId": _REQUEST_ID_SCHEMA,
        },
    ),
    "Forked": _object(
        ["id", "forkedFrom", "headSeq"],
        {
            "id": _SESSION_ID_SCHEMA,
            "forkedFrom": _object(["id", "seq"], {"id": _SESSION_ID_SCHEMA, "seq": _SEQ}),
            "headSeq": {"allOf": [_SEQ], "description": "the fork's forked_from fact"},
            "input": {"allOf": [_ref("Committed")], "description": "an edit's input"},
        },
    ),
    "ScheduleRequest": _object(
        ["text"],
        {
            "text": {"type": "string", "minLength": 1, "maxLength": 256 * 1024},
            "cron": {"type": "string", "description": "5 fields, read in `timezone`"},
            "timezone": {"type": "string", "description": "IANA, e.g. Europe/Berlin; default UTC"},
            "at": {"type": "string", "description": "RFC 3339, with its offset (one firing)"},
        },
    ),
    "Schedule": _object(
        ["id", "text", "nextFireAt", "createdAt"],
        {
            "id": _STRING,
            "text": _STRING,
            "cron": _STRING,
            "timezone": _STRING,
            "at": _STRING,
            "nextFireAt": {"type": "string", "description": "RFC 3339, UTC"},
            "createdAt": {"type": "string", "description": "RFC 3339, UTC"},
        },
    ),
    "Schedules": _object(
        ["schedules"], {"schedules": {"type": "array", "items": _ref("Schedule")}}
    ),
    "Skipped": _object(
        ["seq", "skipped"],
        {
            "seq": {"allOf": [_SEQ], "description": "the inputs_skipped fact"},
            "skipped": {"type": "array", "items": _SEQ, "description": "the inputs it settled"},
        },
    ),
    "Fact": _object(
        ["seq", "kind", "timestamp", "epoch", "data"],
        {
            "seq": _SEQ,
            "kind": _STRING,
            "timestamp": {"type": "integer", "description": "ms since the epoch"},
            "epoch": _COUNT,
            "data": {"type": "object"},
        },
    ),
    "FactPage": _object(
        ["facts", "headSeq", "next"],
        {
            "facts": {"type": "array", "items": _ref("Fact")},
            "headSeq": _COUNT,
            "next": {"type": "integer", "minimum": 0, "description": "the next ?after="},
        },
    ),
    "Context": _object(
        [
            "at",
            "systemPrompt",
            "messages",
            "compactionSeq",
            "loadoutRevision",
            "watermark",
            "estimatedTokens",
        ],
        {
            "at": _SEQ,
            "systemPrompt": _STRING,
            "messages": {"type": "array", "items": {"type": "object"}},
            "compactionSeq": _COUNT,
            "loadoutRevision": _COUNT,
            "watermark": _COUNT,
            "estimatedTokens": _COUNT,
        },
    ),
    "BlobCreate": _object(
        ["length"],
        {
            "length": {"type": "integer", "minimum": 1},
            "contentType": {"type": "string", "default": "application/octet-stream"},
        },
    ),
    "Blob": _object(
        ["id", "length", "offset", "contentType", "complete", "sha256"],
        {
            "id": _STRING,
            "length": _SEQ,
            "offset": _COUNT,
            "contentType": _STRING,
            "complete": {"type": "boolean"},
            "sha256": {"type": ["string", "null"], "description": "set once complete"},
        },
    ),
    "Drain": _object(
        [],
        {
            "mode": {"enum": ["handoff", "shutdown"], "default": "handoff"},
            "deadlineMs": {
                "type": "integer",
                "minimum": 0,
                "description": "default: the edge's KEEL_DRAIN_DEADLINE_MS (30000)",
            },
            "runtimeId": {
                "type": "string",
                "description": "one runner, or this edge by its id; else every attached runner",
            },
        },
    ),
    "Drained": _object(
        ["mode", "runtimes", "stopped", "failed", "undone", "edge"],
        {
            "mode": {"enum": ["handoff", "shutdown"]},
            "runtimes": {
                "type": "object",
                "additionalProperties": _INT,
                "description": "each runner drained: its runs in flight when the drain began",
            },
            "stopped": {
                "type": "object",
                "additionalProperties": _INT,
                "description": "each runner drained: runs stopped where they were (shutdown, "
                "or past the deadline) rather than at a commit boundary",
            },
            "failed": {
                "type": "object",
                "additionalProperties": _STRING,
                "description": "runners that could not be drained, and why",
            },
            "undone": {
                "type": "array",
                "items": _STRING,
                "description": "runners whose drain was undone before it finished",
            },
            "edge": {"type": ["string", "null"], "description": "this edge, when it was named"},
            "openStreams": {
                "type": "integer",
                "description": "this edge: streams still open when its drain finished",
            },
        },
    ),
    "DrainUndo": _object(
        [],
        {
            "runtimeId": {
                "type": "string",
                "description": "one runner, or this edge; else every draining runner and this edge",
            }
        },
    ),
    "DrainUndone": _object(
        ["undone", "finished", "failed", "edge"],
        {
            "undone": {"type": "array", "items": _STRING, "description": "claiming again"},
            "finished": {
                "type": "array",
                "items": _STRING,
                "description": "too late: their drain finished, they are being replaced",
            },
            "failed": {"type": "object", "additionalProperties": _STRING},
            "edge": {"type": ["string", "null"], "description": "this edge, if it was undone"},
        },
    ),
    "LocalDrain": _object(
        [],
        {
            "mode": {"enum": ["handoff", "shutdown"], "default": "handoff"},
            "deadlineMs": {"type": "integer", "minimum": 0},
            "runtimeId": {"type": "string", "description": "refused unless this edge's id"},
            "undo": {"type": "boolean", "default": False},
        },
    ),
    "LocalDrained": _object(
        ["edge"],
        {
            "edge": _STRING,
            "mode": {"enum": ["handoff", "shutdown"]},
            "openStreams": {
                "type": "integer",
                "description": "streams still open when the deadline passed",
            },
            "finished": {"type": "boolean"},
            "undone": {"type": "boolean"},
        },
    ),
    "HeldSession": _object(
        ["id"],
        {"id": _STRING, "tenant": {"type": "string", "description": "operators only"}},
    ),
    "Runtime": _object(
        ["runtimeId", "role", "liveness", "drainMode", "claiming", "inFlightRuns", "sessions"],
        {
            "runtimeId": _STRING,
            "role": {"enum": ["runner", "edge"]},
            "liveness": {
                "enum": ["live", "attached to another kernel", "unreachable", "gone"],
                "description": "live: it answered this edge (an edge: this one, or attached "
                "to this edge's kernel); attached to another kernel: alive there, not "
                "answering here (another node); unreachable: attached to this edge's kernel "
                "but not answering at its address; gone: detached",
            },
            "drainMode": _STRING,
            "attached": {"type": "boolean"},
            "claiming": {"type": "boolean"},
            "inFlightRuns": _COUNT,
            "loadoutRevision": _INT,
            "sessions": {"type": "array", "items": _ref("HeldSession")},
            "host": {"type": "string", "description": "operators only"},
            "pid": {"type": "integer", "description": "operators only"},
            "address": {"type": "string", "description": "operators only"},
        },
    ),
    "RuntimeStatus": _object(
        ["runtimes", "claimingRunners"],
        {
            "runtimes": {"type": "array", "items": _ref("Runtime")},
            "claimingRunners": {
                "type": "integer",
                "minimum": 0,
                "description": "0: inputs are accepted and wait until a runner claims",
            },
        },
    ),
    "Loadout": _object(
        ["revision", "document"],
        {
            "revision": {"type": "integer", "minimum": 0, "description": "0: none stored yet"},
            "document": {"type": "object", "description": "SPEC §10"},
        },
    ),
    "LoadoutStored": _object(["revision"], {"revision": _SEQ}),
    "LoadoutDocument": {
        "type": "object",
        "minProperties": 1,
        "description": "SPEC §10: systemPrompt, model, compaction, admission, tools. "
        "Unknown fields are refused; secrets only by env-var name (apiKeyEnv, headersEnv); "
        "null unsets a field.",
    },
    "LoadoutReadBack": _object(
        ["document"],
        {
            "revision": {
                "type": "integer",
                "minimum": 0,
                "description": "the revision read; stored only if still the latest (If-Match)",
            },
            "document": _ref("LoadoutDocument"),
        },
    ),
    "Tenant": _object(
        ["id", "name", "createdAtMs"],
        {"id": _TENANT_ID_SCHEMA, "name": _STRING, "createdAtMs": _COUNT},
    ),
    "TenantList": _object(["tenants"], {"tenants": {"type": "array", "items": _ref("Tenant")}}),
    "TenantCreate": _object(
        ["id"], {"id": _TENANT_ID_SCHEMA, "name": {"type": "string", "maxLength": 256}}
    ),
    "TenantCreated": _object(
        ["id", "name", "created"],
        {"id": _TENANT_ID_SCHEMA, "name": _STRING, "created": {"type": "boolean"}},
    ),
    "ApiKey": _object(
        ["id", "tenant", "admin", "operator", "createdAtMs", "revokedAtMs"],
        {
            "id": _STRING,
            "tenant": _STRING,
            "admin": {"type": "boolean"},
            "operator": {"type": "boolean"},
            "createdAtMs": _COUNT,
            "revokedAtMs": {"type": ["integer", "null"], "description": "null while valid"},
        },
    ),
    "ApiKeyList": _object(["keys"], {"keys": {"type": "array", "items": _ref("ApiKey")}}),
    "ApiKeyCreate": _object(
        [],
        {
            "tenant": {"type": "string", "description": "default: the caller's tenant"},
            "admin": {"type": "boolean", "default": False},
            "operator": {"type": "boolean", "default": False, "description": "operators only"},
        },
    ),
    "ApiKeyCreated": _object(
        ["id", "key", "tenant", "admin", "operator"],
        {
            "id": _STRING,
            "key": {"type": "string", "description": "shown this once; only its hash is kept"},
            "tenant": _STRING,
            "admin": {"type": "boolean"},
            "operator": {"type": "boolean"},
        },
    ),
    "ApiKeyRevoked": _object(
        ["id", "revoked"],
        {
            "id": _STRING,
            "revoked": {"type": "boolean", "description": "false: it was revoked before"},
        },
    ),
}

_PATHS: dict[str, Schema] = {
    "/v1/sessions": {
        "post": {
            "operationId": "createSession",
            "summary": "Create a session for the key's tenant",
            "description": "With `id`, that id (unique within the tenant); else a new one.",
            "requestBody": _optional_body(_ref("SessionCreate")),
            "responses": {
                "201": _json(_ref("SessionCreated"), "Created"),
                "409": _error("The tenant has a session with this id"),
                **_BAD,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
        "get": {
            "operationId": "listSessions",
            "summary": "The tenant's sessions, a page at a time, ascending by id",
            "parameters": [
                {
                    "name": "after",
                    "in": "query",
                    "description": "Start after this session id (the previous page's `next`)",
                    "schema": _SESSION_ID_SCHEMA,
                },
                {
                    "name": "limit",
                    "in": "query",
                    "description": "At most this many (default 100; above 1000 counts as 1000)",
                    "schema": {"type": "integer", "minimum": 1, "default": 100},
                },
            ],
            "responses": {
                "200": _json(_ref("SessionList"), "One page"),
                **_BAD,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}": {
        "parameters": [_SESSION_ID],
        "get": {
            "operationId": "getSession",
            "summary": "Head seq, status and owed inputs",
            "description": "`status` needs the kernel (who holds the session) as well as "
            "the ledger: while either cannot be asked the answer is 503 with Retry-After, "
            "never a guessed `idle` (an answer may still be streaming).",
            "responses": {
                "200": _json(_ref("Session"), "The session"),
                **_BAD,
                **_NO_SESSION,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/inputs": {
        "parameters": [_SESSION_ID],
        "post": {
            "operationId": "postInput",
            "summary": "Commit an input (idempotent by requestId)",
            "description": "The requestId comes from the body or the Idempotency-Key "
            "header; with neither, the edge makes one and answers `retrySafe: false`.",
            "parameters": [_IDEMPOTENCY_KEY],
            "requestBody": _body(_ref("Input")),
            "responses": {
                "202": _json(_ref("Committed"), "Committed"),
                "200": _json(_ref("Committed"), "Already committed with this requestId"),
                "404": _error("No such session, or no such blob"),
                "409": _error(
                    "The requestId was used for another input, or (multitask reject) the "
                    "session is busy (session_busy)"
                ),
                **_BAD,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/retry": {
        "parameters": [_SESSION_ID],
        "post": {
            "operationId": "retryInput",
            "summary": "Re-ask a committed input",
            "description": "A new input with the original's text and blobs and `retryOf`; "
            "deduplicated like inputs.",
            "parameters": [_IDEMPOTENCY_KEY],
            "requestBody": _body(_ref("Retry")),
            "responses": {
                "202": _json(_ref("Committed"), "Committed"),
                "200": _json(_ref("Committed"), "Already retried with this requestId"),
                "409": _error("The requestId was used for another input or seq"),
                **_BAD,
                **_NO_SESSION,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/cancel": {
        "parameters": [_SESSION_ID],
        "post": {
            "operationId": "cancel",
            "summary": "Cancel the session's current work",
            "description": "Settles every input owed at that moment, and names them "
            "(`inputSeqs`); a parked session runs again to settle them. An idle session "
            "(nothing owed, nothing running) has nothing to cancel: nothing is committed "
            "and the answer is 200 `{cancelled: false}`.",
            "responses": {
                "202": _json(_ref("Cancelled"), "A cancel was committed"),
                "200": _json(_ref("NothingToCancel"), "Nothing to cancel"),
                **_BAD,
                **_NO_SESSION,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/fork": {
        "parameters": [_SESSION_ID],
        "post": {
            "operationId": "forkSession",
            "summary": "A new session from this one's facts 1..at",
            "description": "The fork's facts 1..at are the parent's (copied, seqs kept), then "
            "`forked_from`; what a request built at any seq <= at shows is the same in both. "
            "The parent is untouched; the fork goes on on its own.",
            "requestBody": _body(_ref("Fork")),
            "responses": {
                "201": _json(_ref("Forked"), "Forked"),
                "409": _error("A session with that id exists"),
                **_BAD,
                **_NO_SESSION,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/edit": {
        "parameters": [_SESSION_ID],
        "post": {
            "operationId": "editInput",
            "summary": "Edit and resend: a fork before an input, with the edited text",
            "parameters": [_IDEMPOTENCY_KEY],
            "requestBody": _body(_ref("Edit")),
            "responses": {
                "201": _json(_ref("Forked"), "Forked, the edited input committed in the fork"),
                **_BAD,
                **_NO_SESSION,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/schedules": {
        "parameters": [_SESSION_ID],
        "post": {
            "operationId": "createSchedule",
            "summary": "Send an input on a cron expression, or once at a time",
            "description": "Each firing is an input whose requestId is the schedule and the "
            "time it was due: committed once across crashes, restarts and kernel failover. "
            "Firings missed while Keel was away fire once, late.",
            "requestBody": _body(_ref("ScheduleRequest")),
            "responses": {
                "201": _json(_ref("Schedule"), "Scheduled"),
                **_BAD,
                **_NO_SESSION,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
        "get": {
            "operationId": "listSchedules",
            "summary": "The session's schedules (a one-off that fired is gone)",
            "responses": {
                "200": _json(_ref("Schedules"), "The schedules"),
                **_NO_SESSION,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/schedules/{scheduleId}": {
        "parameters": [
            _SESSION_ID,
            {"name": "scheduleId", "in": "path", "required": True, "schema": _STRING},
        ],
        "delete": {
            "operationId": "deleteSchedule",
            "summary": "Stop a schedule",
            "responses": {
                "204": {"description": "Deleted"},
                "404": _error("No such session, or no such schedule of it"),
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/skip": {
        "parameters": [_SESSION_ID],
        "post": {
            "operationId": "skipFailedInputs",
            "summary": "Settle the inputs a parked session failed on",
            "description": "Only those: the model is shown each skipped input followed by "
            "a note that it was skipped and why, and the inputs sent after them are "
            "answered. Retry asks a failed input again instead.",
            "responses": {
                "202": _json(_ref("Skipped"), "Skipped; the session runs again"),
                "409": _error("The session is not parked on a failed input (not_parked)"),
                **_BAD,
                **_NO_SESSION,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/approvals": {
        "parameters": [_SESSION_ID],
        "post": {
            "operationId": "decideApproval",
            "summary": "Decide a tool call waiting for approval",
            "description": "One decision per call (GET /v1/sessions/{id} lists the waiting "
            "ones). Approved, the call runs; denied, the model gets an error result with "
            "the note. The session is woken as by an input.",
            "requestBody": _body(_ref("ApprovalDecision")),
            "responses": {
                "201": _json(_ref("ApprovalDecided"), "The decision is committed"),
                "409": _error(
                    "`approval_not_pending`: no such call waits for a decision; "
                    "`approval_already_decided`: it was decided before (the first stands)"
                ),
                **_BAD,
                **_NO_SESSION,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/sessions/{id}/events": {
        "parameters": [_SESSION_ID],
        "get": {
            "operationId": "events",
            "summary": "The session's facts: SSE (id: seq), or a page with ?format=json",
            "parameters": [
                {"name": "after", "in": "query", "schema": _COUNT},
                {
                    "name": "limit",
                    "in": "query",
                    "description": "Pages only (default 500; above 1000 counts as 1000)",
                    "schema": {"type": "integer", "minimum": 1},
                },
                {
                    "name": "format",
                    "in": "query",
                    "description": "json for a page; absent for SSE",
                    "schema": {"enum": ["json"]},
                },
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "description": "Resume after this seq (wins over ?after=)",
                    "schema": {"type": "string", "pattern": "^[0-9]+$"},
                },
                {
                    "name": "access_token",
                    "in": "query",
                    "description": "The API key, for EventSource, which cannot send "
                    "headers; only here (anywhere else a key in the URL is a 401). "
                    "Prefer the Authorization header: URLs end up in logs.",
                    "schema": _STRING,
                },
            ],
            "responses": {
                "200": {
                    "description": (
                        "SSE: `fact` kinds, `delta`, `status`, `drain`, and a last "
                        "`revoked` when its key is revoked; or a page"
                    ),
                    "content": {
                        "text/event-stream": {"schema": {"type": "string"}},
                        "application/json": {"schema": _ref("FactPage")},
                    },
                },
                **_BAD,
                **_NO_SESSION,
                **_AUTHENTICATED,
                "429": _json(
                    _ref("Error"),
                    "SSE: the key or its tenant has as many event streams open (SSE and "
                    "gRPC together) as it may (`too_many_streams`, naming the limit); or "
                    "too many unknown keys from this address (`too_many_failed_keys`, "
                    "with Retry-After)",
                    _RETRY_AFTER,
                ),
            },
        },
    },
    "/v1/sessions/{id}/context": {
        "parameters": [_SESSION_ID],
        "get": {
            "operationId": "context",
            "summary": "Exactly what the model was (or would be) shown at a seq",
            "parameters": [
                {
                    "name": "at",
                    "in": "query",
                    "description": "A context head seq; default the session's head",
                    "schema": _SEQ,
                }
            ],
            "responses": {
                "200": _json(_ref("Context"), "The request the model saw"),
                **_BAD,
                **_NO_SESSION,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/blobs": {
        "post": {
            "operationId": "createBlob",
            "summary": "Start a resumable upload of `length` bytes",
            "requestBody": _body(_ref("BlobCreate")),
            "responses": {
                "201": _json(_ref("Blob"), "Created", _UPLOAD_OFFSET),
                **_BAD,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        }
    },
    "/v1/blobs/{id}": {
        "parameters": [_BLOB_ID],
        "get": {
            "operationId": "getBlob",
            "summary": "The upload's state",
            "responses": {
                "200": _json(_ref("Blob"), "The blob", _UPLOAD_OFFSET),
                "404": _error("No such blob (or another tenant's)"),
                **_AUTHENTICATED,
            },
        },
        "head": {
            "operationId": "blobOffset",
            "summary": "The upload's offset, in headers",
            "responses": {
                "200": {
                    "description": "Upload-Offset and Upload-Length",
                    "headers": {
                        **_UPLOAD_OFFSET,
                        "Upload-Length": {"required": True, "schema": _SEQ},
                    },
                },
                "404": {"description": "No such blob (or another tenant's)"},
                "401": {"description": "Missing or unknown API key"},
                "429": {
                    "description": "Too many unknown keys from this address",
                    "headers": _RETRY_AFTER,
                },
            },
        },
        "patch": {
            "operationId": "appendBlob",
            "summary": "Append a chunk at Upload-Offset",
            "parameters": [
                {
                    "name": "Upload-Offset",
                    "in": "header",
                    "required": True,
                    "description": "Where the client believes the upload is",
                    "schema": _COUNT,
                }
            ],
            "requestBody": {
                "required": True,
                "content": {"application/offset+octet-stream": {}, "*/*": {}},
            },
            "responses": {
                "200": _json(_ref("Blob"), "Appended", _UPLOAD_OFFSET),
                "400": _error("No or bad Upload-Offset"),
                "404": _error("No such blob (or another tenant's)"),
                "409": _error("Wrong offset (the message tells the real one)"),
                "408": _TOO_LARGE["408"],
                "413": _error("The chunk goes past the declared length, or is too large"),
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/blobs/{id}/content": {
        "parameters": [_BLOB_ID],
        "get": {
            "operationId": "blobContent",
            "summary": "The bytes of a complete blob, with its content type",
            "responses": {
                "200": {"description": "The bytes", "content": {"*/*": {}}},
                "404": _error("No such blob (or another tenant's)"),
                "409": _error("The upload is not complete"),
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/runtime/drain": {
        "post": {
            "operationId": "drain",
            "summary": "Drain one runtime, or every attached runner (operator key); "
            "answers once the drains have finished",
            "requestBody": _optional_body(_ref("Drain")),
            "responses": {
                "202": _json(_ref("Drained"), "Drained"),
                "403": _error("Not an operator key"),
                "404": _error("No runtime with this id is registered"),
                "409": _error("The runtime named is gone, or is an edge other than this one"),
                **_BAD,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        }
    },
    "/v1/runtime/drain/undo": {
        "post": {
            "operationId": "undoDrain",
            "summary": "Undo drains that have not finished (operator key)",
            "requestBody": _optional_body(_ref("DrainUndo")),
            "responses": {
                "200": _json(_ref("DrainUndone"), "Undone"),
                "403": _error("Not an operator key"),
                "404": _error("No runtime with this id is registered"),
                "409": _error("The runtime named is gone, or its drain has finished"),
                **_BAD,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        }
    },
    "/v1/runtime/status": {
        "get": {
            "operationId": "runtimeStatus",
            "summary": "Every runtime's state (admin: its tenant's sessions; operator: all)",
            "responses": {
                "200": _json(_ref("RuntimeStatus"), "The runtimes"),
                "403": _error("Neither an admin nor an operator key"),
                **_AUTHENTICATED,
            },
        }
    },
    "/v1/loadout": {
        "get": {
            "operationId": "getLoadout",
            "summary": "The tenant's latest loadout and its revision (admin key)",
            "responses": {
                "200": _json(_ref("Loadout"), "The loadout", _ETAG),
                "403": _error("Not an admin key"),
                **_AUTHENTICATED,
            },
        },
        "put": {
            "operationId": "putLoadout",
            "summary": "Store a new revision of the tenant's loadout (admin key)",
            "description": "The body is the document, or GET /v1/loadout's answer "
            "(`{revision, document}`) edited: its revision is then the If-Match. An empty "
            "document is refused (it would reset the prompt, model and tools); `null` "
            "unsets a field. Attempts already running keep the revision they started "
            "with; the next attempt uses the new one.",
            "parameters": [
                {
                    "name": "If-Match",
                    "in": "header",
                    "required": False,
                    "description": "Store only if this is still the latest revision",
                    "schema": _STRING,
                }
            ],
            "requestBody": _body({"anyOf": [_ref("LoadoutDocument"), _ref("LoadoutReadBack")]}),
            "responses": {
                "200": _json(_ref("LoadoutStored"), "Stored", _ETAG),
                "400": _error(
                    "Invalid or empty document (the message names the field), or an "
                    "If-Match other than the body's revision"
                ),
                "403": _error("Not an admin key"),
                "412": _error("If-Match names another revision than the latest"),
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/tenants": {
        "get": {
            "operationId": "listTenants",
            "summary": "Every tenant (operator key)",
            "responses": {
                "200": _json(_ref("TenantList"), "The tenants"),
                "403": _error("Not an operator key"),
                **_AUTHENTICATED,
            },
        },
        "post": {
            "operationId": "createTenant",
            "summary": "Create a tenant (operator key)",
            "requestBody": _body(_ref("TenantCreate")),
            "responses": {
                "201": _json(_ref("TenantCreated"), "Created"),
                "200": _json(_ref("TenantCreated"), "It existed already"),
                "403": _error("Not an operator key"),
                **_BAD,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/keys": {
        "get": {
            "operationId": "listKeys",
            "summary": "API keys (operator: any tenant's; admin: its tenant's), never the keys",
            "parameters": [
                {
                    "name": "tenant",
                    "in": "query",
                    "description": "Only this tenant's keys",
                    "schema": _STRING,
                }
            ],
            "responses": {
                "200": _json(_ref("ApiKeyList"), "The keys"),
                "403": _error("Neither an admin nor an operator key"),
                "404": _error("No such tenant (or another tenant, for an admin)"),
                **_BAD,
                **_AUTHENTICATED,
            },
        },
        "post": {
            "operationId": "createKey",
            "summary": "Create an API key; the key is in this answer only",
            "description": "An admin creates keys of its own tenant, never operator keys.",
            "requestBody": _optional_body(_ref("ApiKeyCreate")),
            "responses": {
                "201": _json(_ref("ApiKeyCreated"), "Created"),
                "403": _error("Not allowed for this key"),
                "404": _error("No such tenant (or another tenant, for an admin)"),
                **_BAD,
                **_TOO_LARGE,
                **_AUTHENTICATED,
            },
        },
    },
    "/v1/keys/{keyId}": {
        "parameters": [{"name": "keyId", "in": "path", "required": True, "schema": _STRING}],
        "delete": {
            "operationId": "revokeKey",
            "summary": "Revoke a key: it gets 401 at once on every edge",
            "responses": {
                "200": _json(_ref("ApiKeyRevoked"), "Revoked"),
                "403": _error("Not allowed for this key"),
                "404": _error("No such key (or another tenant's)"),
                **_AUTHENTICATED,
            },
        },
    },
    "/internal/v1/drain": {
        "post": {
            "operationId": "localDrain",
            "security": [],
            "summary": "Internal: drain this edge (`keel drain --local`), from this host with "
            "the internal token in x-keel-token; answers once its streams are gone or "
            "the deadline has passed",
            "requestBody": _optional_body(_ref("LocalDrain")),
            "responses": {
                "200": _json(_ref("LocalDrained"), "Drained (or undone)"),
                "401": _error("No internal token, or a wrong one"),
                "403": _error("Not from this host, or this edge has no internal token"),
                "409": _error("Another edge's id, or an undo after the drain finished"),
                **_BAD,
                **_TOO_LARGE,
            },
        }
    },
    "/healthz": {
        "get": {
            "operationId": "healthz",
            "security": [],
            "summary": "The process is alive",
            "responses": {"200": _json(_object(["ok"], {"ok": {"const": True}}), "alive")},
        }
    },
    "/readyz": {
        "get": {
            "operationId": "readyz",
            "security": [],
            "summary": "The edge can serve (the kernel answers, not draining)",
            "description": "Still 200 when no runner claims: inputs are accepted (durably) "
            "and wait for a runner, and taking every edge out of service would only make "
            "the sessions unreadable too. `claimingRunners` in /v1/runtime/status (and "
            "`keel status`) says when nothing claims.",
            "responses": {
                "200": _json(_object(["ready"], {"ready": {"const": True}}), "ready"),
                "503": _error("draining, or the kernel is not reachable"),
            },
        }
    },
    "/metrics": {
        "get": {
            "operationId": "metrics",
            "summary": "Prometheus metrics (operator key)",
            "description": "Behind the operator key, sent as Authorization: Bearer: give "
            "the scraper an operator key. A client that left mid-request is counted as "
            "status 499, not 500.",
            "responses": {
                "200": {
                    "description": "Prometheus text format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                "403": _error("Not an operator key"),
                **_AUTHENTICATED,
            },
        }
    },
    "/openapi.json": {
        "get": {
            "operationId": "openapi",
            "security": [],
            "summary": "This document",
            "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")},
        }
    },
    "/": {
        "get": {
            "operationId": "page",
            "security": [],
            "summary": "The web page",
            "responses": {
                "200": {
                    "description": "HTML",
                    "content": {"text/html": {"schema": {"type": "string"}}},
                }
            },
        }
    },
}


def _with_common_refusals(paths: dict[str, Schema]) -> dict[str, Schema]:
    """What any operation may answer besides its own (the page aside, whose
    URL is the browser's): 400 for a query parameter it does not take, 431
    for a request head over the limit; 415 wherever a JSON body is read."""
    for path, item in paths.items():
        if path == "/":
            continue
        for method, operation in item.items():
            if method == "parameters":
                continue
            responses = operation["responses"]
            if method == "head":
                responses.setdefault("400", {"description": "An unknown query parameter"})
                responses.setdefault("431", {"description": _HEAD_TOO_LARGE})
                continue
            responses.setdefault(
                "400", _error("Bad input: a query parameter this operation does not take")
            )
            responses.setdefault("431", _error(_HEAD_TOO_LARGE))
            if "application/json" in operation.get("requestBody", {}).get("content", {}):
                responses.setdefault("415", _error(_NOT_JSON))
    return paths


_HEAD_TOO_LARGE = (
    "The request's head is over the edge's limit (KEEL_EDGE_MAX_HEAD_BYTES, default 32 KiB; "
    "KEEL_EDGE_MAX_HEADERS lines, default 100); the connection is closed"
)
_NOT_JSON = (
    "The body's Content-Type is not JSON. Without one, or with application/json, "
    "*/*+json, application/x-www-form-urlencoded (curl -d) or text/plain (fetch), the body "
    "is read as JSON; `unsupported_media_type`"
)

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "Keel edge",
        "version": "1.0.0",
        "description": "Errors are JSON `{error: {code, message}}` with a 4xx status. "
        "The key goes in the Authorization header (`Bearer <key>`); `?access_token=` is "
        "accepted on GET /v1/sessions/{id}/events only. Unknown keys are limited per "
        "client address (429 with Retry-After), event streams per key and per tenant "
        "(429), and a request's head and body must keep arriving (408). A request's head "
        "is at most 32 KiB and 100 header lines (431). A query parameter an operation does "
        "not list is refused (400), as an unknown body field is. Every answer "
        "carries X-Content-Type-Options: nosniff, a Content-Security-Policy with "
        "frame-ancestors 'none', X-Frame-Options: DENY and Referrer-Policy: no-referrer.",
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": _SCHEMAS,
    },
    "security": [{"bearer": []}],
    "paths": _with_common_refusals(_PATHS),
}
