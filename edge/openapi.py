"""The OpenAPI document of the edge's HTTP API (served at /openapi.json)."""

from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    "400": _json(_ref("Error"), "Bad input"),
    "401": _json(_ref("Error"), "Missing or unknown API key"),
    "404": _json(_ref("Error"), "No such session (or another tenant's)"),
}
# Session ids are per tenant: two tenants may each have a session "s-1".
_ID_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.\\-]{0,63}$"}
_SESSION_ID = {"name": "id", "in": "path", "required": True, "schema": _ID_SCHEMA}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "Keel edge", "version": "1.0.0"},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                    }
                },
            },
            "Input": {
                "type": "object",
                "required": ["text", "requestId"],
                "properties": {
                    "text": {"type": "string"},
                    "requestId": {"type": "string"},
                    "blobs": {"type": "array", "items": {"type": "string"}},
                },
            },
            "Seq": {"type": "object", "properties": {"seq": {"type": "integer"}}},
            "Fact": {
                "type": "object",
                "properties": {
                    "seq": {"type": "integer"},
                    "kind": {"type": "string"},
                    "timestamp": {"type": "integer"},
                    "epoch": {"type": "integer"},
                    "data": {"type": "object"},
                },
            },
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/v1/sessions": {
            "post": {
                "summary": "Create a session for the key's tenant",
                "description": "With `id`, that id (unique within the tenant); else a new one.",
                "requestBody": {
                    "content": {
                        "application/json": {
                            "schema": {"type": "object", "properties": {"id": _ID_SCHEMA}}
                        }
                    }
                },
                "responses": {
                    "201": _json({"type": "object", "properties": {"id": _ID_SCHEMA}}),
                    "409": _json(_ref("Error"), "The tenant has a session with this id"),
                    **_ERRORS,
                },
            },
            "get": {"summary": "List the tenant's sessions", "responses": {"200": _json({})}},
        },
        "/v1/sessions/{id}": {
            "get": {
                "summary": "Head seq, status and owed inputs",
                "parameters": [_SESSION_ID],
                "responses": {"200": _json({"type": "object"}), **_ERRORS},
            }
        },
        "/v1/sessions/{id}/inputs": {
            "post": {
                "summary": "Commit an input (idempotent by requestId)",
                "parameters": [_SESSION_ID],
                "requestBody": {"content": {"application/json": {"schema": _ref("Input")}}},
                "responses": {
                    "202": _json(_ref("Seq"), "Committed"),
                    "200": _json(_ref("Seq"), "Already committed with this requestId"),
                    "409": _json(_ref("Error"), "requestId used for another input"),
                    **_ERRORS,
                },
            }
        },
        "/v1/sessions/{id}/retry": {
            "post": {
                "summary": "Re-ask a committed input",
                "parameters": [_SESSION_ID],
                "responses": {"202": _json(_ref("Seq")), **_ERRORS},
            }
        },
        "/v1/sessions/{id}/cancel": {
            "post": {
                "summary": "Cancel the current work of the session",
                "parameters": [_SESSION_ID],
                "responses": {"202": _json(_ref("Seq")), **_ERRORS},
            }
        },
        "/v1/sessions/{id}/events": {
            "get": {
                "summary": "SSE of facts (id: seq) and partials; ?format=json for a page",
                "parameters": [
                    _SESSION_ID,
                    {"name": "after", "in": "query", "schema": {"type": "integer"}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer"}},
                    {"name": "format", "in": "query", "schema": {"enum": ["json"]}},
                    {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}},
                ],
                "responses": {"200": {"description": "text/event-stream"}, **_ERRORS},
            }
        },
        "/v1/sessions/{id}/context": {
            "get": {
                "summary": "Exactly what the model was (or would be) shown at a seq",
                "parameters": [
                    _SESSION_ID,
                    {"name": "at", "in": "query", "schema": {"type": "integer"}},
                ],
                "responses": {"200": _json({"type": "object"}), **_ERRORS},
            }
        },
        "/v1/blobs": {
            "post": {"summary": "Start a resumable upload", "responses": {"201": _json({})}}
        },
        "/v1/blobs/{id}": {
            "head": {"summary": "The upload's offset", "responses": {"200": {"description": "OK"}}},
            "patch": {
                "summary": "Append a chunk at Upload-Offset",
                "responses": {
                    "200": _json({}),
                    "409": _json(_ref("Error"), "Wrong offset"),
                },
            },
        },
        "/v1/runtime/drain": {
            "post": {"summary": "Drain a runtime (admin)", "responses": {"202": _json({})}}
        },
        "/v1/runtime/status": {
            "get": {"summary": "Every runtime's state (admin)", "responses": {"200": _json({})}}
        },
        "/healthz": {"get": {"security": [], "responses": {"200": {"description": "alive"}}}},
        "/readyz": {"get": {"security": [], "responses": {"200": {"description": "ready"}}}},
        "/metrics": {"get": {"security": [], "responses": {"200": {"description": "Prometheus"}}}},
    },
}
