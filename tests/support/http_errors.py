"""The edge's error body, checked the same way wherever a test expects a refusal."""

from __future__ import annotations

import httpx


def assert_error(response: httpx.Response, status: int) -> dict[str, str]:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["code"], str) and error["code"]
    assert isinstance(error["message"], str) and error["message"]
    return error  # type: ignore[no-any-return]
