"""Every operation of /openapi.json, fuzzed against a real edge over real HTTP.

schemathesis generates requests from the document the edge serves, valid
ones and invalid ones, with a key of tenant "default" that may do anything
(admin and operator); each answer must be documented (status, content type,
JSON body against its schema) and never a 5xx, and the edge must still
answer afterwards. Generation is derandomized with a bounded number of
examples, so every run sends the same requests.

The edge serves on the test's event loop; schemathesis's calls are blocking,
so they run on a worker thread while the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from typing import Any

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import HypothesisDeprecationWarning, Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup

from tests.support.edge_stack import ADMIN_KEY, Stack

# Per operation and mode; KEEL_FUZZ_EXAMPLES raises it for a longer hunt.
EXAMPLES_PER_OPERATION = int(os.environ.get("KEEL_FUZZ_EXAMPLES", "10"))
# How long one request may take before the fuzz run calls it hung.
REQUEST_TIMEOUT_S = 10.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Operations that would end the run rather than test the edge: one that
# revokes keys (the fuzzer's own key among them) is fuzzed with a key id
# that cannot exist, see `_pinned`.
_PINNED_KEY_ID = {("DELETE", "/v1/keys/{keyId}"): {"keyId": "fuzz-no-such-key"}}


def _pinned(operation: Any, real_session: str | None) -> dict[str, Any]:
    """Path parameters held fixed: a key id that cannot exist, or (for a
    second round on each session route) a session that does, so generated
    bodies reach past the "no such session" check."""
    path_parameters = _PINNED_KEY_ID.get((operation.method.upper(), operation.path))
    if real_session is not None:
        path_parameters = {"id": real_session}
    return {"path_parameters": path_parameters} if path_parameters else {}


def _call(case: Any, base_url: str, session: requests.Session) -> requests.Response:
    """Sends `case` with the admin key; an event stream that opened is only
    checked for its head (its body never ends)."""
    kwargs = case.as_transport_kwargs(base_url=base_url)
    kwargs["headers"] = {**(kwargs.get("headers") or {}), "Authorization": f"Bearer {ADMIN_KEY}"}
    response = session.request(
        **kwargs, stream=True, timeout=REQUEST_TIMEOUT_S, allow_redirects=False
    )
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        response.close()
    else:
        _ = response.content
    return response


def _fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    base_url: str,
    failures: list[str],
    real_session: str | None = None,
) -> None:
    session = requests.Session()

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode, **_pinned(operation, real_session)))
    def run(case: Any) -> None:
        response = _call(case, base_url, session)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            assert response.status_code == 200
            return
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as found:
            # Collected rather than raised: one run reports every operation's.
            titles = "; ".join(sorted({f.title for f in found.exceptions}))
            if any(
                f.startswith(f"{case.method} {operation.path} ") and titles in f for f in failures
            ):
                return  # one example of each failure per operation is enough
            failures.append(
                f"{case.method} {operation.path} {case.formatted_path} query={case.query}"
                f" body={case.body!r:.200} -> {response.status_code}"
                f" {response.text[:300]}: {titles}"
            )

    try:
        with warnings.catch_warnings():
            # schemathesis's negative strategies draw from `random`, which
            # hypothesis seeds per example (so runs stay deterministic) but
            # warns about.
            warnings.simplefilter("ignore", HypothesisDeprecationWarning)
            run()
    except Unsatisfiable:
        # Nothing to make invalid (no parameter, no body): nothing to send.
        if mode is not GenerationMode.NEGATIVE:
            raise
    finally:
        session.close()


def _fuzz_all(document: dict[str, Any], base_url: str, real_session: str) -> tuple[list[str], int]:
    schema = schemathesis.openapi.from_dict(document)
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # an Err raises here
        operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(operation, mode, base_url, failures)
            if operation.path.startswith("/v1/sessions/{id}"):
                _fuzz_operation(operation, mode, base_url, failures, real_session)
    return failures, operations


async def _document(stack: Stack) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=stack.url) as anonymous:
        response = await anonymous.get("/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


async def test_every_operation_answers_as_documented_under_fuzzing(stack: Stack) -> None:
    document = await _document(stack)
    real = await stack.new_session("fuzz-real")
    await stack.post_input(real, "hello", "fuzz-input-1")
    failures, operations = await asyncio.to_thread(_fuzz_all, document, stack.url, real)
    assert operations == sum(
        1
        for item in document["paths"].values()
        for verb in item
        if verb in {"get", "put", "post", "delete", "patch", "head"}
    )
    assert not failures, "\n".join(failures[:20])
    # Still up, and still serving the key the fuzzer used.
    alive = await stack.http.get("/v1/sessions")
    assert alive.status_code == 200, alive.text


async def test_calls_without_a_key_are_refused_as_documented(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as anonymous:
        for method, path in (
            ("GET", "/v1/sessions"),
            ("POST", "/v1/sessions"),
            ("GET", "/v1/loadout"),
            ("GET", "/v1/keys"),
            ("POST", "/v1/blobs"),
        ):
            response = await anonymous.request(method, path)
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["error"]["code"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"


async def test_a_bad_tenant_filter_is_a_documented_400(stack: Stack) -> None:
    """Regression: GET /v1/keys?tenant=<not an id> answered 400, which the
    document did not list (found by the fuzzer)."""
    document = await _document(stack)
    assert "400" in document["paths"]["/v1/keys"]["get"]["responses"]
    response = await stack.http.get("/v1/keys", params={"tenant": "not an id!"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "bad_request"
